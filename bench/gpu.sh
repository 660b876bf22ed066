#!/usr/bin/env bash
# One GPU, at most 8 minutes: the figures docs/results/ would keep for a GPU.
#
#   bash bench/gpu.sh [OUT_DIR]
#
# 1. bench/attention.py: Dew's Pallas kernels against cuDNN and XLA attention, bfloat16, causal,
#    seq 2048 and 8192, head_dim 64 and 128, forward+backward TFLOP/s (checks first).
# 2. dew bench on the one GPU (--cpu-devices 0): Llama-3.2-1B at 8 x 2048 tokens and GPT-2 small
#    at 16 x 1024, each attention x recompute choice a contestant of its own, with tokens/s and
#    MFU.
#
# Each part has a time limit of its own, so one that hangs cannot take the others' time. The
# JSON rows go to OUT_DIR (default: bench-gpu). DEW_BENCH_TINY=1 runs the same commands at toy
# sizes on the CPU, to check the script itself; its numbers mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
# Dew itself, over the machine's own JAX (kernels/ installs as dew.kernels); nothing downloaded.
python -c "import dew.kernels" 2>/dev/null || python -m pip install -q --no-deps -e . || exit 1
out="${1:-bench-gpu}"
mkdir -p "$out"
status=0

if [ "${DEW_BENCH_TINY:-0}" = 1 ]; then
    devices=(--cpu-devices 1)
    kernels=(--seqs 64 --head-dims 32 --skip-checks)
    llama=(--layers 1 --width 64 --heads 2 --seq-len 16 --batch 2)
    gpt2=(--layers 1 --width 64 --heads 2 --seq-len 16 --batch 2)
    choices=(--attention xla --remat full dots)
else
    devices=(--cpu-devices 0)
    kernels=(--seqs 2048 8192 --head-dims 64 128 --budget-s 120)
    llama=(--model llama-3.2-1b --seq-len 2048 --batch 8)
    gpt2=(--model gpt2-small --seq-len 1024 --batch 16)
    choices=(--attention auto cudnn pallas xla --remat full dots)
fi
# The layers scanned: GPT-2 small's preset unrolls them (timed on TPU only), and eight unrolled
# compiles would not fit the parts' limits.
common=(--mesh data=1 --engines shard_map --depth-check 0 --repeats 3 --warmup 1 --layer-loop scan)

echo "== attention kernels"
timeout 150 python bench/attention.py "${kernels[@]}" || status=1
echo "== Llama-3.2-1B, one device"
timeout 180 dew bench "${devices[@]}" "${llama[@]}" "${common[@]}" "${choices[@]}" \
    --json "$out/llama-3.2-1b.json" || status=1
echo "== GPT-2 small, one device"
timeout 120 dew bench "${devices[@]}" "${gpt2[@]}" "${common[@]}" "${choices[@]}" \
    --json "$out/gpt2-small.json" || status=1
exit $status
