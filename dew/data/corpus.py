"""A small generated corpus of short English sentences, for examples and for ``dew train``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dew.checks import positive_int
from dew.data.folder import TokenMeta, open_tokens, read_meta, write_token_folder
from dew.data.tokenizer import ByteTokenizer

SUBJECTS = ("the cat", "a dog", "the bird", "my friend", "the child")
VERBS = ("sees", "likes", "finds", "wants", "hears")
OBJECTS = ("the ball", "a tree", "the river", "some food", "the moon")
# One token in VAL_FRACTION is held out for validation: the first ones.
VAL_FRACTION = 50


def example_text(*, seed: int = 0, sentences: int = 4000) -> str:
    """``sentences`` lines of the form ``"<subject> <verb> <object>.\\n"``, each word group drawn by
    ``np.random.default_rng(seed)`` in the order subject, verb, object.

    With the defaults this is exactly the text the scaling notebook builds by hand.
    """
    positive_int("sentences", sentences)
    rng = np.random.default_rng(seed)
    return "".join(
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}.\n"
        for _ in range(sentences)
    )


def write_example_corpus(
    path: str | os.PathLike, *, seed: int = 0, sentences: int = 4000, overwrite: bool = False
) -> TokenMeta:
    """Writes the example corpus (``example_text(seed=seed, sentences=sentences)``), byte-tokenized,
    as a token folder at ``path``; the first ``len(tokens) // 50`` tokens go to ``val.bin``, the
    rest to ``train.bin``. Returns the folder's meta.

    With the defaults: 97,548 tokens, 95,598 for training (2,987 windows at ``seq_len=32``) and
    1,950 for validation.
    Calling it again on a folder that already holds this very corpus writes nothing; a folder that
    holds something else is left alone (FileExistsError) unless ``overwrite=True``.

    Raises:
      FileExistsError: ``path`` holds other token files and ``overwrite`` is not set.
      ValueError: ``sentences`` below 1.

    Examples:
        >>> from dew.data import write_example_corpus
        >>> meta = write_example_corpus("tokens")
        >>> meta.train_tokens, meta.val_tokens
        (95598, 1950)
    """
    ids = np.asarray(ByteTokenizer().encode(example_text(seed=seed, sentences=sentences)), np.uint8)
    val_len = len(ids) // VAL_FRACTION
    val, train = ids[:val_len], ids[val_len:]
    if not overwrite and _holds(path, train, val):
        return read_meta(path)
    return write_token_folder(
        path, train, val, tokenizer="byte", vocab_size=256, eos_id=None, overwrite=overwrite
    )


def _holds(path: str | os.PathLike, train: np.ndarray, val: np.ndarray) -> bool:
    """Whether ``path`` is already a valid byte token folder with exactly these tokens."""
    if not (Path(path) / "meta.json").is_file():
        return False
    try:
        meta = read_meta(path)
    except (OSError, ValueError):
        return False
    return (
        meta.tokenizer == "byte"
        and meta.vocab_size == 256
        and meta.eos_id is None
        and meta.train_tokens == train.size
        and meta.val_tokens == val.size
        and np.array_equal(open_tokens(meta, "train"), train)
        and np.array_equal(open_tokens(meta, "val"), val)
    )
