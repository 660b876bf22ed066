"""Token data: tokenizers, text files into token folders (``dew tokenize``), the token folder
format, and fixed-length windows read in a seeded shuffled order. Plain numpy (and the optional
``tokenizers`` library); nothing here imports JAX."""

from dew.data.corpus import write_example_corpus
from dew.data.folder import TokenFolderWriter, TokenMeta, read_meta, write_token_folder
from dew.data.loading import BatchStream, Loading
from dew.data.text import TokenizeReport, tokenize_files
from dew.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, tokenizer_for
from dew.data.windows import TokenWindows, WindowDataset

__all__ = [
    "BatchStream",
    "ByteTokenizer",
    "HFTokenizer",
    "Loading",
    "TokenFolderWriter",
    "TokenMeta",
    "TokenWindows",
    "TokenizeReport",
    "Tokenizer",
    "WindowDataset",
    "read_meta",
    "tokenize_files",
    "tokenizer_for",
    "write_example_corpus",
    "write_token_folder",
]
