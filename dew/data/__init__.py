"""Token data: the byte tokenizer, the token folder format, and fixed-length windows read in a
seeded shuffled order. Plain numpy; nothing here imports JAX."""

from dew.data.corpus import write_example_corpus
from dew.data.folder import TokenMeta, read_meta, write_token_folder
from dew.data.loading import BatchStream, Loading
from dew.data.tokenizer import ByteTokenizer
from dew.data.windows import TokenWindows, WindowDataset

__all__ = [
    "BatchStream",
    "ByteTokenizer",
    "Loading",
    "TokenMeta",
    "TokenWindows",
    "WindowDataset",
    "read_meta",
    "write_example_corpus",
    "write_token_folder",
]
