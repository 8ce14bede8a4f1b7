#!/usr/bin/env bash
# One GPU-machine call for the Triton backend: GPU tests, then the layer benchmark.
# Usage (from the repo root on the GPU machine):
#   bash bench/run_triton_gpu.sh tests            # GPU kernel tests only
#   bash bench/run_triton_gpu.sh bench ARGS...    # python -m bench.moe_layer ARGS...
#   bash bench/run_triton_gpu.sh all ARGS...      # both
# Logs and result JSON land in $OUT (the GPU machine's return folder) when it is set.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/sonic-out}"; mkdir -p "$OUT"
mode="${1:-all}"; shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
rc=0
if [[ "$mode" == tests || "$mode" == all ]]; then
  timeout 300 python3 -m pytest tests/kernels -m gpu -q -rA -p no:cacheprovider 2>&1 | tail -60 | tee "$OUT/tests.log"
  rc=$?
fi
if [[ "$mode" == bench || "$mode" == all ]]; then
  python3 -m bench.moe_layer "$@" 2>&1 | tee "$OUT/bench.log"
  rc=$(( rc | $? ))
fi
exit $rc
