#!/usr/bin/env bash
# One GPU call that validates the integrated tree: every GPU test (kernels + routing), then the
# 7B layer benchmark with the official sonic-moe in the same process, then the token-rounding
# sparse sweep for the cute and triton backends. Needs the GPU bundle on PYTHONPATH (see
# ../shared/gpu/bundle.sh). Logs and JSON land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/sonic-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 220 python3 -m pytest tests/kernels tests/routing -m gpu -q -rfE -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
timeout 200 python3 -m bench.moe_layer --configs 7B --backends cute,triton,grouped_mm --official-configs 7B \
  --json "$OUT/moe_layer_7b.json" 2>&1 | tail -40 | tee "$OUT/bench_7b.log"
timeout 110 python3 -m bench.moe_layer --configs "" --no-official --backends cute,triton --sparse-sweep --sweep-backends cute,triton \
  --json "$OUT/sparse.json" 2>&1 | tail -30 | tee "$OUT/sparse.log"
