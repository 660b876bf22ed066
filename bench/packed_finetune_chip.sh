# Packed against padded fine-tuning on one v5e chip: docs/finetune.md's recipe at 16 x 1024
# (GPT-2 small's shapes, bfloat16, remat "attention", the Pallas kernels), three ways over the same
# prompt/completion pairs: packed with each document kept to itself (dew tokenize's default,
# dew train --documents auto = separate), packed with documents joined (--documents joined), and
# one pair a row (dew tokenize --rows pad --seq-len 1024). Each run reports tokens/s and useful
# tokens/s (the targets whose loss counts: a completion's tokens), and the
# script ends with a table of them and the ratio of useful tokens/s against --rows pad.
#
# The pairs are made here (nothing can be downloaded on the chip): bytes of random words, the
# prompt's and the completion's lengths drawn from log-normals (medians 120 and 180 bytes, each
# at most a third of a row), about 400 byte tokens a pair on average, the scale of SFT datasets'
# documents (the kernels' segment-id rows use a mean of 300). The byte tokenizer has no
# end-of-text id: the recorded document starts alone separate the pairs. The model starts from
# random weights (dew train --model gpt2-small): speed, not what the loss reaches, is measured.
# Writes packed_finetune.log and one metrics file a run under $OUT; about 5 minutes.
#
# Dew is installed over the machine's JAX from the wheel in .whl/new (pip wheel --no-deps -w
# .whl/new .) and optax from the machine's index, as bench/finetune_chip.sh does; DEW_INSTALLED=1
# skips that for an environment where `dew` already runs. PACKED_TINY=1 runs the same commands at
# toy sizes on JAX's CPU backend (the example decoder, 8 x 128 tokens, pairs of about 40 bytes),
# with the dew already installed, to try the script on a machine without the chip.
set -euo pipefail
if [ "${PACKED_TINY:-0}" != 1 ] && [ "${DEW_INSTALLED:-0}" != 1 ]; then
  W=$PWD/.whl
  pip install -q --upgrade --no-deps --target /tmp/site $W/new/*.whl
  pip install -q --index-url file:///opt/pypi/simple --no-deps --target /tmp/deps optax absl-py
  export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:/tmp/deps PATH=$PATH:/tmp/site/bin
  cd /tmp   # not the repo root: the installed wheel must be what runs
fi
OUT=${OUT:-/tmp/packed-out}
mkdir -p "$OUT"
WORK=/tmp/packed-finetune
rm -rf "$WORK" && mkdir -p "$WORK"
LOG=$OUT/packed_finetune.log

if [ "${PACKED_TINY:-0}" = 1 ]; then
  MODEL=(--layers 2 --width 64 --heads 4 --remat full --attention xla)
  SEQ=128
  SHAPE=(--batch 8 --seq-len $SEQ)
  TRAIN=(--steps 12 --log-every 4)
  PAIRS=3000 MEDIANS="12 20"
else
  MODEL=(--model gpt2-small --remat attention --attention auto)
  SEQ=1024
  SHAPE=(--batch 16 --seq-len $SEQ)
  TRAIN=(--steps 40 --log-every 10)
  PAIRS=40000 MEDIANS="120 180"   # about 13M byte tokens: 40 steps never see a window twice
fi

{
  echo "== $(date -u +%FT%TZ) $(python -c 'import dew, jax; print("dew from", dew.__file__, "| jax", jax.__version__, jax.devices())')"
  echo "== prompt/completion pairs"
  python - "$WORK/pairs.jsonl" "$PAIRS" $MEDIANS "$SEQ" <<'EOF'
import json, random, sys

path, pairs, prompt_median, completion_median, seq = sys.argv[1], *map(int, sys.argv[2:])
random.seed(0)
words = ["".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.randint(2, 9)))
         for _ in range(5000)]


def text(median):
    """About lognormal(median, sigma 0.8) bytes of words, at least 1 and at most seq / 3."""
    size = min(max(1, int(random.lognormvariate(0, 0.8) * median)), seq // 3)
    out = ""
    while len(out) < size:
        out += random.choice(words) + " "
    return out[:size]


with open(path, "w") as f:
    for _ in range(pairs):
        f.write(json.dumps({"prompt": text(prompt_median) + "\n", "completion": text(completion_median)}) + "\n")
EOF
  head -c 300 $WORK/pairs.jsonl; echo
  timeout 120 dew tokenize $WORK/pairs.jsonl --jsonl-fields prompt,completion --tokenizer bytes \
    --val-fraction 0 --out $WORK/packed
  timeout 120 dew tokenize $WORK/pairs.jsonl --jsonl-fields prompt,completion --tokenizer bytes \
    --val-fraction 0 --rows pad --seq-len $SEQ --out $WORK/padded

  for run in separate joined padded; do
    data=$WORK/packed documents=$run
    if [ $run = padded ]; then data=$WORK/padded documents=auto; fi
    echo "== dew train: $run (--data $(basename $data) --documents $documents)"
    timeout 240 dew train --cpu-devices 0 "${MODEL[@]}" "${SHAPE[@]}" "${TRAIN[@]}" \
      --data $data --documents $documents --run-dir $WORK/run-$run --metrics $OUT/$run.jsonl \
      --lr 3e-4 --warmup-steps 4 --clip-norm 1.0
    rm -rf $WORK/run-$run   # its checkpoint: 1.5 GB at GPT-2 small's size
  done

  echo "== | rows | documents | step ms | tokens/s | useful tokens/s | useful share | MFU | useful tokens/s over padded |"
  echo "   (the mean over every step but the first, which compiles)"
  python - "$OUT" <<'EOF'
import json, sys

rows = {}
for run in ("separate", "joined", "padded"):
    steps = [json.loads(line) for line in open(f"{sys.argv[1]}/{run}.jsonl")][1:]
    seconds = sum(s["step_time_s"] for s in steps)
    tokens = sum(s["tokens_per_s"] * s["step_time_s"] for s in steps)
    useful = sum(s["useful_tokens"] for s in steps)
    mfu = [s["mfu"] for s in steps if "mfu" in s]
    rows[run] = (1000 * seconds / len(steps), tokens / seconds, useful / seconds, useful / tokens,
                 f"{100 * sum(mfu) / len(mfu):.1f}%" if mfu else "-")
for run, (ms, tokens, useful, share, mfu) in rows.items():
    layout = ("pad", "one pair a row") if run == "padded" else ("pack", run)
    ratio = useful / rows["padded"][2]
    print(f"| {layout[0]} | {layout[1]} | {ms:.1f} | {tokens:,.0f} | {useful:,.0f} | "
          f"{100 * share:.1f}% | {mfu} | {ratio:.2f}x |")
EOF
  echo "== done $(date -u +%FT%TZ)"
} 2>&1 | grep -v "^[WI]0000" | tee "$LOG"
rm -rf "$WORK"
