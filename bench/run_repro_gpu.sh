#!/usr/bin/env bash
# The GPU runs behind docs/reproduction.md, one stage per device call (each fits its 10 minutes):
#   tr SEEDS Table 3a reduced run: three arms of the 0.5B 8/64 model per seed (triton; no bundle needed)
#   kernels  Table 9b: all twelve layer configs x cute, triton, grouped_mm
#   tests    every GPU test (tests/kernels, tests/routing)
#   rest     Fig. 16: the four sparse panels x cute, triton; end-to-end 7B (4 and 8 layers)
# cute needs the GPU bundle on PYTHONPATH (../shared/gpu/bundle.sh). Logs, JSON and the rendered
# docs come back in $OUT/STAGE.tgz (one file: the device returns few files); commit them under
# bench/results/ and docs/repro/.
#   bash bench/run_repro_gpu.sh STAGE [SEEDS]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}" SONIC_CUTE_CACHE_DIR=/root/.cache/sonic/cute
OUT="${OUT:-/tmp/sonic-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c "import hydra" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl-fsdp/*.whl  # carry .whl-fsdp
keep() { tar czf "$OUT/$1.tgz" "${@:2}" 2>/dev/null; tar tzf "$OUT/$1.tgz"; }
case "${1:?stage: tr | kernels | tests | rest}" in
  tr)
    timeout 560 python3 -m scripts.repro.tr_quality --reduced --seeds "${2:-0}" --arm-timeout 180 2>&1 \
      | grep -v "INFO\] - step" | tail -60 | tee "$OUT/tr_reduced.log"
    keep tr docs/repro/tr_reduced* runs/tr_0p5b_reduced/*/metrics.jsonl ;;
  kernels)
    timeout 540 python3 -m scripts.repro.kernel_throughput --run --backends cute,triton,grouped_mm -- --no-official \
      2>&1 | tail -80 | tee "$OUT/kernels.log"
    keep kernels bench/results/*-moe_layer-repro.json docs/repro/kernel_throughput.* ;;
  tests)
    timeout 400 python3 -m pytest tests/kernels tests/routing -m gpu -q -rfE -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.log" ;;
  rest)
    timeout 330 python3 -m scripts.repro.sparse_tr --run --sweep-backends cute,triton 2>&1 | tail -60 \
      | tee "$OUT/sparse.log"
    timeout 200 python3 -m scripts.repro.e2e_throughput --run --layers 4,8 --backends cute,triton 2>&1 \
      | grep -v "INFO\] - step" | tail -40 | tee "$OUT/e2e.log"
    keep rest bench/results/*-moe_layer-repro-sparse-*.json bench/results/*-e2e.json docs/repro/sparse_tr.* \
      docs/repro/e2e_throughput.* runs/e2e/*/metrics.jsonl ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
