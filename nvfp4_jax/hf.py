"""Hugging Face checkpoints in NVIDIA ModelOpt's NVFP4 format: export for engines, import.

The format (the one `nvidia/*-NVFP4` checkpoints use, and vLLM, SGLang and TensorRT-LLM load)
is a Hugging Face model directory: `config.json` (the model's config with a
`quantization_config`), ModelOpt's legacy `hf_quant_config.json`, and the weights in
`model.safetensors` or in HF's sharded layout (`model-0000N-of-0000M.safetensors` with
`model.safetensors.index.json`). A quantized linear `<m>` (HF names, PyTorch's (out, in)
orientation) is stored as

| tensor | dtype | shape | meaning |
| --- | --- | --- | --- |
| `<m>.weight` | U8 | (out, in/2) | E2M1 codes, element 2i in the low nibble |
| `<m>.weight_scale` | F8_E4M3 | (out, in/16) | block scales, row-major (not swizzled) |
| `<m>.weight_scale_2` | F32 | () | the decode scale D (amax / 2688) |
| `<m>.input_scale` | F32 | () | activation amax / 2688; "NVFP4" (W4A4) only |

and decodes as `e2m1[code] * (f32(weight_scale) * weight_scale_2)`. Every other tensor keeps
its HF name and is stored in the model dtype; excluded linears (`lm_head` by default) as a
float `<m>.weight` (out, in).

Flax names differ from HF's: a `kernel` (in, out) becomes `weight` (out, in), an `embedding`
or a norm `scale` becomes `weight`. A `NameMap` (ordered `NameRule`s, first match wins)
translates both ways; `llama_name_map()` is the map of Flax models written with HF's module
names. Flax's (in, out) kernel quantized along `in` (`quantize(w, axis=0)`) is stored as
(out, in): its `codes` and `scales` are the HF `.weight` and `.weight_scale` bytes, and
`q.global_scale` is `.weight_scale_2`. An imported weight is that array back, carrying the
file's `weight_scale_2` as its `decode_scale`, so it dequantizes exactly as ModelOpt decodes
(docs/NUMERICS.md section 3), the sign of zero aside.

Safetensors files are read and written here directly (an 8-byte header length, a JSON header,
the raw bytes): the `safetensors` package cannot read float8 into NumPy, and writing tensor by
tensor keeps host memory bounded by one layer.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import shutil
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from nvfp4_jax import formats
from nvfp4_jax import nnx as nvfp4_nnx
from nvfp4_jax._storage import collective, fsync_fd, fsync_path, is_key_array, key_name, to_host
from nvfp4_jax._version import __version__
from nvfp4_jax.array import NVFP4Array, is_nvfp4_array, validate_nvfp4_array
from nvfp4_jax.ops import dequantize, quantize, tensor_amax

CONFIG_NAME = "config.json"
QUANT_CONFIG_NAME = "hf_quant_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")
DEFAULT_EXCLUDE = ("lm_head", "model.embed_tokens")
DEFAULT_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# What an engine needs beyond the weights (heads and layers cannot be read off the tensors).
REQUIRED_CONFIG_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
)
KINDS = ("linear", "embedding", "norm", "plain")
# The producer of config.json's quantization_config (read by no engine: any name works), and
# the one of the legacy hf_quant_config.json, which vLLM reads only under ModelOpt's name:
# the file is ModelOpt's format, written as ModelOpt 0.47 writes it.
PRODUCER = {"name": "nvfp4_jax", "version": __version__}
LEGACY_PRODUCER = {
    "name": "modelopt",
    "version": "0.47.0",
    "exported_by": {"name": "nvfp4_jax", "version": __version__},
}
# Tensors of a quantized linear besides `.weight`, and FP8 KV-cache scales (read, not written).
_QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_KV_SUFFIXES = ("k_scale", "v_scale")
_WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")
_MAX_HEADER = 100 * 2**20
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
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


# --- the name map ---------------------------------------------------------------------------

_FIELD = re.compile(r"\{(\w+)(\*?)\}")


def _compile(pattern: str, sep: str) -> tuple[re.Pattern, dict[str, bool]]:
    """A pattern's regex and its fields (name -> spans several components)."""
    parts, fields, pos = [], {}, 0
    one = f"[^{re.escape(sep)}]+"
    for match in _FIELD.finditer(pattern):
        name, multi = match.group(1), bool(match.group(2))
        if name in fields:
            raise ValueError(f"NameRule: field {{{name}}} appears twice in {pattern!r}")
        fields[name] = multi
        parts.append(re.escape(pattern[pos : match.start()]))
        body = f"{one}(?:{re.escape(sep)}{one})*" if multi else one
        parts.append(f"(?P<{name}>{body})")
        pos = match.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts)), fields


def _fill(pattern: str, values: Mapping[str, str]) -> str:
    return _FIELD.sub(lambda match: values[match.group(1)], pattern)


@dataclasses.dataclass(frozen=True)
class NameRule:
    """One rule of a `NameMap`: a Flax path pattern, the HF name pattern, the kind.

    Patterns are literal text with fields: `{name}` stands for one path component (no "/"
    in a Flax path, no "." in an HF name), `{name*}` for one or more (joined with "/" on the
    Flax side, "." on the HF side). Both sides hold the same fields, so a rule translates in
    both directions (a regex could not be inverted for the import).

    Attributes:
      flax: the Flax path pattern, components joined with "/", e.g. "{module*}/kernel".
      hf: the HF tensor name pattern, e.g. "model.{module*}.weight".
      kind: how the tensor converts: "linear" (a kernel (in, out) <-> `weight` (out, in),
        quantized unless excluded; `hf` must end in ".weight"), "embedding" (same
        orientation, 2-D), "norm" (1-D) or "plain" (as it is).
    """

    flax: str
    hf: str
    kind: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f"NameRule {self.flax!r}: kind must be one of {KINDS}, got {self.kind!r}"
            )
        if self.kind == "linear" and not self.hf.endswith(".weight"):
            raise ValueError(f"NameRule {self.flax!r}: a linear's HF name must end in '.weight'")
        flax_fields, hf_fields = _compile(self.flax, "/")[1], _compile(self.hf, ".")[1]
        if flax_fields != hf_fields:
            raise ValueError(
                f"NameRule: {self.flax!r} and {self.hf!r} must hold the same fields "
                f"({sorted(flax_fields)} vs {sorted(hf_fields)})"
            )


class NameMap:
    """An ordered list of `NameRule`s between Flax paths and HF tensor names; first match wins.

    Args:
      rules: `NameRule`s or `(flax, hf, kind)` tuples.
    """

    def __init__(self, rules: Iterable[NameRule | tuple[str, str, str]]):
        self.rules = tuple(r if isinstance(r, NameRule) else NameRule(*r) for r in rules)
        self._compiled = [
            (rule, _compile(rule.flax, "/"), _compile(rule.hf, ".")) for rule in self.rules
        ]

    def to_hf(self, path: str) -> tuple[str, str] | None:
        """`(HF tensor name, kind)` of the Flax path `path` ("a/b/kernel"), or None."""
        for rule, (flax_re, fields), _ in self._compiled:
            match = flax_re.fullmatch(path)
            if match:
                values = {k: v.replace("/", ".") if fields[k] else v for k, v in _groups(match)}
                return _fill(rule.hf, values), rule.kind
        return None

    def to_flax(self, name: str, ndim: int | None = None) -> tuple[str, str] | None:
        """`(Flax path, kind)` of the HF tensor `name`, or None.

        Args:
          name: an HF tensor name, e.g. "model.norm.weight".
          ndim: the rank of the stored tensor; rules whose kind cannot hold that rank
            (linear and embedding: 2, norm: 1) are passed over.
        """
        for rule, _, (hf_re, fields) in self._compiled:
            match = hf_re.fullmatch(name)
            if match and _kind_fits(rule.kind, ndim):
                values = {k: v.replace(".", "/") if fields[k] else v for k, v in _groups(match)}
                return _fill(rule.flax, values), rule.kind
        return None

    def __repr__(self) -> str:
        return f"NameMap({list(self.rules)!r})"


def _groups(match: re.Match) -> list[tuple[str, str]]:
    return list(match.groupdict().items())


def _kind_fits(kind: str, ndim: int | None) -> bool:
    if ndim is None or kind == "plain":
        return True
    return ndim == (1 if kind == "norm" else 2)


def llama_name_map() -> NameMap:
    """The map of a Llama (and of any Flax model written with HF's module names).

    Flax `lm_head/kernel` <-> `lm_head.weight`; `embed_tokens/embedding` <->
    `model.embed_tokens.weight`; every other `<module>/kernel` <-> `model.<module>.weight`
    (a linear), `<module>/scale` <-> `model.<module>.weight` (a norm), `<module>/bias` <->
    `model.<module>.bias`, with "/" in `<module>` as "." (`layers/0/self_attn/q_proj` is
    `model.layers.0.self_attn.q_proj`).
    """
    return NameMap(
        [
            NameRule("lm_head/kernel", "lm_head.weight", "linear"),
            NameRule("embed_tokens/embedding", "model.embed_tokens.weight", "embedding"),
            NameRule("{module*}/kernel", "model.{module*}.weight", "linear"),
            NameRule("{module*}/scale", "model.{module*}.weight", "norm"),
            NameRule("{module*}/bias", "model.{module*}.bias", "plain"),
        ]
    )


def _as_name_map(name_map) -> NameMap:
    if name_map is None:
        return llama_name_map()
    return name_map if isinstance(name_map, NameMap) else NameMap(name_map)


# --- safetensors ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class _SafetensorsFile:
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


def _read_header(path: str) -> tuple[dict[str, _Entry], dict, int]:
    """The entries, metadata and data offset of a safetensors file, every number checked.

    Nothing is allocated from the header's numbers: each entry is checked against the file's
    size before any tensor is read (a header claiming 2^60 elements is an error, not an
    allocation).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        raw = file.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise ValueError(
                f"{path}: not a safetensors file (header length {length}, file size {size})"
            )
        blob = file.read(length)
    header = _loads(path, blob, "the safetensors header")
    if not isinstance(header, dict):
        raise ValueError(
            f"{path}: the safetensors header must be a JSON object, got {type(header).__name__}"
        )
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(
            f"{path}: __metadata__ must map strings to strings, got {_short(metadata)}"
        )
    data_size = size - 8 - length
    entries = {name: _parse_entry(path, name, info, data_size) for name, info in header.items()}
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ValueError(f"{path}: the data of tensors {first!r} and {second!r} overlap")
    return entries, metadata, 8 + length


def _parse_entry(path: str, name: str, info, data_size: int) -> _Entry:
    """One header entry, checked: dtype, shape and offsets fit each other and the file."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: the entry must be a JSON object, got {_short(info)}")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in info]
    if missing:
        raise ValueError(f"{where}: the entry lacks {missing}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise ValueError(f"{where}: dtype {_short(dtype)} is not one of {sorted(_ST_DTYPES)}")
    if not _is_int_list(shape) or any(d < 0 for d in shape):
        raise ValueError(f"{where}: shape {_short(shape)} is not a list of non-negative integers")
    if not _is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise ValueError(
            f"{where}: data_offsets {_short(offsets)} is not a list [begin, end] of integers "
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
    return _Entry(_ST_DTYPES[dtype], tuple(shape), begin, end)


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _short(value, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (a hostile file's values can be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A JSON string (escapes included), and every byte but brackets: to measure nesting.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_MAX_JSON_DEPTH = 64


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _DuplicateKey(twice)
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _loads(path: str, blob: bytes, what: str):
    """Strict JSON from UTF-8 `blob`: no duplicate keys, no NaN/Infinity, bounded nesting.

    Raises a ValueError naming `path` for anything else; the nesting is measured before the
    parser runs (without recursion), so a hostile file cannot exhaust the stack.
    """
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: {what} is not UTF-8 ({error})") from None
    # Removing the innermost bracket pairs once per level: what is left after the limit
    # nests deeper than it, or its brackets do not match.
    brackets = _JSON_STRING.sub(b"", blob).translate(None, _NOT_BRACKETS)
    for _ in range(_MAX_JSON_DEPTH):
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == brackets:
            break
        brackets = shorter
    if brackets:
        raise ValueError(
            f"{path}: {what} is not valid JSON: its brackets nest deeper than "
            f"{_MAX_JSON_DEPTH} levels or do not match"
        )
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _DuplicateKey as error:
        raise ValueError(f"{path}: {what} holds the key {error.args[0]!r} twice") from None
    except (ValueError, RecursionError, MemoryError) as error:
        raise ValueError(f"{path}: {what} is not valid JSON: {_short(error, 200)}") from None


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
    file = _SafetensorsFile(os.fspath(path))
    return {name: file.read(name) for name in file.entries}


@dataclasses.dataclass
class _Unit:
    """Tensors written together (one linear's, or one plain tensor): specs, then bytes."""

    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, safetensors dtype, shape)
    produce: Callable[[], dict[str, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * _ST_DTYPES[d].itemsize for _, d, s in self.specs)


def _write_safetensors(path: str, units: Sequence[_Unit], metadata: dict[str, str]) -> None:
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


# --- export: the leaves -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What `export_hf_checkpoint` wrote.

    Attributes:
      directory: the checkpoint directory.
      quant_algo: "NVFP4" or "W4A16_NVFP4".
      quantized: HF names of the linears written in NVFP4.
      excluded: the modules kept in high precision (config.json's `ignore`).
      files: the safetensors files, in order.
      total_size: bytes of tensor data in them.
      skipped: Flax paths of leaves that are not weights (rng state, `skip=` matches).
      followed: where the precision of each linear came from: "rules" (`rules=`), "model"
        (the layers of an nnx model or state: `nvfp4_jax.nnx.Linear`s in NVFP4, others in
        high precision) or "" (none: every linear not excluded is quantized).
      trained_high_precision: HF names of the linears kept in high precision because the
        model computed them so (a plain `nnx.Linear`, a rule with recipe None).
      group_high_precision: HF names of linears the model computed in NVFP4 but written in
        high precision because another member of their fused group (q/k/v, gate/up) was
        trained in high precision: engines load a fused group all quantized or all not.
    """

    directory: str
    quant_algo: str
    quantized: tuple[str, ...]
    excluded: tuple[str, ...]
    files: tuple[str, ...]
    total_size: int
    skipped: tuple[str, ...]
    followed: str = ""
    trained_high_precision: tuple[str, ...] = ()
    group_high_precision: tuple[str, ...] = ()


@dataclasses.dataclass
class _Leaves:
    weights: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_amax: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_scale: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    # Flax module paths holding the variables of an `nvfp4_jax.nnx.Linear`.
    nvfp4: set[str] = dataclasses.field(default_factory=set)


# The variables only an `nvfp4_jax.nnx.Linear` holds: they mark a layer that computes in NVFP4.
_NVFP4_VARIABLES = (nvfp4_nnx.InputAmax, nvfp4_nnx.InputScale, nvfp4_nnx.QuantizedKernel)


def _is_leaf(value) -> bool:
    return isinstance(value, nnx.Variable) or is_nvfp4_array(value)


def _collect_leaves(params, skip: Sequence[str]) -> _Leaves:
    """Sorts the leaves: weights, recorded input amaxes or scales, and what is skipped.

    Weights are the plain leaves of a pytree, or the `nnx.Param`s (and variables holding an
    `NVFP4Array`) of an nnx state; other nnx variables (rng streams, ...) and PRNG keys are
    not. A leaf named `input_amax` (or `input_scale`, as `load_hf_checkpoint` returns it)
    belongs to the module above it.
    """
    leaves = _Leaves()
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_leaf)
    for keypath, leaf in flat:
        names = [key_name(k) for k in keypath]
        while names and names[-1] in ("value", "raw_value"):
            names.pop()
        path, where = "/".join(names), jax.tree_util.keystr(keypath) or "the root"
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        # A frozen NVFP4 kernel (`Linear.from_quantized`) is a weight though not an nnx.Param.
        is_weight = not isinstance(leaf, nnx.Variable) or isinstance(leaf, nnx.Param)
        is_weight = is_weight or is_nvfp4_array(value)
        if isinstance(leaf, _NVFP4_VARIABLES):
            leaves.nvfp4.add(path.rpartition("/")[0])
        _sort_leaf(leaves, path, where, value, is_weight, skip)
    return leaves


def _sort_leaf(leaves: _Leaves, path, where, value, is_weight, skip) -> None:
    parent, _, last = path.rpartition("/")
    if any(re.fullmatch(pattern, path) for pattern in skip):
        leaves.skipped.append(path)
    elif last in ("input_amax", "input_scale"):
        getattr(leaves, last)[parent] = (where, value)
    elif not is_weight or last in _KV_SUFFIXES or is_key_array(value):
        leaves.skipped.append(path)
    elif path in leaves.weights:
        raise ValueError(
            f"export_hf_checkpoint: the leaves at {leaves.weights[path][0]} and {where} have "
            f"the same path {path!r}"
        )
    else:
        leaves.weights[path] = (where, value)


# --- export: the modules ------------------------------------------------------------------


@dataclasses.dataclass
class _Tensor:
    """A weight leaf and where it goes: Flax path, HF name, kind, and for linears the module."""

    path: str
    where: str
    hf: str
    kind: str
    value: Any
    excluded: bool = False
    group: tuple[str, int] | None = None
    # Why a linear is kept in high precision besides `exclude=`: "trained" (the model computed
    # it so) or "group" (a member of its fused group was trained in high precision).
    why: str = ""

    @property
    def module(self) -> str:
        return self.hf.removesuffix(".weight")

    @property
    def flax_module(self) -> str:
        return self.path.rpartition("/")[0]

    @property
    def quantized(self) -> bool:
        return self.kind == "linear" and not self.excluded


def _map_tensors(leaves: _Leaves, name_map: NameMap) -> list[_Tensor]:
    tensors, owners = [], {}
    for path, (where, value) in leaves.weights.items():
        mapped = name_map.to_hf(path)
        if mapped is None:
            raise ValueError(
                f"export_hf_checkpoint: the leaf at {where} (Flax path {path!r}) matches no "
                "rule of the name map; pass name_map= with a rule for it, or skip= to leave it out"
            )
        hf, kind = mapped
        if hf in owners:
            raise ValueError(
                f"export_hf_checkpoint: the leaves at {owners[hf]} and {where} both map to "
                f"the HF tensor {hf!r}"
            )
        owners[hf] = where
        tensors.append(_Tensor(path, where, hf, kind, value))
    return tensors


def _engine_ignores(module: str, ignore: Sequence[str]) -> bool:
    """Whether an engine skips `module` for `ignore`: exact, substring, fnmatch (as vLLM)."""
    return any(p == module or p in module or fnmatch.fnmatchcase(module, p) for p in ignore)


def _plan_modules(tensors, exclude, fused_groups, block_2d, decide=None) -> list[str]:
    """Marks excluded linears and fused groups; checks them; returns the `ignore` list.

    `decide(t)`, where given, tells whether the model computed the linear `t` in NVFP4 (None:
    it cannot tell); a linear it computed in high precision is kept so, with the whole fused
    group it belongs to.
    """
    for t in tensors:
        if t.kind == "linear":
            t.group = _group_of(t.module, fused_groups)
    if decide is not None:
        _follow_decisions(tensors, decide)
    ignore = _exclude(tensors, exclude)
    _check_groups(tensors)
    for t in tensors:
        if t.quantized:
            _check_quantizable(t, block_2d)
            if _engine_ignores(t.module, sorted(ignore)):
                raise ValueError(
                    f"export_hf_checkpoint: {t.module} is quantized, but an engine reading the "
                    f"ignore list {sorted(ignore)} would take it for excluded"
                )
    return sorted(ignore)


def _exclude(tensors, exclude) -> set[str]:
    """Marks the linears and embeddings `exclude` matches; returns every module excluded."""
    ignore = set()
    for t in tensors:
        if t.kind in ("linear", "embedding"):
            module = t.hf.removesuffix(".weight")
            if any(module == p or fnmatch.fnmatchcase(module, p) for p in exclude):
                t.excluded = True
            if t.excluded:
                ignore.add(module)
    return ignore


# --- export: the model's own decisions ---------------------------------------------------


def _decider(rules, leaves: _Leaves) -> tuple[str, Callable | None]:
    """(where the linears' precisions come from, `decide(t)`), or ("", None): quantize all.

    `rules` (a `QuantizeReport`, or `Rule`s, duck-typed: hf may not import rules) decides;
    else the state itself: where it holds `nvfp4_jax.nnx.Linear` layers, the linears it holds
    otherwise (plain `nnx.Linear`) computed in high precision.
    """

    def held(t: _Tensor) -> bool:
        return t.flax_module in leaves.nvfp4

    if rules is None:
        return ("model", held) if leaves.nvfp4 else ("", None)
    decisions = getattr(rules, "layers", None)
    if isinstance(decisions, Mapping):  # a QuantizeReport: path -> LayerDecision
        return "rules", _report_decider(decisions, held)
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Iterable):
        rules = None
    else:
        rules = tuple(rules)
    if rules is None or not all(hasattr(r, "pattern") and hasattr(r, "recipe") for r in rules):
        raise TypeError(
            "export_hf_checkpoint: rules must be the QuantizeReport nvfp4_jax.quantize_model "
            "returned or a sequence of Rule (the ones it was given)"
        )

    def from_rules(t: _Tensor) -> bool:
        for rule in rules:  # first match wins, re.search on the module path (Rule.matches)
            if re.search(rule.pattern, t.flax_module):
                # quantize_model leaves a kernel it cannot quantize in high precision.
                return rule.recipe is not None and _quantizable(t.value)
        return held(t)  # no rule: the layer was left as it was

    return "rules", from_rules


def _report_decider(decisions: Mapping, held: Callable) -> Callable:
    def from_report(t: _Tensor) -> bool | None:
        if t.flax_module not in decisions:
            return None
        action = getattr(decisions[t.flax_module], "action", None)
        # "unmatched": the layer was left as it was; "skipped": it stayed high precision.
        return True if action == "nvfp4" else held(t) if action == "unmatched" else False

    return from_report


def _quantizable(value) -> bool:
    """Whether `quantize_model` turns a kernel into NVFP4: 2-D, both sizes multiples of 16."""
    if is_nvfp4_array(value):
        return True
    shape = tuple(np.shape(value))
    return len(shape) == 2 and not any(n % formats.BLOCK_SIZE for n in shape)


def _follow_decisions(tensors, decide) -> None:
    """Keeps in high precision the linears the model computed so, and their fused groups."""
    linears = [t for t in tensors if t.kind == "linear"]
    unknown = [t.flax_module for t in linears if decide(t) is None]
    if unknown:
        raise ValueError(
            f"export_hf_checkpoint: the QuantizeReport has no decision for {unknown}: pass "
            "the report quantize_model returned for this very model, or its rules"
        )
    for t in linears:
        if not decide(t):
            t.excluded, t.why = True, "trained"
    for members in _groups_of(linears).values():
        if any(t.why == "trained" for t in members):
            for t in members:
                if not t.excluded:
                    t.excluded, t.why = True, "group"


def _compact(modules: Sequence[str]) -> list[str]:
    """Module names, siblings and blocks folded: `['m.layers.{0-3}.mlp.{gate,up}_proj']`."""
    by_parent: dict[str, list[str]] = {}
    for module in modules:
        parent, _, child = module.rpartition(".")
        by_parent.setdefault(parent, []).append(child)
    blocks: dict[tuple[str, str], list[str]] = {}
    for parent, children in by_parent.items():
        tail = _braces(children)
        match = re.search(r"(?:^|\.)(\d+)(?=\.|$)", parent)
        if match is None:
            blocks.setdefault((parent, tail), [])
            continue
        template = parent[: match.start(1)] + "{#}" + parent[match.end(1) :]
        blocks.setdefault((template, tail), []).append(match.group(1))
    out = []
    for (template, tail), numbers in blocks.items():
        parent = template.replace("{#}", _numbers(numbers)) if numbers else template
        out.append(f"{parent}.{tail}" if parent else tail)
    return out


def _braces(items: Sequence[str]) -> str:
    """`["q_proj", "k_proj"]` -> "{q,k}_proj"; one item as it is."""
    if len(items) == 1:
        return items[0]
    prefix = os.path.commonprefix(list(items))
    suffix = os.path.commonprefix([i[len(prefix) :][::-1] for i in items])[::-1]
    middles = [i[len(prefix) : len(i) - len(suffix)] for i in items]
    if not all(middles):
        prefix, suffix, middles = "", "", list(items)
    return f"{prefix}{{{','.join(middles)}}}{suffix}"


def _numbers(numbers: Sequence[str]) -> str:
    """`["0", "1", "2", "5"]` -> "{0-2,5}"; one number as it is."""
    if len(numbers) == 1:
        return numbers[0]
    values = sorted(int(n) for n in numbers)
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs]
    return "{" + ",".join(parts) + "}"


def _group_of(module: str, fused_groups) -> tuple[str, int] | None:
    parent, _, name = module.rpartition(".")
    for i, group in enumerate(fused_groups):
        if name in group:
            return parent, i
    return None


def _groups_of(tensors) -> dict[tuple[str, int], list[_Tensor]]:
    groups: dict[tuple[str, int], list[_Tensor]] = {}
    for t in tensors:
        if t.group is not None:
            groups.setdefault(t.group, []).append(t)
    return groups


def _check_groups(tensors) -> None:
    for members in _groups_of(tensors).values():
        excluded = [t.module for t in members if t.excluded]
        if excluded and len(excluded) != len(members):
            kept = [t.module for t in members if not t.excluded]
            raise ValueError(
                f"export_hf_checkpoint: the fused group {[t.module for t in members]} is half "
                f"excluded ({excluded} excluded, {kept} not); engines fuse it into one "
                "layer, so exclude it whole or not at all"
            )


def _check_quantizable(t: _Tensor, block_2d: bool) -> None:
    value = t.value
    if is_nvfp4_array(value):
        if len(value.shape) != 2 or value.axis != -2 or value.rht:
            raise ValueError(
                f"export_hf_checkpoint: {t.where} is an NVFP4Array {value!r}; engines need "
                "a 2-D kernel quantized along its first axis (axis=0) without the RHT"
            )
        return
    shape, dtype = tuple(np.shape(value)), jnp.dtype(getattr(value, "dtype", np.float32))
    rows_ok = not block_2d or (len(shape) == 2 and shape[1] % formats.BLOCK_SIZE == 0)
    if len(shape) != 2 or shape[0] % formats.BLOCK_SIZE or not rows_ok:
        raise ValueError(
            f"export_hf_checkpoint: the linear {t.module} ({t.where}) has kernel shape {shape}; "
            "NVFP4 needs a 2-D (in, out) kernel with in a multiple of 16 (and out too with "
            "block_2d); add it to exclude= to keep it in high precision"
        )
    if dtype not in formats.SUPPORTED_DTYPES:
        raise TypeError(f"export_hf_checkpoint: the kernel of {t.module} has dtype {dtype}")


# --- export: the scales ---------------------------------------------------------------------


def _input_scales(tensors, leaves: _Leaves, input_amax) -> dict[str, np.float32]:
    """The `input_scale` of every quantized linear (W4A4); members of a group share the max.

    Sources: `input_scale` leaves (written as they are: a layer built from a checkpoint keeps
    its scale bit for bit), else `input_amax` leaves (times f32(1/2688)); the `input_amax`
    argument wins over both. Excluded linears' are ignored.
    """
    linears = [t for t in tensors if t.kind == "linear"]
    by_name = {t.module: t.module for t in linears} | {t.flax_module: t.module for t in linears}
    quantized = {t.module for t in linears if t.quantized}
    found: dict[str, tuple[str, Any, str]] = {}
    for kind, values in (("input_scale", leaves.input_scale), ("input_amax", leaves.input_amax)):
        for path, (where, value) in values.items():
            module = _module_for(by_name, path, where)
            found.setdefault(module, (kind, value, where))  # an input_scale leaf comes first
    for key, amax in (input_amax or {}).items():
        found[_module_for(by_name, key, f"input_amax[{key!r}]")] = ("input_amax", amax, key)
    scales = {m: _to_input_scale(v, kind, w) for m, (kind, v, w) in found.items() if m in quantized}
    return _share_in_groups(tensors, scales)


def _module_for(by_name: dict, key: str, where: str) -> str:
    if key not in by_name:
        raise ValueError(
            f"export_hf_checkpoint: {where} names {key!r}, which is no linear of the model "
            "(give a Flax module path such as 'layers/0/self_attn/q_proj' or an HF module name)"
        )
    return by_name[key]


def _to_input_scale(value, kind: str, where) -> np.float32:
    """`f32(amax) * f32(1/2688)` for an amax; an `input_scale` as it is (checked later)."""
    value = to_host(value).astype(np.float32)
    if value.size != 1:
        raise ValueError(
            f"export_hf_checkpoint: {kind} of {where} must be a scalar, got {value.shape}"
        )
    scale = value.reshape(()) * formats.RCP2688 if kind == "input_amax" else value.reshape(())
    return np.float32(scale)


def _share_in_groups(tensors, scales: dict) -> dict[str, np.float32]:
    """Each set's max scale for all its members; one error naming every module lacking one."""
    sets = _quantized_sets(tensors)
    order = [t.module for t in tensors if t.quantized]
    missing = [m for m in order if m not in scales]
    bad = [m for m in order if m in scales and not (np.isfinite(scales[m]) and scales[m] > 0)]
    if missing or bad:
        problems = [f"no input amax for {_compact(missing)}"] if missing else []
        if bad:
            values = sorted({float(scales[m]) * 2688 for m in bad})
            problems.append(
                f"an input amax of {values[:3]} (not positive and finite; 0: never calibrated) "
                f"for {_compact(bad)}"
            )
        raise ValueError(
            f"export_hf_checkpoint: {'; and '.join(problems)}. W4A4 (quant_algo='NVFP4') needs "
            "a positive, finite activation amax on every quantized linear (engines produce "
            "NaN without it): run nvfp4_jax.nnx.calibrate(model), a few batches through the "
            "model and nvfp4_jax.nnx.calibrate(model, False) before exporting, or pass "
            "input_amax={module: amax}, or export quant_algo='W4A16_NVFP4' (weight-only)"
        )
    out = {}
    for members in sets:
        out.update({t.module: max(scales[t.module] for t in members) for t in members})
    return out


def _quantized_sets(tensors) -> list[list[_Tensor]]:
    """Quantized linears in sets that share their scales: each fused group, each other one."""
    groups = _groups_of([t for t in tensors if t.quantized])
    alone = [[t] for t in tensors if t.quantized and t.group is None]
    return list(groups.values()) + alone


def _weight_amaxes(tensors, implementation) -> dict[str, np.float32 | None]:
    """The amax each float kernel is quantized with: its group's max (None: already NVFP4)."""
    out = {}
    for members in _quantized_sets(tensors):
        kinds = {is_nvfp4_array(t.value) for t in members}
        if kinds == {True}:
            _check_equal_scales(members)
            out.update({t.module: None for t in members})
            continue
        if len(kinds) > 1:
            raise ValueError(
                f"export_hf_checkpoint: the fused group {[t.module for t in members]} mixes "
                "NVFP4Arrays and float kernels; pass all of them in one form"
            )
        amax = max(_kernel_amax(t, implementation) for t in members)
        out.update({t.module: amax for t in members})
    return out


def _kernel_amax(t: _Tensor, implementation) -> np.float32:
    amax = np.float32(to_host(tensor_amax(t.value, axis=0, implementation=implementation)))
    if not np.isfinite(amax):
        raise ValueError(f"export_hf_checkpoint: the kernel of {t.module} holds NaN or inf")
    return amax


def _check_equal_scales(members) -> None:
    scales = {np.float32(to_host(t.value.global_scale)).tobytes() for t in members}
    if len(scales) > 1:
        raise ValueError(
            f"export_hf_checkpoint: the fused group {[t.module for t in members]} holds "
            "NVFP4Arrays with different decode scales; engines decode the fused layer with one "
            "(the max), so quantize the members with the group's max amax"
        )


# --- export: the units --------------------------------------------------------------------


def _quantized_unit(t: _Tensor, amax, input_scale, block_2d, implementation) -> _Unit:
    rows, cols = tuple(t.value.shape)[::-1]  # the stored (out, in) of an (in, out) kernel
    specs = [
        (f"{t.module}.weight", "U8", (rows, cols // 2)),
        (f"{t.module}.weight_scale", "F8_E4M3", (rows, cols // formats.BLOCK_SIZE)),
        (f"{t.module}.weight_scale_2", "F32", ()),
    ]
    if input_scale is not None:
        specs.append((f"{t.module}.input_scale", "F32", ()))

    def produce() -> dict[str, np.ndarray]:
        q = t.value
        if amax is not None:
            q = quantize(
                q, axis=0, block_2d=block_2d, amax=jnp.float32(amax), implementation=implementation
            )
        arrays = [q.codes, q.scales, np.float32(to_host(q.global_scale)), input_scale]
        return {name: to_host(a) for (name, _, _), a in zip(specs, arrays, strict=False)}

    return _Unit(tuple(specs), produce)


def _dense_unit(t: _Tensor, dtype) -> _Unit:
    if is_nvfp4_array(t.value) and t.kind != "linear":
        raise TypeError(f"export_hf_checkpoint: {t.where} is an NVFP4Array but no linear kernel")
    shape = tuple(t.value.shape)
    if t.kind == "linear":
        if len(shape) != 2:
            raise ValueError(f"export_hf_checkpoint: the kernel at {t.where} is not 2-D: {shape}")
        shape = shape[::-1]
    source = np.dtype(t.value.dtype)
    target = np.dtype(dtype) if dtype is not None and _is_float(source) else source
    if target not in _ST_NAMES:
        raise TypeError(
            f"export_hf_checkpoint: {t.where} has dtype {target}, which safetensors lacks"
        )

    def produce() -> dict[str, np.ndarray]:
        value = dequantize(t.value, jnp.float32) if is_nvfp4_array(t.value) else t.value
        array = to_host(value).astype(target, copy=False)
        return {t.hf: array.T if t.kind == "linear" else array}

    return _Unit(((t.hf, _ST_NAMES[target], shape),), produce)


def _is_float(dtype: np.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _units(tensors, amaxes, input_scales, block_2d, dtype, implementation) -> list[_Unit]:
    units = []
    for t in tensors:
        if t.quantized:
            scale = input_scales.get(t.module)
            units.append(_quantized_unit(t, amaxes[t.module], scale, block_2d, implementation))
        else:
            units.append(_dense_unit(t, dtype))
    owners: dict[str, str] = {}
    for t, unit in zip(tensors, units, strict=True):
        for name, _, _ in unit.specs:
            if name in owners:
                raise ValueError(
                    f"export_hf_checkpoint: the leaves at {owners[name]} and {t.where} both "
                    f"write the tensor {name!r}"
                )
            owners[name] = t.where
    return units


# --- export: the configs ------------------------------------------------------------------


def _quantization_config(quant_algo: str, ignore: list[str]) -> dict:
    """config.json's `quantization_config`, in the form ModelOpt >= 0.31 writes."""
    nvfp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": formats.BLOCK_SIZE}
    group: dict[str, Any] = {"weights": dict(nvfp4)}
    if quant_algo == "NVFP4":
        group["input_activations"] = dict(nvfp4)
    group["targets"] = ["Linear"]
    return {
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "quant_algo": quant_algo,
        "producer": dict(PRODUCER),
        "quant_method": "modelopt",
    }


def _legacy_quant_config(quant_algo: str, ignore: list[str]) -> dict:
    """ModelOpt's legacy `hf_quant_config.json` (read by TensorRT-LLM, older engines)."""
    return {
        "producer": dict(LEGACY_PRODUCER),
        "quantization": {
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": None,
            "group_size": formats.BLOCK_SIZE,
            "exclude_modules": list(ignore),
        },
    }


def _model_config(config, directory: str) -> dict:
    """The caller's model config, or the one in `directory`, checked for what engines need."""
    path = os.path.join(directory, CONFIG_NAME)
    if config is None and os.path.isfile(path):
        config = _read_json(path)
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(f"export_hf_checkpoint: config must be a dict, got {type(config).__name__}")
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(
            f"export_hf_checkpoint: the model config lacks {missing}: engines cannot read them "
            "off the weights. Pass config= (the model's Hugging Face config.json as a dict, e.g. "
            "transformers' LlamaConfig(...).to_dict()) or put a config.json in the directory"
        )
    if not isinstance(config["architectures"], list) or not config["architectures"]:
        raise ValueError("export_hf_checkpoint: config['architectures'] must be a non-empty list")
    return {k: v for k, v in config.items() if k != "quantization_config"}


def _check_config_against(config: dict, tensors, dtype) -> dict:
    for t in tensors:
        if t.kind == "embedding":
            vocab, hidden = tuple(t.value.shape)
            if (config["vocab_size"], config["hidden_size"]) != (vocab, hidden):
                raise ValueError(
                    f"export_hf_checkpoint: the config says vocab_size {config['vocab_size']}, "
                    f"hidden_size {config['hidden_size']}; the embedding {t.hf} is "
                    f"{(vocab, hidden)}"
                )
    if dtype is not None and "dtype" not in config and "torch_dtype" not in config:
        config = {**config, "torch_dtype": np.dtype(dtype).name}
    return config


def _check_tokenizer(tokenizer, config: dict) -> None:
    if tokenizer not in (None, "bytes"):
        raise ValueError(
            f"export_hf_checkpoint: tokenizer must be None or 'bytes', got {tokenizer!r} (for "
            "another tokenizer, save_pretrained it into the folder: the export keeps it)"
        )
    vocab = config.get("vocab_size")
    if tokenizer == "bytes" and not (isinstance(vocab, int) and vocab >= 256):
        raise ValueError(
            f"export_hf_checkpoint: tokenizer='bytes' needs vocab_size >= 256 (token i is "
            f"byte i), the config says {vocab}"
        )


def _byte_tokenizer(config: dict) -> dict[str, dict]:
    """A byte-level tokenizer (token i is byte i, no merges, no special tokens) as HF files.

    `tokenizer.json` is a `tokenizers` BPE over GPT-2's byte-to-character table with the
    ByteLevel pre-tokenizer and decoder and no merges, so encoding UTF-8 text gives its bytes
    and decoding bytes gives the text: what `transformers.AutoTokenizer` (and so vLLM, SGLang)
    loads for a model trained on raw bytes.
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    byte_level["use_regex"] = False
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None}
    model |= {"end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False}
    model |= {"ignore_merges": False, "vocab": {chars[b]: b for b in range(256)}, "merges": []}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": []}
    tokenizer |= {"normalizer": None, "pre_tokenizer": byte_level, "post_processor": None}
    tokenizer |= {"decoder": dict(byte_level), "model": model}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    settings |= {"add_bos_token": False, "add_eos_token": False}
    if isinstance(config.get("max_position_embeddings"), int):
        settings["model_max_length"] = config["max_position_embeddings"]
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": settings}


# --- export: the directory ----------------------------------------------------------------


def _parse_size(size) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if match and match.group(2).upper() in _SIZE_UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    raise ValueError(
        f"export_hf_checkpoint: max_shard_size must be bytes or e.g. '5GB', got {size!r}"
    )


def _shards(units: list[_Unit], max_size: int) -> list[list[_Unit]]:
    shards: list[list[_Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes
    return shards


def _write_weights(tmp: str, units: list[_Unit], max_size: int) -> tuple[list[str], int]:
    shards = _shards(units, max_size)
    n = len(shards)
    names = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(os.path.join(tmp, name), shard, {"format": "pt"})
        weight_map.update({spec[0]: name for unit in shard for spec in unit.specs})
    total = sum(unit.nbytes for unit in units)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(os.path.join(tmp, INDEX_NAME), index)
    return names, total


def _read_json(path: str) -> dict:
    """The JSON object in `path` (strict JSON, as `_loads`); a ValueError naming it otherwise."""
    size = os.path.getsize(path)
    if size > _MAX_HEADER:
        raise ValueError(f"{path}: {size} bytes; a JSON config holds at most {_MAX_HEADER}")
    with open(path, "rb") as file:
        value = _loads(path, file.read(), "the file")
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(value, file, indent=2)
        file.write("\n")
        file.flush()
        fsync_fd(file.fileno())


def _check_target(directory: str, force: bool) -> None:
    """A folder holding weights needs `force`; one holding configs and a tokenizer does not."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"export_hf_checkpoint: {directory} exists and is not a directory")
    if not os.path.isdir(directory) or force:
        return
    weights = sorted(n for n in os.listdir(directory) if _replaced(n))
    if weights:
        raise FileExistsError(
            f"export_hf_checkpoint: {directory} is not empty: it holds weights {weights} "
            "(force=True replaces them; its other files, e.g. the tokenizer, are kept)"
        )


def _replaced(name: str) -> bool:
    """Whether an export replaces the file `name` as weights (config.json is merged, not)."""
    return name == QUANT_CONFIG_NAME or name.endswith(_WEIGHT_FILES)


def _carry_over(old: str, new: str) -> None:
    """Copies what `old` holds besides weights and the configs we write (tokenizer, ...)."""
    if not os.path.isdir(old):
        return
    for name in os.listdir(old):
        source, target = os.path.join(old, name), os.path.join(new, name)
        if name == CONFIG_NAME or _replaced(name) or os.path.lexists(target):
            continue  # (what the export wrote itself, e.g. tokenizer="bytes", wins)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True)
        else:
            shutil.copy2(source, target, follow_symlinks=False)


def _move_into_place(tmp: str, directory: str) -> None:
    """Renames the finished `tmp` to `directory`, replacing what was there."""
    parent = os.path.dirname(directory)
    if not os.path.lexists(directory) or not os.listdir(directory):
        os.replace(tmp, directory)  # atomic; replaces an empty directory
    else:
        old = os.path.join(parent, f".{os.path.basename(directory)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(directory, old)
        try:
            os.rename(tmp, directory)
        except BaseException:
            os.rename(old, directory)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(parent)


def _write_directory(directory: str, write: Callable[[str], Any]):
    """Runs `write(tmp)` in a temporary sibling of `directory`, then moves it into place."""
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)  # (not mkdtemp: the checkpoint keeps the umask's permissions)
    try:
        result = write(tmp)
        _carry_over(directory, tmp)
        fsync_path(tmp)
        _move_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _write_once(directory: str, write: Callable[[str], Any], units: list[_Unit]):
    """`_write_directory(directory, write)`, once, in a program of one or several processes.

    With several processes (all calling `export_hf_checkpoint` alike), process 0 writes; the
    others produce every unit in the same order, which takes part in the gathers of sharded
    arrays (collectives). If process 0 fails, it still produces the units it did not reach,
    so the gathers stay in step, and then every process raises its error.
    """
    if jax.process_count() == 1:
        return _write_directory(directory, write)
    produced = [0]
    counted = [_Unit(u.specs, _counting(u.produce, produced)) for u in units]
    done = None
    if jax.process_index() == 0:
        try:
            done = _write_directory(directory, lambda tmp: write(tmp, counted))
        except Exception as error:  # noqa: BLE001  (raised on every process below)
            done = error
    for unit in counted[produced[0] :]:
        unit.produce()
    if isinstance(done, Exception):
        failed = done

        def fail():
            raise failed

        collective(_EXPORT, "writing the checkpoint", fail, primary=True)
    files = collective(_EXPORT, "writing the checkpoint", lambda: done, primary=True)
    return files


def _counting(produce: Callable, produced: list) -> Callable:
    def counted():
        produced[0] += 1
        return produce()

    return counted


_EXPORT = "export_hf_checkpoint"


# --- export -------------------------------------------------------------------------------


def export_hf_checkpoint(
    directory: str | os.PathLike,
    params: Any,
    *,
    name_map: NameMap | Sequence | None = None,
    quant_algo: str = "NVFP4",
    input_amax: Mapping[str, Any] | None = None,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    config: Mapping[str, Any] | None = None,
    fused_groups: Sequence[Sequence[str]] = DEFAULT_FUSED_GROUPS,
    block_2d: bool = True,
    dtype=jnp.bfloat16,
    max_shard_size: int | str = "5GB",
    skip: Sequence[str] = (),
    force: bool = False,
    implementation: str | None = None,
    rules: Any = None,
    tokenizer: str | None = None,
) -> ExportReport:
    """Writes a Flax model as a ModelOpt NVFP4 Hugging Face checkpoint that engines load.

    Every linear (a `kernel` (in, out) the name map calls "linear") not excluded is quantized
    along `in` (`quantize(kernel, axis=0, block_2d=block_2d, amax=group amax)`) and written as
    `.weight` U8 (out, in/2), `.weight_scale` F8_E4M3 (out, in/16), `.weight_scale_2` F32 ()
    and, for W4A4, `.input_scale` F32 () (`f32(input_amax) * f32(1/2688)`). Members of a fused
    group (same parent module, names in one group of `fused_groups`) use the group's max
    weight amax and max input scale, so their scales are equal, as engines need. A kernel
    that already is an `NVFP4Array` (from `load_hf_checkpoint`, or quantized along axis 0) is
    written as it is, with its decode scale. Everything else is written in `dtype` under its
    HF name; excluded linears as `.weight` (out, in).

    The exporter follows the precision the model was trained in: given the model (or its
    `nnx.state`) holding `nvfp4_jax.nnx.Linear` layers, every other linear (a plain
    `nnx.Linear`, e.g. kept in bf16 by `quantize_model`'s rules) is written in high precision
    and listed in `ignore`; `rules=` (the `QuantizeReport` `quantize_model` returned, or its
    rules) decides instead. A fused group partly trained in high precision is written whole
    in high precision (the safe choice; engines need a group all quantized or all not), and
    reported in `ExportReport.group_high_precision`. A model with no `nvfp4_jax.nnx.Linear`
    (trained in bf16), and a plain pytree, are quantized whole (post-training).

    The directory is written into a temporary sibling and moved into place when complete.
    Tensors are converted, quantized and written one module at a time, so host memory stays
    at about one layer.

    Args:
      directory: the checkpoint directory to create (or, with `force`, replace).
      params: the weights: the nnx model itself, the whole `nnx.state(model)` (only
        `nnx.Param`s are weights; a variable named `input_amax` on a linear is its recorded
        activation amax; rng state is skipped), or a pytree of arrays (Flax params,
        `nnx.to_pure_dict`).
      name_map: a `NameMap` or a list of rules; default `llama_name_map()`.
      quant_algo: "NVFP4" (W4A4: weights and activations in NVFP4; needs input amaxes) or
        "W4A16_NVFP4" (weight-only: what Hopper and Ampere serve, through Marlin).
      input_amax: `{Flax module path or HF module name: activation amax}`, overriding what
        `params` holds (`input_amax` or `input_scale` leaves). W4A4 only.
      exclude: fnmatch patterns on HF module names kept in high precision and listed in
        `ignore`; a fused group is excluded whole or not at all.
      config: the model's HF config (a dict: architectures, hidden_size, num_attention_heads,
        num_key_value_heads, ...); default: the `config.json` already in `directory`. Its
        `quantization_config` is replaced.
      fused_groups: names of sibling linears engines fuse into one layer.
      block_2d: quantize weights in 16x16 blocks (the training recipe's; the forward pass of a
        model trained with `NVFP4Recipe()` sees these values), else 1x16.
      dtype: the dtype of every float tensor not quantized (None keeps each leaf's).
      max_shard_size: bytes (or "5GB", "500MiB") per safetensors file; above it the weights
        are split into `model-0000N-of-0000M.safetensors` with an index.
      skip: regexes of Flax paths to leave out (fullmatch).
      force: replace the weights of a directory that holds some (`*.safetensors`, an index,
        `hf_quant_config.json`, `*.bin`). Not needed for a directory holding only a config
        and tokenizer files (what `save_pretrained` leaves); its files besides weights and
        configs are kept either way, and its `config.json` is the default `config`.
      implementation: as in `quantize`.
      rules: which linears were trained in NVFP4: the `QuantizeReport` of
        `nvfp4_jax.quantize_model` (action "nvfp4": NVFP4; "high_precision", "skipped":
        high precision; "unmatched": as the model holds it), or the `Rule`s it was given
        (first match by module path, e.g. `layers/0/mlp/up_proj`; recipe None: high
        precision; no match: as the model holds it). Default: what `params` holds.
      tokenizer: None (write none; tokenizer files already in the folder are kept) or
        "bytes": write `tokenizer.json` and `tokenizer_config.json` of a byte-level tokenizer
        (token i is byte i, as in examples/lm_model.py), so that engines take text prompts.

    Returns:
      An `ExportReport`.

    Raises:
      ValueError: a leaf no rule maps, two leaves on one HF name, missing input amaxes for
        W4A4 (all named in one message), a fused group half excluded by `exclude=`, a kernel
        that cannot be quantized and is not excluded, a model config lacking what engines
        need, a `QuantizeReport` without a decision for a linear.
      TypeError: `rules` is neither a QuantizeReport nor a sequence of Rules.
      FileExistsError: `directory` holds weights and `force` is False.
    """
    if quant_algo not in QUANT_ALGOS:
        raise ValueError(
            f"export_hf_checkpoint: quant_algo must be one of {QUANT_ALGOS}, got {quant_algo!r}"
        )
    if input_amax and quant_algo != "NVFP4":
        raise ValueError("export_hf_checkpoint: input_amax is for quant_algo='NVFP4' (W4A4) only")
    directory = os.path.abspath(os.fspath(directory))
    max_size = _parse_size(max_shard_size)
    collective(
        _EXPORT, "checking the directory", lambda: _check_target(directory, force), primary=True
    )
    model_config = _model_config(config, directory)
    _check_tokenizer(tokenizer, model_config)
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    leaves = _collect_leaves(params, tuple(skip))
    tensors = _map_tensors(leaves, _as_name_map(name_map))
    if not tensors:
        raise ValueError("export_hf_checkpoint: params hold no weights")
    followed, decide = _decider(rules, leaves)
    groups = tuple(map(tuple, fused_groups))
    ignore = _plan_modules(tensors, tuple(exclude), groups, block_2d, decide)
    model_config = _check_config_against(model_config, tensors, dtype)
    scales = _input_scales(tensors, leaves, input_amax) if quant_algo == "NVFP4" else {}
    amaxes = _weight_amaxes(tensors, implementation)
    units = _units(tensors, amaxes, scales, block_2d, dtype, implementation)
    model_config["quantization_config"] = _quantization_config(quant_algo, ignore)

    def write(tmp: str, units: list[_Unit] = units):
        files, total = _write_weights(tmp, units, max_size)
        _write_json(os.path.join(tmp, CONFIG_NAME), model_config)
        _write_json(os.path.join(tmp, QUANT_CONFIG_NAME), _legacy_quant_config(quant_algo, ignore))
        if tokenizer == "bytes":
            for name, content in _byte_tokenizer(model_config).items():
                _write_json(os.path.join(tmp, name), content)
        return files, total

    files, total = _write_once(directory, write, units)
    quantized = tuple(t.module for t in tensors if t.quantized)
    return ExportReport(
        directory,
        quant_algo,
        quantized,
        tuple(ignore),
        tuple(files),
        total,
        tuple(leaves.skipped),
        followed,
        tuple(t.module for t in tensors if t.why == "trained"),
        tuple(t.module for t in tensors if t.why == "group"),
    )


# --- import -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Quant:
    """What a checkpoint's quantization config says."""

    algo: str
    weight_only: bool
    ignore: tuple[str, ...]

    @property
    def optional(self) -> set[str]:
        """Tensors a quantized linear may lack: `input_scale` when weight-only."""
        return {"input_scale"} if self.weight_only else set()


def _read_quant_config(directory: str, config: dict) -> _Quant | None:
    """The checkpoint's quantization, from config.json or hf_quant_config.json; None if none.

    Every field read is checked for its JSON type; errors name the file and the field.
    """
    raw = config.get("quantization_config")
    source, prefix = os.path.join(directory, CONFIG_NAME), "quantization_config"
    legacy_path = os.path.join(directory, QUANT_CONFIG_NAME)
    if raw is None and os.path.isfile(legacy_path):
        raw = {"quant_method": "modelopt", **_read_json(legacy_path)}
        source, prefix = legacy_path, ""
    if raw is None:
        return None
    _field(raw, dict, source, prefix or "the file")
    method = _field(raw.get("quant_method", ""), str, source, _join(prefix, "quant_method"))
    if not method.lower().startswith("modelopt"):
        raise ValueError(
            f"load_hf_checkpoint: {source} has quant_method {method!r}; only NVIDIA "
            "ModelOpt NVFP4 checkpoints (quant_method 'modelopt') are read"
        )
    if "quantization" in raw:
        prefix = _join(prefix, "quantization")
        inner = _field(raw["quantization"], dict, source, prefix)
    else:
        inner = raw
    name = inner.get("quant_algo", "")
    algo = _field(name, str, source, _join(prefix, "quant_algo")).upper()
    if algo not in QUANT_ALGOS:
        raise ValueError(
            f"load_hf_checkpoint: {source} has quant_algo {name!r}; only {QUANT_ALGOS} are read"
        )
    groups = _field(inner.get("config_groups") or {}, dict, source, _join(prefix, "config_groups"))
    for key, group in groups.items():
        where = _join(prefix, f"config_groups.{key}")
        _field(group, dict, source, where)
        for part in ("weights", "input_activations"):
            _field(group.get(part) or {}, dict, source, f"{where}.{part}")
    _check_group_size(source, prefix, inner)
    no_inputs = bool(groups) and all(g.get("input_activations") is None for g in groups.values())
    key = "ignore" if "ignore" in inner else "exclude_modules"
    ignore = inner.get(key) or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ValueError(
            f"load_hf_checkpoint: {source}: {_join(prefix, key)} must be a list of module "
            f"names (strings), got {_short(ignore)}"
        )
    return _Quant(algo, algo == "W4A16_NVFP4" or no_inputs, tuple(ignore))


_JSON_KINDS = {dict: "a JSON object", list: "a JSON list", str: "a string"}


def _field(value, kind: type, source: str, field: str):
    """`value` if it is of JSON type `kind`; else a ValueError naming the file and field."""
    if not isinstance(value, kind):
        raise ValueError(
            f"load_hf_checkpoint: {source}: {field} must be {_JSON_KINDS[kind]}, got "
            f"{_short(value)}"
        )
    return value


def _join(prefix: str, field: str) -> str:
    return f"{prefix}.{field}" if prefix else field


def _check_group_size(source: str, prefix: str, inner: dict) -> None:
    sizes = [("group_size", inner.get("group_size"))]
    for key, group in (inner.get("config_groups") or {}).items():
        for part in ("weights", "input_activations"):
            field = f"config_groups.{key}.{part}.group_size"
            sizes.append((field, (group.get(part) or {}).get("group_size")))
    for field, size in sizes:
        if size is not None and (type(size) is not int or size != formats.BLOCK_SIZE):
            raise ValueError(
                f"load_hf_checkpoint: {source}: {_join(prefix, field)} is {_short(size)}; "
                f"NVFP4 needs {formats.BLOCK_SIZE}"
            )


def _open_checkpoint(directory: str) -> dict[str, _SafetensorsFile]:
    """`{tensor name: its file}` over every top-level safetensors file (as engines load)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"load_hf_checkpoint: {directory} holds no *.safetensors file")
    owner: dict[str, _SafetensorsFile] = {}
    for name in names:
        file = _SafetensorsFile(os.path.join(directory, name))
        for tensor in file.entries:
            if tensor in owner:
                raise ValueError(
                    f"load_hf_checkpoint: {tensor} is in {owner[tensor].path} and {name}"
                )
            owner[tensor] = file
    _check_index(directory, owner)
    return owner


def _check_index(directory: str, owner: dict[str, _SafetensorsFile]) -> None:
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(path):
        return
    weight_map = _field(_read_json(path).get("weight_map"), dict, path, "weight_map")
    for name, file in weight_map.items():
        _field(file, str, path, f"weight_map[{name!r}]")
        if file in ("", ".", "..") or os.path.basename(file) != file or re.search(r"[/\\]", file):
            raise ValueError(
                f"load_hf_checkpoint: {path}: weight_map[{name!r}] is {_short(file)}, not a "
                "file name in the checkpoint's directory (no path separators, no '..')"
            )
    found = {name: os.path.basename(file.path) for name, file in owner.items()}
    if weight_map != found:
        diff = sorted(set(weight_map.items()) ^ set(found.items()))[:3]
        raise ValueError(f"load_hf_checkpoint: {INDEX_NAME} disagrees with the files: {diff}")


def _split_tensors(owner: dict, quant: _Quant | None) -> tuple[dict, list, list]:
    """Quantized modules (`{module: {suffix: name}}`), KV-cache scales and other tensors."""
    names = sorted(owner)
    quantized = {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}
    if quantized and quant is None:
        raise ValueError(
            "load_hf_checkpoint: NVFP4 tensors (weight_scale) but no quantization config"
        )
    modules: dict[str, dict[str, str]] = {m: {} for m in sorted(quantized)}
    kv, plain = [], []
    for name in names:
        module, _, suffix = name.rpartition(".")
        if module in modules and suffix in _QUANT_SUFFIXES:
            modules[module][suffix] = name
        elif suffix in _QUANT_SUFFIXES[2:]:
            raise ValueError(
                f"load_hf_checkpoint: {name} belongs to no NVFP4 linear (no {module}.weight_scale)"
            )
        elif suffix in _KV_SUFFIXES:
            kv.append(name)
        else:
            plain.append(name)
    return modules, kv, plain


def _spec(owner, name) -> _Entry:
    return owner[name].entries[name]


_EXPECTED = {
    "weight": "U8",
    "weight_scale": "F8_E4M3",
    "weight_scale_2": "F32",
    "input_scale": "F32",
}


def _check_quantized(module: str, parts: dict, owner: dict, quant: _Quant) -> None:
    """The tensors of one NVFP4 linear: all there, with the dtypes and shapes that fit."""
    required = {"weight", "weight_scale", "weight_scale_2"}
    missing = sorted(required - set(parts) | ({"input_scale"} - set(parts) - quant.optional))
    if missing:
        raise ValueError(
            f"load_hf_checkpoint: the NVFP4 linear {module} lacks {missing} ({quant.algo})"
        )
    if _engine_ignores(module, quant.ignore):
        raise ValueError(f"load_hf_checkpoint: {module} is stored in NVFP4 but listed in ignore")
    for suffix, name in parts.items():
        entry = _spec(owner, name)
        scalar = suffix in ("weight_scale_2", "input_scale")
        rank_ok = math.prod(entry.shape) == 1 if scalar else len(entry.shape) == 2
        if _ST_NAMES[entry.dtype] != _EXPECTED[suffix] or not rank_ok:
            raise ValueError(
                f"load_hf_checkpoint: {name} is {_ST_NAMES[entry.dtype]} {entry.shape}; "
                f"expected {_EXPECTED[suffix]} {'()' if scalar else '2-D'}"
            )
    weight, scales = (_spec(owner, parts[k]).shape for k in ("weight", "weight_scale"))
    if (2 * weight[1]) % formats.BLOCK_SIZE or scales != (weight[0], 2 * weight[1] // 16):
        raise ValueError(
            f"load_hf_checkpoint: {module}: weight {weight} and weight_scale {scales} disagree "
            "(need (out, in/2) and (out, in/16))"
        )
    # The exporter's rules: weight_scale_2 = amax / 2688 (0 for an all-zero kernel), and a
    # positive input_scale (engines divide by it).
    _checked_scalar(owner, parts["weight_scale_2"], zero_ok=True)
    if "input_scale" in parts:
        _checked_scalar(owner, parts["input_scale"], zero_ok=False)


class _BadTensor(ValueError):
    """A tensor whose values a checkpoint must not hold (raised while reading it)."""


def _checked_scalar(owner, name, *, zero_ok: bool) -> np.ndarray:
    """The float scalar `name` (one element), finite and > 0 (>= 0 with `zero_ok`)."""
    entry, path = _spec(owner, name), owner[name].path
    if not _is_float(entry.dtype) or math.prod(entry.shape) != 1:
        raise ValueError(
            f"load_hf_checkpoint: {name} ({path}) is {_ST_NAMES[entry.dtype]} {entry.shape}; "
            "expected a float scalar with one element"
        )
    value = _read_scalar(owner, name)
    if not np.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(
            f"load_hf_checkpoint: {name} ({path}) is {value}; it must be finite and "
            f"{'>= 0' if zero_ok else '> 0'}"
        )
    return value


def _check_block_scales(name: str, path: str) -> Callable[[np.ndarray], None]:
    """A check of E4M3 block scales as read: no NaN (0x7F, 0xFF), no sign bit.

    ModelOpt's scales are amaxes (>= +0); one comparison per byte, on the bytes read anyway.
    """

    def check(array: np.ndarray) -> None:
        if array.size and np.ascontiguousarray(array).view(np.uint8).max() >= 0x7F:
            raise _BadTensor(
                f"load_hf_checkpoint: {name} ({path}) holds NaN or negative block scales "
                "(E4M3 bytes 0x7F and above); ModelOpt writes none"
            )

    return check


# Places one array: (flax path, shape, dtype, read(index) -> numpy, transposed) -> Array;
# `transposed`: the stored (out, in) parts of an NVFP4 kernel (in, out).
_Place = Callable[..., jax.Array]


def _placer(sharding) -> _Place:
    if sharding is None:
        return lambda path, shape, dtype, read, transposed=False: jnp.asarray(read(None))

    def place(path, shape, dtype, read, transposed=False):
        if isinstance(sharding, jax.sharding.Sharding):
            target = _fit(sharding, shape, transposed)
        else:
            target = sharding(path, tuple(shape), np.dtype(dtype))
        try:
            return jax.make_array_from_callback(tuple(shape), target, read)
        except _BadTensor:
            raise
        except (ValueError, TypeError, IndexError) as error:
            raise ValueError(
                f"load_hf_checkpoint: cannot place {path} {tuple(shape)} on {target}: {error} "
                "(pass sharding= a function (flax path, shape, dtype) -> Sharding to choose "
                "each array's)"
            ) from error

    return place


def _fit(sharding: jax.sharding.Sharding, shape, transposed: bool = False):
    """The sharding of one array when one sharding is given for every array.

    A `NamedSharding`'s spec applies to the arrays of rank >= len(spec), as the Flax model
    sees them (the stored (out, in) codes and scales of an NVFP4 kernel (in, out) take its
    first two entries swapped); arrays of lower rank, scalars included, are replicated over
    its mesh. Other shardings are used as they are.
    """
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    if len(spec) > len(shape):
        spec = ()
    elif transposed:
        spec = (*spec, None, None)[:2][::-1]
    return sharding.update(spec=jax.sharding.PartitionSpec(*spec))


def _reader(owner, name, transpose=False, dtype=None, shape=None, check=None):
    """`read(index)` of tensor `name`: the (transposed, cast) array or its slice.

    `check` sees every slice, as stored, before it is returned.
    """
    file = owner[name]

    def read(index):
        source = None if index is None else (tuple(index)[::-1] if transpose else tuple(index))
        array = file.read(name, source)
        if check is not None:
            check(array)
        array = array.T if transpose else array
        array = array.reshape(shape) if shape is not None else array
        return array if dtype is None else array.astype(dtype, copy=False)

    return read


def _linear_path(name_map: NameMap, module: str, what: str) -> str:
    mapped = name_map.to_flax(f"{module}.weight", ndim=2)
    if mapped is None or mapped[1] != "linear":
        raise ValueError(f"load_hf_checkpoint: {what} {module} maps to no linear of the name map")
    return mapped[0]


def _load_quantized(module, parts, owner, name_map, dtype, place) -> dict[str, Any]:
    kernel = _linear_path(name_map, module, "the NVFP4 linear")
    parent = kernel.rpartition("/")[0]
    weight, scales = (_spec(owner, parts[k]) for k in ("weight", "weight_scale"))
    f32 = np.dtype(np.float32)
    # The codes and scales are stored (out, in/2), (out, in/16): one sharding for the whole
    # checkpoint applies to them as to the (in, out) kernel they hold (see `_fit`).
    read_codes = _reader(owner, parts["weight"])
    codes = place(f"{kernel}/codes", weight.shape, weight.dtype, read_codes, transposed=True)
    check = _check_block_scales(parts["weight_scale"], owner[parts["weight_scale"]].path)
    read_scales = _reader(owner, parts["weight_scale"], check=check)
    block = place(f"{kernel}/scales", scales.shape, scales.dtype, read_scales, transposed=True)
    d = place(f"{kernel}/decode_scale", (), f32, _reader(owner, parts["weight_scale_2"], shape=()))
    amax = place(
        f"{kernel}/amax",
        (),
        f32,
        lambda _: _read_scalar(owner, parts["weight_scale_2"]) * np.float32(2688),
    )
    q = NVFP4Array(codes, block, amax, jnp.dtype(dtype), -2, False, False, decode_scale=d)
    out = {kernel: validate_nvfp4_array(q, f"load_hf_checkpoint: {module}")}
    if "input_scale" in parts:
        out[f"{parent}/input_scale"] = place(
            f"{parent}/input_scale", (), f32, _reader(owner, parts["input_scale"], shape=())
        )
    return out


def _read_scalar(owner, name) -> np.ndarray:
    return owner[name].read(name).astype(np.float32).reshape(())


def _load_plain(name, owner, name_map, dtype, place) -> tuple[str, jax.Array]:
    entry = _spec(owner, name)
    mapped = name_map.to_flax(name, ndim=len(entry.shape))
    if mapped is None:
        raise ValueError(
            f"load_hf_checkpoint: the tensor {name} {entry.shape} matches no rule of the name "
            "map; pass name_map= with a rule for it"
        )
    path, kind = mapped
    if not _is_float(entry.dtype) and kind != "plain":
        raise ValueError(
            f"load_hf_checkpoint: {name} is {_ST_NAMES[entry.dtype]} without weight_scale"
        )
    target = np.dtype(dtype) if dtype is not None and _is_float(entry.dtype) else entry.dtype
    shape = entry.shape[::-1] if kind == "linear" else entry.shape
    read = _reader(owner, name, transpose=kind == "linear", dtype=target)
    return path, place(path, shape, target, read)


def _load_kv_scale(name, owner, name_map, place) -> tuple[str, jax.Array]:
    module, _, suffix = name.rpartition(".")
    parent = _linear_path(name_map, module, "the KV-cache scale of").rpartition("/")[0]
    path = f"{parent}/{suffix}"
    value = _checked_scalar(owner, name, zero_ok=False)
    return path, place(path, (), np.dtype(np.float32), lambda _: value)


def _nest(flat: dict[str, Any]) -> dict:
    """Nested dicts from "a/0/b" paths; all-digit components become int keys (nnx lists)."""
    tree: dict = {}
    for path, value in flat.items():
        keys = [int(k) if k.isdigit() else k for k in path.split("/")]
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"load_hf_checkpoint: {path} lies below another leaf")
        if keys[-1] in node:
            raise ValueError(f"load_hf_checkpoint: {path} is both a leaf and a parent")
        node[keys[-1]] = value
    return tree


def _config_dtype(config: dict):
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    try:
        return jnp.dtype(str(name).removeprefix("torch."))
    except TypeError:
        return jnp.dtype(jnp.bfloat16)


def load_hf_checkpoint(
    directory: str | os.PathLike,
    *,
    name_map: NameMap | Sequence | None = None,
    dtype=None,
    sharding: jax.sharding.Sharding | Callable | None = None,
) -> dict:
    """Reads a Hugging Face checkpoint (ModelOpt NVFP4, W4A4 or weight-only) into a Flax tree.

    The quantization comes from config.json's `quantization_config` or, without one, from
    `hf_quant_config.json`; a checkpoint with neither is read as plain weights. Every
    top-level `*.safetensors` file is read (checked against `model.safetensors.index.json`
    where present).

    A quantized linear `<m>` becomes, at the Flax path of `<m>.weight` (e.g.
    `layers/0/self_attn/q_proj/kernel`), `NVFP4Array(codes=<m>.weight, scales=
    <m>.weight_scale, amax=weight_scale_2 * 2688, dtype, axis=-2, block_2d=False, rht=False,
    decode_scale=weight_scale_2)`: the (in, out) kernel quantized along `in`, which
    `dequantize` decodes exactly as ModelOpt does (sign of zero aside). Its `input_scale`
    (f32 scalar) sits beside it as the leaf `input_scale`; FP8 KV-cache scales as `k_scale` /
    `v_scale`. Every other tensor becomes an array at its Flax path, transposed to (in, out)
    for a linear.

    Args:
      directory: the checkpoint directory.
      name_map: a `NameMap` or a list of rules; default `llama_name_map()`.
      dtype: cast float tensors not quantized to it, and the `dtype` an NVFP4Array records
        (default: the file's dtypes, and the config's `dtype`/`torch_dtype` or bfloat16).
      sharding: None (arrays on the default device), one `jax.sharding.Sharding` for every
        array, or a function `(flax path, shape, dtype) -> Sharding` (called for every
        array; an NVFP4Array's parts have the paths `<kernel>/codes`, `/scales`, `/amax`
        and `/decode_scale` and their stored shapes). One `NamedSharding` applies its
        `PartitionSpec` to every array of rank >= len(spec), as the Flax tree holds it (an
        (in, out) kernel, NVFP4 or not: the codes (out, in/2) and scales (out, in/16) of an
        NVFP4 kernel take the spec's two entries swapped, so both split at the same block
        boundaries); arrays of lower rank (norms under a 2-D spec, scalars) are replicated
        over its mesh. An array the spec cannot split (a dimension not divisible by its mesh
        axes) is a `ValueError` naming it: pass a function then. Arrays are built with
        `jax.make_array_from_callback`, so each process reads only the slices its devices
        hold.

    Returns:
      A nested dict (all-digit path components as int keys, like an nnx list's) for
      `nnx.update(model, tree)` or `nnx.merge`.

    Raises:
      ValueError: another quantization method or algorithm, a group size other than 16,
        missing or mis-shaped scales, an `input_scale` missing in a W4A4 checkpoint, a
        tensor no rule maps, an index that disagrees with the files; a malformed file,
        named with the tensor or field at fault: a safetensors header that is not strict
        JSON (UTF-8, no duplicate keys, nesting at most 64 deep) or whose entries do not
        fit (dtype, a shape of non-negative ints, offsets that match it, lie in the file
        and overlap no other tensor), a JSON config, index or field of the wrong type (an
        `ignore` that is not a list of strings, a `weight_map` file name with a path),
        scales that are NaN, infinite or negative (`weight_scale_2` may be 0, `input_scale`
        and KV-cache scales may not), block scales with E4M3 NaN or negative bytes. Nothing
        is allocated from a header's numbers before they are checked.
    """
    directory = os.path.abspath(os.fspath(directory))
    config_path = os.path.join(directory, CONFIG_NAME)
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    quant = _read_quant_config(directory, config)
    owner = _open_checkpoint(directory)
    modules, kv, plain = _split_tensors(owner, quant)
    name_map = _as_name_map(name_map)
    place = _placer(sharding)
    kernel_dtype = jnp.dtype(dtype) if dtype is not None else _config_dtype(config)
    flat: dict[str, Any] = {}
    for module, parts in modules.items():
        _check_quantized(module, parts, owner, quant)
        _add(flat, _load_quantized(module, parts, owner, name_map, kernel_dtype, place).items())
    _add(flat, [_load_kv_scale(name, owner, name_map, place) for name in kv])
    _add(flat, [_load_plain(name, owner, name_map, dtype, place) for name in plain])
    return _nest(flat)


def _add(flat: dict, items: Iterable[tuple[str, Any]]) -> None:
    for path, value in items:
        if path in flat:
            raise ValueError(f"load_hf_checkpoint: two tensors map to the Flax path {path!r}")
        flat[path] = value


__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_FUSED_GROUPS",
    "QUANT_ALGOS",
    "ExportReport",
    "NameMap",
    "NameRule",
    "export_hf_checkpoint",
    "llama_name_map",
    "load_hf_checkpoint",
    "read_safetensors",
]
