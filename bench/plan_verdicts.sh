#!/usr/bin/env bash
# One TPU v5e chip: does the chip say what `dew plan --target v5e-1` says? For each configuration,
# the plan (libtpu's compile-only v5e-1, in a process of its own) and then the same step trained
# for 3 steps on the chip (bench/plan_verdicts.py), one process each.
#
#   bash bench/plan_verdicts.sh OUT_DIR "gpt2-small 44 1024" "gpt2-small 46 1024" ...
#
# Each configuration is "MODEL BATCH SEQ_LEN". Writes OUT_DIR/plan-MODEL-BATCH.json (dew plan's
# rows) and OUT_DIR/chip.jsonl (one verdict a line). Needs Dew and optax importable (on a machine
# with no network: docs/benchmarks.md, 'On a TPU machine'); run from outside the clone or with
# PYTHONPATH naming the installed package first. docs/planning.md has the verdicts it gave.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$1"
shift
mkdir -p "$out"
for config in "$@"; do
    read -r model batch seq <<<"$config"
    echo "== $model, $batch x $seq"
    timeout 240 python -m dew plan --target v5e-1 --model "$model" --batch "$batch" \
        --seq-len "$seq" --json "$out/plan-$model-$batch.json" 2>&1 \
        | grep -E "compiled|refused" || echo "plan: no row (timeout or failure)"
    timeout 240 python "$here/plan_verdicts.py" --model "$model" --batch "$batch" \
        --seq-len "$seq" --json "$out/chip.jsonl" 2>&1 | tail -1 || echo "chip: no verdict"
done
