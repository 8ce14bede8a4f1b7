#!/usr/bin/env bash
# The one device-call script: every GPU run behind bench/results/ and docs/repro/ is a stage here.
#   bash bench/gpu.sh STAGE [STAGE ...]          (from the repo root on the GPU machine)
#
# Stages (each writes its log, and its JSON where it has one, under $OUT):
#   smoke      what every change to sonic/ is proven with: every GPU test, then the trainer on sonic_7b cut to
#              16 layers for 30 steps per kernel backend (python -m bench.smoke; $SONIC_COMMIT names the commit
#              when the machine has no .git); writes bench/results/<date>-<gpu>-smoke.json. It (and `tests`) first
#              compiles every cute kernel the carried cache names for this tree's sources, on all cores
#              (bench.cute_cache --from .cute_cache; what is there already only loads). .gpu/b, .whl and the
#              whole cache's tarball together pass the carry limit: the bundle unpacked by an earlier call stays on
#              the warm machine, so that call carries .gpu/b and the smoke's call .whl and the tarball. On a fresh machine
#              the GPU tests compile every triton kernel cold and ran past a 330 s --tests-timeout even with the
#              cute cache carried in: run `TESTS="tests/kernels" bash bench/gpu.sh tests` first on the same warm
#              machine (the next call within 30 s), and carry .gpu/b in every call that needs cute (a released
#              machine starts bare)
#   tests      every GPU test (pytest $TESTS -m gpu; TESTS defaults to tests)
#   levers     per-lever step throughput, sonic_7b cut to $LAYERS layers (python -m bench.levers)
#   profile    the real trainer's 40-layer sonic_7b step under torch.profiler: where the GPU idles and why
#              (python -m bench.trainer_profile); $PROFILE_ARGS adds options and overrides
#   e2e        the 40-layer sonic_7b with the real trainer on the local BPE data, on every visible GPU
#              (python -m scripts.repro.e2e_throughput --run); $E2E_ARGS adds options
#   kernels    Table 9b: all twelve layer configs x cute, triton, grouped_mm
#   sparse     Fig. 16: the four sparse panels x cute, triton
#   tr SEEDS   Table 3a reduced run: three arms of the 0.5B 8/64 model per seed
#   cute       the CuTe self-check (hang-guarded), then its layer benchmark ($SHAPES)
#   first_step $FIRST_STEP_MODEL (default qwen3_30b_a3b, $FIRST_STEP_LAYERS layers) to its first training
#              step with meta-device init on every visible GPU (python -m scripts.first_step)
#   kill_resume SIGKILL, corrupt-checkpoint and SIGUSR1 resumes of a 2-GPU job vs an uninterrupted one
#   block      the model's MoE block (router included) vs the official sonic-moe, Table 9b configs, interleaved
#              (python -m bench.moe_block); $BLOCK_ARGS adds options (e.g. --configs 7B,30B to iterate on two,
#              --resume to continue a cut-short run). The official layer's autotune results are kept in
#              .quack_cache/<gpu> (QUACK_CACHE_DIR, QUACK_CACHE_AUTOTUNING=1) and come back as
#              $OUT/quack_cache-<gpu>.tar.gz: see .quack_cache below
#   attention  causal attention by each core (sdpa, flex, fa4) at sonic_7b's shape, fwd and fwd+bwd, interleaved
#              (python -m bench.attention); $ATTENTION_ARGS adds options. fa4 needs flash-attn-4 and einops in .whl
#   centring   the router's prefix centring alone: fused Triton kernels vs the PyTorch definition and the plain
#              linear router, fwd and bwd, at sonic_7b's, 30B's and OLMoE's d and E (python -m bench.centring);
#              $CENTRING_ARGS adds options (e.g. --sweep 32,64,4/64,128,4 for tile configs)
#   gather_sum the cute gather-sum by chunks per lane and column slice, the measurement behind its default
#              (python -m bench.gather_sum); $GATHER_SUM_ARGS adds options
#   tiles      cute tile configs in the compiled block they run in, the defaults against $TILES (e.g. up=pp128,dh=co256)
#              at $TILE_CONFIGS (default 7B,30B), alternating processes (python -m bench.block_ab --tiles), as the
#              model runs them (the `cute` stage times each kernel alone, a diagnostic)
#   fuzz       the fuzzed-shape kernel tests (tests/kernels/test_fuzz_shapes.py) for cute and triton
#   ep         expert parallelism vs FSDP alone on every visible GPU: sonic_7b cut to $EP_LAYERS layers at
#              ep=1,2 on local BPE text, then $FIRST_STEP_MODEL cut to $FIRST_STEP_LAYERS at ep=2 on the
#              embedded corpus (python -m bench.expert_parallel)
#   routing    issue #30: sonic_7b cut to each of $ROUTING_LAYERS (default 16) layers on the local BPE data,
#              100 steps, the cosine peak at step $ROUTING_WARMUP (default 20; issue #25's run at its recipe's
#              speed: ROUTING_LAYERS=40 ROUTING_WARMUP=50 ROUTING_BACKEND=cute), kernels of $ROUTING_BACKEND
#              (default triton), one run per arm of $ROUTING_ARMS (default "topk-prefix
#              topk-none": routing group - routing.input_centring, then optional +key=value overrides of
#              model.moe.routing, e.g. topk-prefix+bias_update_rate=0.05, or of any dotted key, e.g.
#              topk-prefix+model.ffn_out_init=unscaled, tagged -ffn_out_initunscaled), each layer's load curve and the router
#              diagnostics (python -m bench.routing_health; bench/results/<date>-<gpu>-routing_health-<tag>.json,
#              tag <L>L-<group>-<centring>[-<key><value>...][-w<warmup>][-<backend>], the last two where not the
#              defaults; diagnostics every $ROUTING_DIAG_EVERY steps, default 20; $ROUTING_ARGS adds options, e.g.
#              --grad-norms for every step's pre-clip gradient norm by parameter kind and layer)
#   peer       issue #25's like-for-like step against torchtitan 0.3.0 (python -m bench.peer_titan --compile, one
#              process per side of $PEER_SIDES, default "titan sonic"; $PEER_ARGS adds options, e.g. --layers 8);
#              rows appended to bench/results/<date>-<gpu>-peer_titan.jsonl. Carry .tt holding the wheels that
#              bench/peer_titan.py names (they travel zipped and are unpacked here)
#
# What the GPU image lacks travels in ignored folders named in the call's `carry`:
#   .whl   wheels: hydra-core, omegaconf, antlr4-python3-runtime (needed), liger-kernel and
#          cut-cross-entropy (optional loss backends), flash-attn-4 and einops (the fa4 attention core, which auto
#          takes where it can run; its CuTe DSL and quack-kernels come with .gpu's bundle); installed into /tmp/site
#          by every call
#   .gpu   the CuTe DSL + official sonic-moe bundle (../shared/gpu/bundle.sh, two calls), for cute
#          and for the official baseline; found at /root/gpu once unpacked. Call 1 (carry .gpu/a) only copies
#          .gpu/a/part to /root/gpu/part.a; any stage run with .gpu/b carried unpacks the two itself
#   .quack_cache  the official layer's autotune results per GPU kind (optional; without them the official
#          layer tunes again on its first call per config). After a block call, unpack what it returned
#          here (mkdir -p .quack_cache && tar -xzf <returned>/quack_cache-h100.tar.gz -C .quack_cache)
#          and carry .quack_cache in the later calls: the tuning is then paid once per GPU kind
# Every file a stage writes under bench/results or docs/repro is also copied to $OUT/results (the machine's tree
# is replaced by the next call's). The machine's copy has no .git of its own (one it carries is an earlier
# call's, so result files then record <that HEAD>+modified): name the commit for the result files
# (bench.common.write_json records it)
#   SONIC_COMMIT=<git rev-parse --short HEAD, run here> bash bench/gpu.sh STAGE
#   .cute_cache  the cute kernels' compiled object files (SONIC_CUTE_CACHE_DIR, keyed by shape class, SM count, DSL
#          version and a hash of the kernel sources; optional). A fresh machine compiles every cute kernel the
#          tests and the smoke use (minutes); after a stage that compiles them, those of this tree's sources come
#          back as $OUT/cute_cache.tar.gz: unpack it here (rm -rf .cute_cache && mkdir .cute_cache && tar -xzf
#          <returned>/cute_cache.tar.gz -C .cute_cache) and carry .cute_cache while the cute sources stay as they are.
#          Or fill it here, on the CPU and no device time (the DSL compiles for sm_90a without a GPU):
#            python -m bench.cute_cache --out .cute_cache [--configs 7B,30B] [--from <an older cache folder>] --jobs 2
#          (--from recompiles every kernel an older cache names, e.g. the tests' shapes after a kernel change)
#          Where the call's tree would pass its size limit, carry the returned tarball instead, as
#          .gpu/cute_cache.tar.gz (a third of the size): it is unpacked into .cute_cache here
set -uo pipefail
export PYTHONUNBUFFERED=1 SONIC_CUTE_CACHE_DIR=/root/.cache/sonic/cute
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast here
OUT="${OUT:-/tmp/sonic-out}"; mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# the bundle's second half, carried as .gpu/b after call 1 left the first at /root/gpu/part.a (../shared/gpu/bundle.sh)
if [ ! -d /root/gpu/site-packages ] && [ -f /root/gpu/part.a ] && [ -f .gpu/b/part ]; then
  cat /root/gpu/part.a .gpu/b/part | xz -dc | tar x -C /root/gpu || echo "the CuTe DSL bundle did not unpack" >&2
fi
SITE="/tmp/site"
[ -d /root/gpu/site-packages ] && SITE="$SITE:/root/gpu/site-packages:/root/gpu/site-packages/nvidia_cutlass_dsl/dsl_packages"
export PYTHONPATH=".:$SITE:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee -a "$OUT/gpu.txt"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }
if [ -f .gpu/cute_cache.tar.gz ]; then
  mkdir -p .cute_cache && tar -xzf .gpu/cute_cache.tar.gz -C .cute_cache
fi
if [ -d .cute_cache ]; then  # carried in: a file of other sources or another SM count is never looked up
  mkdir -p "$SONIC_CUTE_CACHE_DIR" && cp -n .cute_cache/*.o "$SONIC_CUTE_CACHE_DIR"/ 2>/dev/null
  log "cute compile cache: $(find .cute_cache -name '*.o' | wc -l) object files carried in"
fi

fill_cute_cache() {  # every kernel the carried cache names, compiled for this tree's sources on all cores before the
  # GPU tests need them: after a change to the kernel sources the carried objects are stale, and the tests compiling
  # them one at a time ran past their timeout; objects already there are only loaded (seconds)
  [ -d .cute_cache ] && python3 -c "import cutlass" 2>/dev/null || return 0
  timeout "${CUTE_FILL_S:-300}" python3 -m bench.cute_cache --out "$SONIC_CUTE_CACHE_DIR" --from .cute_cache \
    --jobs "$(nproc)" 2>&1 | tail -1 | while read -r line; do log "cute compile cache: $line"; done
}

pack_cute_cache() {  # the object files of this tree's cute sources, to carry into the next fresh machine
  local hash files
  [ -d "$SONIC_CUTE_CACHE_DIR" ] || return 0
  hash=$(python3 -c "from sonic.kernels.cute.ops import _source_hash; print(_source_hash())" 2>/dev/null) || return 0
  mapfile -t files < <(find "$SONIC_CUTE_CACHE_DIR" -maxdepth 1 -name "*_$hash.o" -printf '%f\n')
  [ "${#files[@]}" -gt 0 ] || return 0
  tar -czf "$OUT/cute_cache.tar.gz" -C "$SONIC_CUTE_CACHE_DIR" "${files[@]}" \
    && log "cute compile cache: ${#files[@]} object files, $(du -h "$OUT/cute_cache.tar.gz" | cut -f1), $OUT/cute_cache.tar.gz"
}

run_stage() {
  case "$1" in
    smoke)
      fill_cute_cache
      timeout "${SMOKE_S:-560}" python3 -m bench.smoke ${SMOKE_ARGS:-} 2>&1 | tee "$OUT/smoke.log" | tail -30 ;;
    tests)
      fill_cute_cache
      timeout "${TESTS_S:-400}" python3 -m pytest ${TESTS:-tests} -m gpu -q -rfE -p no:cacheprovider 2>&1 | tail -60 \
        | tee "$OUT/gpu_tests.log" ;;
    levers)
      timeout "${LEVERS_S:-540}" python3 -m bench.levers --layers "${LAYERS:-8}" ${LEVERS_ARGS:-} 2>&1 \
        | grep -v Warning | tee "$OUT/levers.log" | tail -40 ;;
    profile)
      timeout "${PROFILE_S:-400}" python3 -m bench.trainer_profile ${PROFILE_ARGS:-} 2>&1 \
        | grep -v "INFO\] - step\|Warning" | tee "$OUT/trainer_profile.log" | tail -8 ;;
    tiles)
      [ -n "${TILES:-}" ] || { log "tiles: set TILES, e.g. TILES=up=pp128"; return 1; }
      timeout "${TILES_S:-500}" python3 -m bench.block_ab --tree default=. --tree tiles=. --tiles "tiles=$TILES" \
        --configs "${TILE_CONFIGS:-7B,30B}" --rounds "${TILE_ROUNDS:-3}" 2>&1 | grep -v Warning \
        | tee "$OUT/tiles.log" | tail -20 ;;
    attention)
      timeout "${ATTENTION_S:-300}" python3 -m bench.attention ${ATTENTION_ARGS:-} 2>&1 | grep -v Warning \
        | tee "$OUT/attention.log" | tail -12 ;;
    centring)
      timeout "${CENTRING_S:-300}" python3 -m bench.centring ${CENTRING_ARGS:-} 2>&1 | grep -v Warning \
        | tee "$OUT/centring.log" | tail -20 ;;
    gather_sum)
      timeout "${GATHER_SUM_S:-240}" python3 -m bench.gather_sum ${GATHER_SUM_ARGS:-} 2>&1 | grep -v Warning \
        | tee "$OUT/gather_sum.log" | tail -12 ;;
    e2e)
      timeout "${E2E_S:-560}" python3 -m scripts.repro.e2e_throughput --run ${E2E_ARGS:-} 2>&1 \
        | grep -v "INFO\] - step" | tee "$OUT/e2e.log" | tail -60 ;;
    kernels)
      timeout 540 python3 -m scripts.repro.kernel_throughput --run --backends cute,triton,grouped_mm -- --no-official \
        2>&1 | tail -80 | tee "$OUT/kernels.log" ;;
    sparse)
      timeout 330 python3 -m scripts.repro.sparse_tr --run --sweep-backends cute,triton 2>&1 | tail -60 \
        | tee "$OUT/sparse.log" ;;
    tr)
      timeout 560 python3 -m scripts.repro.tr_quality --reduced --seeds "${SEEDS:-0}" --arm-timeout 180 2>&1 \
        | grep -v "INFO\] - step" | tail -60 | tee "$OUT/tr_reduced.log" ;;
    cute)
      timeout 240 python3 -m sonic.kernels.cute.selfcheck --hang-s 20 --shape 300,384,192,8,2 \
        --shape 517,512,256,6,3 --shape 8192,512,128,64,4 --routing uniform --routing skewed --routing empty \
        2>&1 | tee "$OUT/selfcheck.log" | grep -v "^ok"
      for shape in ${SHAPES:-7b}; do
        timeout 240 python3 bench/cute_gemm.py --shape "$shape" --layer --out "$OUT/cute-$shape.json" 2>&1 \
          | tee "$OUT/bench-$shape.log" | tail -25
      done ;;
    first_step)
      timeout "${FIRST_STEP_S:-300}" python3 -m torch.distributed.run --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
        -m scripts.first_step --json "$OUT/first_step.json" model="${FIRST_STEP_MODEL:-qwen3_30b_a3b}" \
        model.num_layers="${FIRST_STEP_LAYERS:-12}" train.seq_len=4096 train.micro_batch_size=2 2>&1 \
        | grep -v Warning | tee "$OUT/first_step.log" | tail -25 ;;
    kill_resume)  # eager: this is about exact resumption, not speed; --repeat measures kernel nondeterminism
      timeout "${KILL_RESUME_S:-300}" python3 scripts/kill_resume.py --device cuda --repeat --out "$OUT/kill_resume.json" -- \
        parallel.compile=false 2>&1 | tee "$OUT/kill_resume.log" | tail -25 ;;
    block)  # the official layer's autotune results persist per GPU kind, and return as one tar
      gpu=$(python3 -c "from bench.common import gpu_name; print(gpu_name())")
      mkdir -p ".quack_cache/$gpu"
      QUACK_CACHE_DIR="$PWD/.quack_cache/$gpu" QUACK_CACHE_AUTOTUNING=1 timeout "${BLOCK_S:-560}" \
        python3 -m bench.moe_block --budget-s "${BLOCK_BUDGET_S:-420}" --json "$OUT/moe_block.json" ${BLOCK_ARGS:-} \
        2>&1 | tee "$OUT/moe_block.log" | tail -40
      tar -czf "$OUT/quack_cache-$gpu.tar.gz" -C .quack_cache "$gpu"
      log "autotune cache: $(find ".quack_cache/$gpu" -name '*.json' | wc -l) files, $OUT/quack_cache-$gpu.tar.gz" ;;
    fuzz)
      timeout "${FUZZ_S:-400}" python3 -m pytest -q -m gpu tests/kernels/test_fuzz_shapes.py 2>&1 \
        | tee "$OUT/fuzz.log" | tail -30 ;;
    ep)  # the first job builds the local BPE data on a fresh machine (minutes); the second runs on the embedded corpus
      for job in "sonic_7b ${EP_LAYERS:-16} 1,2 4 local_bpe 380" "${FIRST_STEP_MODEL:-qwen3_30b_a3b} ${FIRST_STEP_LAYERS:-12} 2 2 embedded 180"; do
        set -- $job
        timeout "$6" python3 -m torch.distributed.run --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
          -m bench.expert_parallel --eps "$3" --json "$OUT/expert_parallel-$1.json" model="$1" model.num_layers="$2" \
          train.micro_batch_size="$4" data="$5" 2>&1 | grep -v Warning | tee "$OUT/expert_parallel-$1.log" | tail -12
      done ;;
    routing)  # the first run on a fresh machine also builds the local BPE data (a minute or two)
      for layers in ${ROUTING_LAYERS:-16}; do
        for arm in ${ROUTING_ARMS:-topk-prefix topk-none}; do
          base=${arm%%+*}; extra=(); tag="${layers}L-$base"
          warmup=${ROUTING_WARMUP:-20}; backend=${ROUTING_BACKEND:-triton}
          if [ "$arm" != "$base" ]; then  # +key=value[+key=value]: more model.moe.routing overrides
            IFS=+ read -ra kv <<< "${arm#*+}"
            for o in "${kv[@]}"; do  # a dotted key is a whole override (model.ffn_out_init=unscaled), tagged by its leaf
              k=${o%%=*}; [[ $k == *.* ]] && extra+=("$o") || extra+=("model.moe.routing.$o")
              o=${o#"${k%.*}."}; tag+="-${o//=/}"
            done
          fi
          [ "$warmup" = 20 ] || tag+="-w$warmup"
          [ "$backend" = triton ] || tag+="-$backend"
          timeout "${ROUTING_S:-540}" python3 -m bench.routing_health --tag "$tag" \
            --diag-every "${ROUTING_DIAG_EVERY:-20}" ${ROUTING_ARGS:-} experiment=sonic_7b \
            data=local_bpe optim.warmup_steps="$warmup" train.steps=100 model.num_layers="$layers" \
            model.moe.kernel_backend="$backend" routing="${base%-*}" model.moe.routing.input_centring="${base#*-}" \
            "${extra[@]}" 2>&1 | grep -v Warning | tee "$OUT/routing_health-$tag.log" | tail -30
        done
      done ;;
    peer)
      for w in .tt/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" .tt/; done
      for which in ${PEER_SIDES:-titan sonic}; do
        timeout "${PEER_S:-300}" python3 -m bench.peer_titan --which "$which" --compile ${PEER_ARGS:-} 2>&1 \
          | grep -v Warning | tee "$OUT/peer_titan-$which.log" | tail -8
      done ;;
    *) echo "unknown stage $1 (smoke | tests | levers | profile | e2e | kernels | sparse | tr | cute | first_step | kill_resume | block | attention | centring | gather_sum | fuzz | ep | routing | peer)" >&2
       return 2 ;;
  esac
}

for stage in "${@:?name at least one stage}"; do
  log "stage $stage"
  marker=$(mktemp)
  run_stage "$stage"
  rc=$?
  # what a stage writes into the tree (bench/results, docs/repro) comes back under $OUT/results: the machine's copy
  # of the tree is replaced by the next call's, so a result file left only there is lost
  mapfile -t written < <(find bench/results docs/repro -type f -newer "$marker" 2>/dev/null)
  if [ "${#written[@]}" -gt 0 ]; then
    mkdir -p "$OUT/results" && cp "${written[@]}" "$OUT/results/" && log "returned under \$OUT/results: ${written[*]}"
  fi
  rm -f "$marker"
  case "$stage" in smoke|tests|fuzz|block|cute) pack_cute_cache ;; esac
  log "stage $stage rc=$rc"
done
