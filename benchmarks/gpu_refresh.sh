#!/usr/bin/env bash
# Refresh timing table on a GPU machine (paper Appendix 13.3 shape): a random-weight model with
# Qwen3-8B's config (36 layers, hidden 4096, 32/8 heads, head_dim 128), bf16, batch 1, B = 64,
# R = 1/4/16, N = 2K/8K, 10 warm-ups and 20 interleaved trials; packed-triton runs on CUDA.
# Needs a Python with this repo's dependencies and triton (pip install -e '.[triton]').
# CPU smoke test of the same path: CONFIG=qwen3-tiny DEVICE=cpu benchmarks/gpu_refresh.sh --contexts 512 --trials 1
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CONFIG=${CONFIG:-qwen3-8b}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-benchmarks/results/gpu-${CONFIG}}
exec "$PYTHON" -m kvmemory_lab.cli bench refresh --random-config "$CONFIG" --device "$DEVICE" --dtype bf16 \
    --warmup "${WARMUP:-10}" --trials "${TRIALS:-20}" --out "$OUT" "$@"
