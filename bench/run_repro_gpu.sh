#!/usr/bin/env bash
# The GPU runs behind docs/reproduction.md, one stage per device call (each fits its 10 minutes):
#   tr       Table 3a reduced run: three arms of the 0.5B 8/64 model (triton; no bundle needed)
#   kernels  Table 9b: all twelve layer configs x cute, triton, grouped_mm
#   rest     Fig. 16: the four sparse panels x cute, triton; end-to-end 7B (4 and 8 layers)
# cute needs the GPU bundle on PYTHONPATH (../shared/gpu/bundle.sh). Logs, JSON and the rendered
# docs land in $OUT; commit them under bench/results/ and docs/repro/.
#   bash bench/run_repro_gpu.sh STAGE
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}" SONIC_CUTE_CACHE_DIR=/root/.cache/sonic/cute
OUT="${OUT:-/tmp/sonic-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c "import hydra" 2>/dev/null || pip install -q --no-index --no-deps .whl-fsdp/*.whl  # carry .whl-fsdp
keep() { mkdir -p "$OUT/$(dirname "$1")" && cp -r "$1" "$OUT/$1"; }
case "${1:?stage: tr | kernels | rest}" in
  tr)
    timeout 560 python3 -m scripts.repro.tr_quality --reduced --arm-timeout 180 2>&1 | grep -v "INFO\] - step" \
      | tail -60 | tee "$OUT/tr_reduced.log"
    keep docs/repro/tr_reduced; keep docs/repro/tr_reduced.md; keep docs/repro/tr_reduced.png ;;
  kernels)
    timeout 540 python3 -m scripts.repro.kernel_throughput --run --backends cute,triton,grouped_mm -- --no-official \
      2>&1 | tail -80 | tee "$OUT/kernels.log"
    for f in bench/results/*-moe_layer-repro.json docs/repro/kernel_throughput.*; do keep "$f"; done ;;
  rest)
    timeout 330 python3 -m scripts.repro.sparse_tr --run --sweep-backends cute,triton 2>&1 | tail -60 \
      | tee "$OUT/sparse.log"
    timeout 200 python3 -m scripts.repro.e2e_throughput --run --layers 4,8 --backends cute,triton 2>&1 \
      | grep -v "INFO\] - step" | tail -40 | tee "$OUT/e2e.log"
    for f in bench/results/*-moe_layer-repro-sparse-*.json bench/results/*-e2e.json docs/repro/sparse_tr.* \
             docs/repro/e2e_throughput.*; do keep "$f"; done ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
