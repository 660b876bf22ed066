#!/usr/bin/env bash
# One TPU chip, at most 8 minutes, no network: the figures docs/results/ keeps for a TPU.
#
#   bash bench/tpu.sh [OUT_DIR]
#
# 1. bench/attention.py: the checks (Dew's kernels in float32 against a float64 reference, then
#    every contestant's bfloat16 error), then forward and forward+backward TFLOP/s of Dew's Mosaic
#    kernels, JAX's Pallas TPU flash attention, splash attention and XLA at two of the seven rows
#    of docs/results/attention-kernels.md (each JAX kernel at the blocks that measured best on v5e, under a
#    raised scoped-VMEM limit so that its blocks of 2048 compile).
# 2. dew bench on the one chip (--cpu-devices 0): GPT-2 small at 16 x 1024 tokens, each attention
#    x recompute choice a contestant of its own (auto and xla attention; attention and full
#    recompute; the layers scanned), with step time, tokens/s and MFU.
# Where the step's time goes is a command of its own: python bench/step_parts.py (each part
# timed alone, about 90 s) or python bench/step_profile.py (a profiler trace of the step, op by op).
#
# Dew installs over the machine's JAX and nothing is downloaded: the wheel built elsewhere
# (pip wheel --no-deps -w .whl .) and optax from a local index, as docs/benchmarks.md says; or an
# environment where `import dew.kernels, optax` already works. Each part has a time limit of its
# own, so one that hangs cannot take the others' time. Output goes to OUT_DIR (default:
# bench-tpu). DEW_BENCH_TINY=1 runs the same commands at toy sizes on the CPU, to check the script
# itself; its numbers mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-tpu}"
mkdir -p "$out"
python -P -c "import dew.kernels, optax" 2>/dev/null || {
    echo "install Dew first: docs/benchmarks.md, 'On a TPU machine'" >&2
    exit 1
}
status=0

if [ "${DEW_BENCH_TINY:-0}" = 1 ]; then
    kernels=(--rows 128:64 128:64:gqa --calls 2)
    gpt2=(--cpu-devices 1 --layers 1 --width 64 --heads 2 --seq-len 16 --batch 2)
else
    # The checks take about 150 s on v5e and a row about a minute: two rows fit the limit. The
    # seven rows of docs/results/attention-kernels.md are a command of their own (python bench/attention.py
    # --skip-checks), longer than this script's 8 minutes.
    kernels=(--rows 2048:128 8192:128 --budget-s 200)
    gpt2=(--cpu-devices 0 --model gpt2-small --seq-len 1024 --batch 16)
fi

echo "== attention kernels"
# JAX's kernels at blocks of 2048 need more scoped VMEM than XLA's default (Dew's kernels set
# their own limit); the steps below run at the default.
LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS:-} --xla_tpu_scoped_vmem_limit_kib=98304" \
    timeout 300 python bench/attention.py "${kernels[@]}" --json "$out/attention.jsonl" \
    | tee "$out/attention.txt" || status=1
echo "== GPT-2 small, one chip: attention x recompute"
# The layers scanned: four unrolled compiles (the preset's, about 67 s each on a v5e host) do not
# fit this part's limit. The preset's unrolled step is timed by dew train (docs/results/one-chip.md,
# "GPT-2 small").
timeout 170 dew bench "${gpt2[@]}" --mesh data=1 --engines shard_map --no-one-device \
    --depth-check 0 --repeats 3 --warmup 1 --attention auto xla --remat attention full \
    --layer-loop scan --json "$out/gpt2-small.json" | tee "$out/gpt2-small.txt" || status=1
exit $status
