"""``dew tokenize``: text files, ``.jsonl`` or ``.parquet`` into a token folder; and the rule by
which ``dew train --data`` sizes the model's vocabulary from the folder.

    dew tokenize books/ --tokenizer tokenizer.json --out data/books --workers 4
    dew tokenize src/ --tokenizer bpe:8192 --out data/src
    dew tokenize chats.jsonl --field content --tokenizer bytes --out data/chats --force
    dew tokenize pairs.jsonl --jsonl-fields prompt,completion --tokenizer tokenizer.json --out sft
    dew tokenize chats.jsonl --jsonl-fields messages --rows pad --seq-len 1024 --tokenizer bytes \
        --out data/chats

The reading, splitting and writing are ``dew.data.text``'s; this module reads flags and prints.
Nothing here starts JAX.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dew.cli.flags import add_seed_flag, check_counts

# dew train's example decoder takes the folder's vocabulary rounded up to a multiple of this
# (Megatron's rule; GPT-2's 50257 becomes 50304), so that a tensor axis up to 128 divides it.
VOCAB_MULTIPLE = 128


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``tokenize`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "tokenize",
        help="turn text files, .jsonl or .parquet into a token folder",
        description="Tokenizes documents into a token folder (train.bin, val.bin, meta.json) that "
        "dew train --data reads. A text file (.txt, .text, .md) is one document; a .jsonl file "
        "one per line (its --field); a .parquet file one per row (column --field, needs "
        "pyarrow); a folder, the files under it. Each document is followed by the end-of-text "
        "id, and where each starts is recorded (train.docs, val.docs). The folder is written "
        "aside and renamed into place when complete.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders to read")
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="T",
        help="bytes (one token per UTF-8 byte); bpe:VOCAB, a byte-level BPE of VOCAB tokens "
        "(at least 257) trained on the train documents and written to FOLDER/tokenizer.json; "
        "a tokenizer.json file, or a folder holding one (a token folder's own too). All but "
        "bytes need pip install -e '.[text]'; nothing is downloaded",
    )
    parser.add_argument("--out", required=True, metavar="FOLDER", help="the token folder to write")
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="each document goes to val.bin with probability F (default 0.01)",
    )
    parser.add_argument(
        "--field", default="text", help="the .jsonl field or .parquet column (default text)"
    )
    parser.add_argument(
        "--jsonl-fields",
        default=None,
        metavar="P,C|M",
        help="prompt-masked data, written with a loss mask: PROMPT,COMPLETION field names "
        "(the loss on the completion only), or one MESSAGES field holding a chat, a list of "
        "{role, content} (the loss on the assistant's turns only; docs/data.md gives the "
        "template). Also the columns of a .parquet input",
    )
    parser.add_argument(
        "--rows",
        choices=("pack", "pad"),
        default="pack",
        help="pack (default): documents follow each other, joined by the end-of-text id, a row "
        "may hold several, and the folder records where each starts, so that dew train keeps "
        "attention, rotary positions and the loss inside each document (dew train --documents: "
        "the default for --jsonl-fields data); pad: each document starts a row of --seq-len, "
        "the rest padded and masked, so no row holds two documents",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="S",
        help="with --rows pad: the seq_len dew train will read the folder at",
    )
    parser.add_argument(
        "--eos",
        default=None,
        metavar="TOKEN",
        help="the end-of-text token of a tokenizer.json (default: the first of <|endoftext|>, "
        "<|end_of_text|>, </s>, <eos> it has); bpe:VOCAB's is <|endoftext|>",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="tokenize in N processes (default 1); the output is the same for every N",
    )
    add_seed_flag(parser, "the validation split")
    parser.add_argument(
        "--force", action="store_true", help="replace FOLDER if it is already a token folder"
    )
    parser.set_defaults(run=tokenize_command, setup=lambda: None)
    return parser


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1000
    raise AssertionError


class Progress:
    """One line on ``stream``: bytes read, tokens written, rates. Redrawn in place at most every
    ``every`` seconds on a terminal; elsewhere (a log file) one line every ``every * 20`` seconds.
    A call with ``(0, 0)`` (tokenizing starts, after a tokenizer was trained) restarts the clock
    the rates divide by. ``finish()`` writes the last state as a full line."""

    def __init__(self, stream=None, every: float = 0.5):
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = getattr(self.stream, "isatty", lambda: False)()
        self.every = every if self.terminal else every * 20
        self.start = time.perf_counter()
        self.last = self.start
        self.state = (0, 0)
        self.open_line = False  # a line redrawn in place that no newline has ended yet
        self.width = 0  # of the widest line drawn, which a shorter one must cover

    def line(self) -> str:
        bytes_read, tokens = self.state
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"tokenize: {_size(bytes_read)} read, {tokens:,} tokens written, "
            f"{_size(bytes_read / seconds)}/s, {tokens / seconds:,.0f} tokens/s"
        )

    def __call__(self, bytes_read: int, tokens: int) -> None:
        self.state = (bytes_read, tokens)
        now = time.perf_counter()
        if (bytes_read, tokens) == (0, 0):
            self.start = self.last = now
            return
        if now - self.last >= self.every:
            self.last = now
            self.stream.write(self._redraw() if self.terminal else self.line() + "\n")
            self.stream.flush()
            self.open_line = self.terminal

    def _redraw(self) -> str:
        text = self.line()
        text, self.width = "\r" + text.ljust(self.width), max(self.width, len(text))
        return text

    def finish(self) -> None:
        self.stream.write((self._redraw() if self.terminal else self.line()) + "\n")
        self.stream.flush()
        self.open_line = False

    def abandon(self) -> None:
        """Ends a line left open, so that an error message starts on its own line."""
        if self.open_line:
            self.stream.write("\n")
            self.stream.flush()
            self.open_line = False


def _documents(count: int) -> str:
    return f"{count:,} document" + ("" if count == 1 else "s")


def jsonl_fields(text: str | None) -> tuple[str, ...] | None:
    """``--jsonl-fields``: ``"prompt,completion"`` -> ``("prompt", "completion")``,
    ``"messages"`` -> ``("messages",)``; a ValueError naming the value for anything else."""
    if text is None:
        return None
    fields = tuple(name.strip() for name in text.split(","))
    if len(fields) not in (1, 2) or not all(fields):
        raise ValueError(
            f"--jsonl-fields takes PROMPT,COMPLETION or MESSAGES (one or two names), got {text!r}"
        )
    return fields


def check_flags(args) -> None:
    """``ValueError`` (``FileExistsError`` for ``--out``) naming the flags and values that
    ``dew.data.text`` would refuse by its arguments' names (``val_fraction``, ``seq_len``,
    ``force``), before anything is read."""
    from dew.data.tokenizer import BPE_EOS, _tokenizers_library, bpe_vocab

    check_counts(args, "workers", "seq_len")
    if bpe_vocab(args.tokenizer, "--tokenizer") is not None:
        if args.eos is not None:
            raise ValueError(
                f"--eos {args.eos} does not apply to --tokenizer {args.tokenizer}: the BPE "
                f"trained there ends documents with {BPE_EOS}; leave --eos out"
            )
        _tokenizers_library()  # the text extra's one-line error, before anything is read
    if not 0 <= args.val_fraction < 1:
        raise ValueError(
            f"--val-fraction must be in [0, 1) (each document's chance of going to val.bin), "
            f"got {args.val_fraction:g}"
        )
    if args.rows == "pad" and args.seq_len is None:
        raise ValueError(
            "--rows pad needs --seq-len S, the --seq-len dew train will read the folder at: each "
            "document starts a row of S tokens"
        )
    if args.rows == "pack" and args.seq_len is not None:
        raise ValueError(
            f"--seq-len {args.seq_len} is for --rows pad only (packed rows ignore it): leave it "
            "out, or give --rows pad"
        )
    out = Path(args.out)
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"--out {args.out} is a file; give a folder to write")
    if not args.force and any(out.iterdir()):
        raise FileExistsError(
            f"--out {args.out} already exists; give --force to replace it (a token folder "
            "only), or another --out"
        )
    from dew.data.text import foreign_files

    others = foreign_files(out)
    if others:
        raise FileExistsError(
            f"--out {args.out} holds files a token folder does not ({', '.join(others[:5])}); "
            "--force replaces only a token folder, so it is left alone: give another --out"
        )


def tokenize_command(args) -> int:
    from dew.data.text import mask_rule, tokenize_files

    check_flags(args)
    fields = jsonl_fields(args.jsonl_fields)
    mask_rule(fields, args.rows, args.seq_len)  # bad combinations stop before any reading
    progress = Progress()
    if args.tokenizer.startswith("bpe:"):
        print(
            f"tokenize: training a byte-level BPE of {args.tokenizer[4:]} tokens on the train "
            "documents (a first pass over the inputs)",
            file=sys.stderr,
            flush=True,
        )
    try:
        report = tokenize_files(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            eos=args.eos,
            val_fraction=args.val_fraction,
            field=args.field,
            workers=args.workers,
            seed=args.seed,
            force=args.force,
            progress=progress,
            fields=fields,
            rows=args.rows,
            seq_len=args.seq_len,
        )
    except BaseException:
        progress.abandon()
        raise
    progress.finish()
    meta = report.meta
    if report.bpe_vocab is not None:
        stopped = (
            f" (asked {report.bpe_vocab:,}: the train documents ran out of pairs to merge)"
            if meta.vocab_size < report.bpe_vocab
            else ""
        )
        print(
            f"Trained {Path(args.out) / 'tokenizer.json'}: a byte-level BPE of "
            f"{meta.vocab_size:,} tokens{stopped} on {_documents(report.train_documents)}, in "
            f"{report.tokenizer_seconds:.1f} s"
        )
    print(
        f"Wrote {os.fspath(args.out)}: {meta.train_tokens:,} train tokens "
        f"({_documents(report.train_documents)}), {meta.val_tokens:,} val tokens "
        f"({_documents(report.val_documents)}); vocab_size {meta.vocab_size}, dtype {meta.dtype}, "
        f"eos_id {meta.eos_id}, in {report.seconds:.1f} s"
    )
    if meta.loss_mask:
        rows = "packed" if meta.pad_seq_len is None else f"padded to rows of {meta.pad_seq_len}"
        separate = meta.pad_seq_len is None and meta.document_starts
        print(
            f"Loss mask: train.mask, val.mask; documents {rows}"
            + (" (dew train keeps each one to itself: --documents separate)" if separate else "")
        )
    return 0


def training_vocabulary(config: dict, preset: str | None, data_dir) -> int:
    """The vocabulary ``dew train`` builds its model with for the token folder ``data_dir``.

    The example decoder (no ``--model``) takes the folder's ``vocab_size`` from its ``meta.json``,
    rounded up to a multiple of ``VOCAB_MULTIPLE`` (the extra rows are never a target); a preset
    keeps its own, and one smaller than the folder's is a ValueError: ids it cannot embed."""
    from dew.data import read_meta

    meta = read_meta(data_dir)
    if preset is None:
        return -(-meta.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    vocab = config["vocab_size"]
    if vocab < meta.vocab_size:
        raise ValueError(
            f"model {preset} has a vocabulary of {vocab}, smaller than the vocab_size "
            f"{meta.vocab_size} of the token folder {os.fspath(data_dir)!r} (tokenizer "
            f"{meta.tokenizer!r}): its ids up to {meta.vocab_size - 1} have no embedding. "
            "Tokenize with that model's tokenizer, or leave out --model to size the example "
            "decoder from the folder"
        )
    return vocab
