W=$PWD/.whl
pip install -q --upgrade --no-deps --target /tmp/site $W/new/*.whl  # --upgrade: replace an earlier install
pip install -q --index-url file:///opt/pypi/simple --no-deps --target /tmp/deps optax absl-py
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:/tmp/deps PATH=$PATH:/tmp/site/bin
cd /tmp   # not the repo root: the installed wheel must be what runs

# docs/finetune.md's recipe on one v5e chip, at GPT-2 small's shapes (124M weights, vocabulary
# 50304, context 1024) for a meaningful tokens/s and MFU. Nothing can be downloaded on the chip,
# so the Hugging Face folder is made here: one step of `dew train --model gpt2-small` exported with
# `dew convert --to hf` (a Llama-architecture folder; its weights are nearly random, so the loss
# curve says the run works, not what fine-tuning a trained model gives). Then the recipe:
# prompt/completion pairs from a Python one-off, `dew tokenize --jsonl-fields` (bytes: the folder
# has no tokenizer), `dew train --init-from` with warmup, cosine decay and clipping, its
# validation loss, `dew convert --to hf`. Writes finetune.log and finetune.jsonl (the metrics)
# under $OUT. Each command has a timeout; 5 minutes in all at most, most of it compiling and
# saving checkpoints (1.5 GB each at these shapes).
#
# FINETUNE_TINY=1 runs the same commands at toy sizes on JAX's CPU backend (one device): the
# example decoder, 2 layers of width 64, 8 x 64 tokens, 20 steps; how the script was tried on a
# machine with no chip.
set -euo pipefail
OUT=${OUT:-/tmp/finetune-out}
mkdir -p "$OUT"
WORK=/tmp/finetune
rm -rf "$WORK" && mkdir -p "$WORK"
LOG=$OUT/finetune.log

if [ "${FINETUNE_TINY:-0}" = 1 ]; then
  MODEL=(--layers 2 --width 64 --heads 4)  # the example decoder, byte vocabulary
  SHAPE=(--batch 8 --seq-len 64)
  TUNE=(--steps 20 --warmup-steps 4 --eval-every 10 --log-every 5)
  PAIRS=4000
else
  MODEL=(--model gpt2-small)  # bfloat16 activations, remat "attention", the Pallas kernels
  SHAPE=(--batch 16 --seq-len 1024)
  TUNE=(--steps 60 --warmup-steps 6 --eval-every 20 --log-every 10)
  PAIRS=60000  # about 1.3M byte tokens: 80 batches of 16 x 1024, no window seen twice in 60 steps
fi

{
  echo "== $(date -u +%FT%TZ) $(python -c 'import dew, jax; print("dew from", dew.__file__, "| jax", jax.__version__, jax.devices())')"

  echo "== 1. a Hugging Face folder: one step of dew train, exported"
  timeout 90 dew train --cpu-devices 0 "${MODEL[@]}" "${SHAPE[@]}" --steps 1 --run-dir $WORK/base-run
  timeout 30 dew convert $WORK/base-run $WORK/base --to hf
  ls -l $WORK/base

  echo "== 2. prompt/completion pairs through dew tokenize"
  python - "$WORK/pairs.jsonl" "$PAIRS" <<'EOF'
import json, random, sys

random.seed(0)  # made-up pairs: reverse a word of 4 to 6 letters
with open(sys.argv[1], "w") as f:
    for _ in range(int(sys.argv[2])):
        word = "".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.randint(4, 6)))
        f.write(json.dumps({"prompt": f"Reverse {word}:", "completion": f" {word[::-1]}\n"}) + "\n")
EOF
  head -2 $WORK/pairs.jsonl
  timeout 30 dew tokenize $WORK/pairs.jsonl --jsonl-fields prompt,completion --tokenizer bytes \
    --val-fraction 0.05 --out $WORK/tokens

  echo "== 3. dew train --init-from, warmup, cosine decay, clipping; 4. its validation loss"
  timeout 120 dew train --cpu-devices 0 --init-from $WORK/base --data $WORK/tokens --run-dir $WORK/run \
    "${SHAPE[@]}" "${TUNE[@]}" --dtype bfloat16 --remat attention --attention auto \
    --lr 3e-4 --lr-min 3e-5 --lr-schedule cosine --clip-norm 1.0 --weight-decay 0.1 \
    --metrics $OUT/finetune.jsonl

  echo "== 4. dew convert --to hf"
  timeout 30 dew convert $WORK/run $WORK/tuned --to hf
  ls -l $WORK/tuned
  python -c "import json; c = json.load(open('$WORK/tuned/config.json')); print({k: c[k] for k in ('num_hidden_layers', 'hidden_size', 'vocab_size', 'max_position_embeddings')})"
  echo "== docs/finetune.md's table: | step | loss | val loss | step ms | tokens/s | MFU |"
  echo "   (step ms, tokens/s and MFU: the mean over the steps since the row before, step 1 left out)"
  python - "$OUT/finetune.jsonl" <<'EOF'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
for row in rows:
    if row["step"] % 10 == 0:
        last = [r for r in rows if max(1, row["step"] - 10) < r["step"] <= row["step"]]
        ms = 1000 * sum(r["step_time_s"] for r in last) / len(last)
        tokens = sum(r["tokens_per_s"] for r in last) / len(last)
        mfu = "-" if "mfu" not in row else f"{100 * sum(r['mfu'] for r in last) / len(last):.1f}%"
        val = f"{row['val_loss']:.4f}" if "val_loss" in row else ""
        print(f"| {row['step']} | {row['loss']:.4f} | {val} | {ms:.1f} | {tokens:,.0f} | {mfu} |")
EOF
  echo "== done $(date -u +%FT%TZ)"
} 2>&1 | grep -v "^[WI]0000" | tee "$LOG"
rm -rf "$WORK"
