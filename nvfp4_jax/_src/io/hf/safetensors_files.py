"""Safetensors files, read and written directly: an 8-byte header length, a JSON header, bytes.

The `safetensors` package cannot read float8 into NumPy, and writing tensor by tensor keeps
host memory bounded by one layer. A header is strict JSON (`format.loads`) and every number
in it is checked against the file before a tensor is read: nothing is allocated from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nvfp4_jax._src.io.durable import fsync_fd
from nvfp4_jax._src.io.hf.format import MAX_HEADER, loads, short

_ST_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


def is_float(dtype: np.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


# --- reading ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """The header of one safetensors file; reads tensors, or slices of them, on demand."""

    def __init__(self, path: str):
        self.path = path
        self.entries, self.metadata, self.data_start = _read_header(path)

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """Tensor `name`, or `tensor[index]`, as a NumPy array (only those bytes are read)."""
        entry = self.entries[name]
        if entry.end == entry.begin:
            return np.zeros(entry.shape, entry.dtype)[() if index is None else index]
        raw = np.memmap(
            self.path,
            np.uint8,
            mode="r",
            offset=self.data_start + entry.begin,
            shape=(entry.end - entry.begin,),
        )
        array = raw.view(entry.dtype).reshape(entry.shape)
        return np.array(array if index is None else array[index])


def _read_header(path: str) -> tuple[dict[str, Entry], dict, int]:
    """The entries, metadata and data offset of a safetensors file, every number checked.

    Nothing is allocated from the header's numbers: each entry is checked against the file's
    size before any tensor is read (a header claiming 2^60 elements is an error, not an
    allocation).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        raw = file.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < length <= min(size - 8, MAX_HEADER):
            raise ValueError(
                f"{path}: not a safetensors file (header length {length}, file size {size})"
            )
        blob = file.read(length)
    header = loads(path, blob, "the safetensors header")
    if not isinstance(header, dict):
        raise ValueError(
            f"{path}: the safetensors header must be a JSON object, got {type(header).__name__}"
        )
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings, got {short(metadata)}")
    data_size = size - 8 - length
    entries = {name: _parse_entry(path, name, info, data_size) for name, info in header.items()}
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ValueError(f"{path}: the data of tensors {first!r} and {second!r} overlap")
    return entries, metadata, 8 + length


def _parse_entry(path: str, name: str, info, data_size: int) -> Entry:
    """One header entry, checked: dtype, shape and offsets fit each other and the file."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: the entry must be a JSON object, got {short(info)}")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in info]
    if missing:
        raise ValueError(f"{where}: the entry lacks {missing}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise ValueError(f"{where}: dtype {short(dtype)} is not one of {sorted(_ST_DTYPES)}")
    if not _is_int_list(shape) or any(d < 0 for d in shape):
        raise ValueError(f"{where}: shape {short(shape)} is not a list of non-negative integers")
    if not _is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise ValueError(
            f"{where}: data_offsets {short(offsets)} is not a list [begin, end] of integers "
            "with 0 <= begin <= end"
        )
    (begin, end), nbytes = offsets, math.prod(shape) * _ST_DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise ValueError(
            f"{where}: data_offsets {begin}..{end} hold {end - begin} bytes; {dtype} "
            f"{tuple(shape)} needs {nbytes} bytes"
        )
    if end > data_size:
        raise ValueError(
            f"{where}: data_offsets {begin}..{end} run past the end of the file ({data_size} "
            "bytes of data)"
        )
    return Entry(_ST_DTYPES[dtype], tuple(shape), begin, end)


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a whole safetensors file into NumPy arrays, float8 and bfloat16 included.

    Args:
      path: a `.safetensors` file.

    Returns:
      `{tensor name: array}` with the file's dtypes (`ml_dtypes` for BF16 and F8_*) and
      shapes.

    Raises:
      ValueError: not a safetensors file (a header that is not a UTF-8 JSON object, has
        duplicate keys, nests deeper than 64 levels, or `__metadata__` that is not strings
        to strings), or an entry with an unsupported dtype, a shape that is not a list of
        non-negative ints, offsets that do not match it, run past the file or overlap
        another tensor's (the message names the file and the tensor).
    """
    file = SafetensorsFile(os.fspath(path))
    return {name: file.read(name) for name in file.entries}


# --- writing ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Unit:
    """Tensors written together (one linear's, or one plain tensor): specs, then bytes."""

    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, safetensors dtype, shape)
    produce: Callable[[], dict[str, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * _ST_DTYPES[d].itemsize for _, d, s in self.specs)


def write_safetensors(path: str, units: Sequence[Unit], metadata: dict[str, str]) -> None:
    """Writes `units` to one file: the header from the specs, then each unit's bytes in turn."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for unit in units:
        for name, dtype, shape in unit.specs:
            size = math.prod(shape) * _ST_DTYPES[dtype].itemsize
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(blob)))
        file.write(blob)
        for unit in units:
            arrays = unit.produce()
            for name, dtype, shape in unit.specs:
                _write_array(file, name, arrays.pop(name), dtype, shape)
            del arrays
        file.flush()
        fsync_fd(file.fileno())


def _write_array(file, name: str, array: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
    array = np.asarray(array, order="C")  # (np.ascontiguousarray makes a scalar 1-D)
    if array.dtype != _ST_DTYPES[dtype] or array.shape != tuple(shape):
        raise AssertionError(
            f"{name}: planned {dtype} {shape}, produced {array.dtype} {array.shape}"
        )
    file.write(memoryview(array.reshape(-1).view(np.uint8)))
