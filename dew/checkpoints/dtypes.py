"""Dtype names in a checkpoint and how each dtype's bits are stored.

The index names an array's dtype by its numpy name (`float32`, `bfloat16`, `float8_e4m3fn`, ...).
Numpy's own numeric dtypes are stored as themselves, little-endian (`<f4`, `<i8`, `|b1`). The
ml_dtypes types (bfloat16, the float8/float6/float4 families, int4, ...) are unknown to other
readers, so their raw bits are stored as unsigned integers of the same width (`<u2` for bfloat16,
`|u1` for float8) and the index's dtype name restores them.

Only the names below are accepted when reading, so an index cannot make the loader look up an
arbitrary attribute or build an object dtype.
"""

import ml_dtypes
import numpy as np

_NUMPY_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_ML_NAMES = (
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "int1",
    "int2",
    "int4",
    "uint1",
    "uint2",
    "uint4",
    "complex32",
    "bcomplex32",
)


def _build_table() -> dict[str, tuple[np.dtype, np.dtype]]:
    table = {}
    for name in _NUMPY_NAMES:
        dtype = np.dtype(name)
        table[name] = (dtype, dtype.newbyteorder("<"))
    for name in _ML_NAMES:
        scalar_type = getattr(ml_dtypes, name, None)
        if scalar_type is None:  # an older or newer ml_dtypes without this type
            continue
        dtype = np.dtype(scalar_type)
        table[dtype.name] = (dtype, np.dtype(f"<u{dtype.itemsize}"))
    return table


# name -> (dtype in memory, dtype of the bits on disk)
_TABLE = _build_table()
SUPPORTED = tuple(sorted(_TABLE))


def name_of(dtype) -> str:
    """The checkpoint name of `dtype`; ValueError for dtypes a checkpoint cannot hold."""
    dtype = np.dtype(dtype)
    if dtype.name not in _TABLE or _TABLE[dtype.name][0] != dtype.newbyteorder("="):
        raise ValueError(
            f"a checkpoint cannot hold dtype {dtype} (supported: {', '.join(SUPPORTED)})"
        )
    return dtype.name


def from_name(name: str) -> np.dtype:
    """The in-memory dtype for a checkpoint dtype name; KeyError for unknown names."""
    return _TABLE[name][0]


def storage_of(name: str) -> np.dtype:
    """The on-disk dtype that holds the bits of dtype `name` (always little-endian)."""
    return _TABLE[name][1]


def to_storage(array: np.ndarray) -> np.ndarray:
    """`array`'s bits as a C-contiguous little-endian array of its storage dtype (no copy if
    possible)."""
    name = name_of(array.dtype)
    storage = storage_of(name)
    if not array.flags.c_contiguous:  # np.ascontiguousarray would turn 0-d into 1-d
        array = np.array(array, order="C")
    if name in _ML_NAMES:
        return array.view(storage)
    return array.astype(storage, copy=False)  # only byte-swaps on a big-endian host
