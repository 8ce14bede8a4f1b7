#!/usr/bin/env bash
# One device call for the CuTe backend: self-check (hang-guarded), GPU tests, timings.
# Needs CuTe DSL on PYTHONPATH (see sonic/kernels/cute/README.md for the two-call bundle set-up).
#   STAGES="check test bench" SHAPES="7b" bash bench/run_cute_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/cute-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"check test bench"}
SHAPES=${SHAPES:-"7b"}
BENCH_ARGS=${BENCH_ARGS:-"--layer"}
CHECK_CONFIGS=${CHECK_CONFIGS:-"default"}  # e.g. "default up=pp128,down=pp128"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, cutlass; from sonic.kernels import cute; \
print('torch', torch.__version__, 'cutlass-dsl', cutlass.__version__, 'reason:', cute.unavailable_reason(torch.device('cuda')))" \
  2>&1 | tee -a "$OUT/steps.log" || exit 2

if [[ " $STAGES " == *" check "* ]]; then
  for cfg in $CHECK_CONFIGS; do
    [[ $cfg == default ]] && cfg=""
    log "selfcheck config=$cfg"
    timeout 240 python -m sonic.kernels.cute.selfcheck --hang-s 20 --config "$cfg" \
        --shape 300,384,192,8,2 --shape 517,512,256,6,3 --shape 8192,512,128,64,4 \
        --routing uniform --routing skewed --routing empty \
        2>&1 | tee -a "$OUT/selfcheck.log" | grep -v "^ok"
    rc=$?
    log "selfcheck rc=$rc"
    [[ $rc == 3 || $rc == 124 ]] && { log "hang: stopping"; exit 3; }
  done
fi
if [[ " $STAGES " == *" test "* ]]; then
  log "pytest"
  timeout 300 python -m pytest tests/kernels/test_cute.py -m gpu -q -p no:cacheprovider \
      --timeout 150 2>&1 | tee "$OUT/pytest.log" | tail -n 30
  log "pytest rc=$?"
fi
if [[ " $STAGES " == *" bench "* ]]; then
  for shape in $SHAPES; do
    log "bench $shape"
    timeout 240 python bench/cute_gemm.py --shape "$shape" $BENCH_ARGS --out "$OUT/cute-$shape.json" \
        2>&1 | tee "$OUT/bench-$shape.log" | tail -n 25
  done
fi
log "done"
