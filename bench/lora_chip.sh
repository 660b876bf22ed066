#!/usr/bin/env bash
# LoRA on one v5e chip (issue 54): Llama-3.2-3B, rank 16 on all seven projections, bfloat16 base,
# 4 x 2048 tokens; Llama-3.1-8B, rank 16, int8 base, 1 x 2048 tokens. Each starts from a Hugging
# Face folder of the published shapes with random weights (bench/lora_folder.py writes it, one
# tensor at a time: no real weights on the machine, and a step's speed does not depend on them),
# is planned first (`dew plan --target v5e-1`: the compiler's verdict before it runs), then trains
# 30 steps on real text (this repository's docs/ and README.md, bytes) with
# `dew train --init-from FOLDER --lora-rank 16`. The log lines carry tokens/s and MFU by the LoRA
# count, 4 N + 12 L H Q T + 6 N_lora per token (dew.training.flops).
#
#   bash bench/lora_chip.sh            # OUT=/tmp/lora-out: lora.log and the metrics files
#   LORA_RUNS=llama-3.2-3b:bf16:4:2048 LORA_PLAN=0 bash bench/lora_chip.sh   # one run, no plan
#
# LORA_RUNS picks runs (MODEL:BASE:BATCH:SEQ, space-separated), LORA_STEPS the steps (30), and
# LORA_PLAN=0 skips the plan (it compiles the step once more; `dew plan --target v5e-1` gives the
# same verdict on a machine with no chip). Each run appends to the log.
#
# Dew from the repository copy (pip install -e . where the machine allows it), or the wheel and
# optax as bench/finetune_chip.sh installs them. About 20 GB of /tmp for the two folders; each
# command has a timeout. LORA_TINY=1 runs the same commands on JAX's CPU backend at toy sizes
# (Llama-3.2-1B's shapes cut to one layer, 2 x 64 tokens, 3 steps): how the script was tried on
# a machine with no chip.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/lora-out}
WORK=${WORK:-/tmp/lora-work}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/lora.log

if [ "${LORA_TINY:-0}" = 1 ]; then
  export JAX_PLATFORMS=cpu
  DEV=(--cpu-devices 1)
  SMALL=(--layers 1)
  RUNS=("llama-3.2-1b:bf16:2:64" "llama-3.2-1b:int8:1:64")
  STEPS=3
  PLAN_TARGET=()  # no plan: it compiles for the TPU, minutes on a CPU
else
  DEV=(--cpu-devices 0)
  SMALL=()
  RUNS=("llama-3.2-3b:bf16:4:2048" "llama-3.1-8b:int8:1:2048")
  STEPS=30
  PLAN_TARGET=(--target v5e-1)
fi
[ -n "${LORA_RUNS:-}" ] && read -r -a RUNS <<<"$LORA_RUNS"
STEPS=${LORA_STEPS:-$STEPS}
[ "${LORA_PLAN:-1}" = 0 ] && PLAN_TARGET=()

{
  echo "== $(date -u +%FT%TZ) $(python -P -c 'import dew, jax; print("dew from", dew.__file__, "| jax", jax.__version__, jax.devices())')"
  echo "== real text: docs/ and README.md as bytes"
  rm -rf "$WORK/tokens"
  timeout 120 dew tokenize "$REPO/docs" "$REPO/README.md" --tokenizer bytes --out "$WORK/tokens"

  for run in "${RUNS[@]}"; do
    IFS=: read -r model base batch seq <<<"$run"
    folder=$WORK/$model${SMALL:+-tiny}
    [ -f "$folder/config.json" ] || timeout 900 python "$REPO/bench/lora_folder.py" \
      --model "$model" --out "$folder" "${SMALL[@]}"
    lora=(--lora-rank 16)
    [ "$base" = int8 ] && lora+=(--base-dtype int8)
    flags=(--dtype bfloat16 --param-dtype bfloat16 --attention auto --remat full
           --batch "$batch" --seq-len "$seq")
    if [ ${#PLAN_TARGET[@]} -gt 0 ]; then
      echo "== dew plan: $model, LoRA rank 16, $base base, $batch x $seq"
      timeout 600 dew plan "${PLAN_TARGET[@]}" --model "$model" "${lora[@]}" "${flags[@]}" || true
    fi
    echo "== dew train: $model, LoRA rank 16, $base base, $batch x $seq, $STEPS steps"
    rm -rf "$WORK/run-$model-$base"
    timeout 900 dew train "${DEV[@]}" --init-from "$folder" "${lora[@]}" "${flags[@]}" \
      --data "$WORK/tokens" --steps "$STEPS" --log-every 5 --warmup-steps 3 --lr 1e-3 \
      --run-dir "$WORK/run-$model-$base" --metrics "$OUT/$model-$base.jsonl"
    timeout 120 dew convert "$WORK/run-$model-$base" "$WORK/peft-$model-$base" --to peft
    ls -l "$WORK/peft-$model-$base"
  done
} 2>&1 | tee -a "$LOG"
