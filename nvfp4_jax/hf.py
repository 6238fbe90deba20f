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
from nvfp4_jax._storage import fsync_fd, fsync_path, is_key_array, key_name
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
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        raw = file.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(file.read(length))
        except ValueError as error:
            raise ValueError(f"{path}: the safetensors header is not JSON: {error}") from error
    metadata = header.pop("__metadata__", None) or {}
    entries = {name: _parse_entry(path, name, info) for name, info in header.items()}
    end = max((e.end for e in entries.values()), default=0)
    if 8 + length + end > size:
        raise ValueError(f"{path}: truncated ({size} bytes, the header needs {8 + length + end})")
    return entries, metadata, 8 + length


def _parse_entry(path: str, name: str, info: dict) -> _Entry:
    try:
        dtype = _ST_DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: tensor {name} has a bad or unsupported entry {info}") from error
    if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
        raise ValueError(f"{path}: tensor {name}: offsets {begin}..{end} do not fit {shape}")
    return _Entry(dtype, shape, begin, end)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a whole safetensors file into NumPy arrays, float8 and bfloat16 included.

    Args:
      path: a `.safetensors` file.

    Returns:
      `{tensor name: array}` with the file's dtypes (`ml_dtypes` for BF16 and F8_*) and
      shapes.

    Raises:
      ValueError: not a safetensors file, or an entry with an unsupported dtype or bad
        offsets (the message names the tensor).
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
    """

    directory: str
    quant_algo: str
    quantized: tuple[str, ...]
    excluded: tuple[str, ...]
    files: tuple[str, ...]
    total_size: int
    skipped: tuple[str, ...]


@dataclasses.dataclass
class _Leaves:
    weights: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_amax: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_scale: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)


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


def _plan_modules(tensors, exclude, fused_groups, block_2d) -> list[str]:
    """Marks excluded linears and fused groups; checks them; returns the `ignore` list."""
    ignore = set()
    for t in tensors:
        if t.kind in ("linear", "embedding"):
            module = t.hf.removesuffix(".weight")
            if any(module == p or fnmatch.fnmatchcase(module, p) for p in exclude):
                t.excluded = True
                ignore.add(module)
        if t.kind == "linear":
            t.group = _group_of(t.module, fused_groups)
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
    """`f32(amax) * f32(1/2688)` for an amax; an `input_scale` as it is."""
    value = np.asarray(value, np.float32)
    if value.size != 1:
        raise ValueError(
            f"export_hf_checkpoint: {kind} of {where} must be a scalar, got {value.shape}"
        )
    scale = value.reshape(()) * formats.RCP2688 if kind == "input_amax" else value.reshape(())
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"export_hf_checkpoint: {kind} of {where} is {value.reshape(())}; W4A4 needs a "
            "positive, finite activation amax (record it in calibration mode first)"
        )
    return np.float32(scale)


def _share_in_groups(tensors, scales: dict) -> dict[str, np.float32]:
    out = {}
    for members in _quantized_sets(tensors):
        missing = [t.module for t in members if t.module not in scales]
        if missing:
            raise ValueError(
                f"export_hf_checkpoint: no input amax for {missing}; W4A4 (quant_algo='NVFP4') "
                "needs one on every quantized linear (engines produce NaN without it): pass "
                "input_amax=, or record it, or export quant_algo='W4A16_NVFP4'"
            )
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
    amax = np.float32(tensor_amax(t.value, axis=0, implementation=implementation))
    if not np.isfinite(amax):
        raise ValueError(f"export_hf_checkpoint: the kernel of {t.module} holds NaN or inf")
    return amax


def _check_equal_scales(members) -> None:
    scales = {np.float32(t.value.global_scale).tobytes() for t in members}
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
        arrays = [q.codes, q.scales, np.float32(q.global_scale), input_scale]
        return {name: np.asarray(a) for (name, _, _), a in zip(specs, arrays, strict=False)}

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
        array = np.asarray(value).astype(target, copy=False)
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


def _read_json(path: str):
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(value, file, indent=2)
        file.write("\n")
        file.flush()
        fsync_fd(file.fileno())


def _check_target(directory: str, force: bool) -> None:
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"export_hf_checkpoint: {directory} exists and is not a directory")
    if os.path.isdir(directory) and os.listdir(directory) and not force:
        raise FileExistsError(
            f"export_hf_checkpoint: {directory} is not empty (force=True replaces it; its files "
            "other than weights and configs, e.g. the tokenizer, are kept)"
        )


def _carry_over(old: str, new: str) -> None:
    """Copies what `old` holds besides weights and the configs we write (tokenizer, ...)."""
    if not os.path.isdir(old):
        return
    for name in os.listdir(old):
        if name in (CONFIG_NAME, QUANT_CONFIG_NAME) or name.endswith(_WEIGHT_FILES):
            continue
        source, target = os.path.join(old, name), os.path.join(new, name)
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

    The directory is written into a temporary sibling and moved into place when complete.
    Tensors are converted, quantized and written one module at a time, so host memory stays
    at about one layer.

    Args:
      directory: the checkpoint directory to create (or, with `force`, replace).
      params: the weights: a pytree of arrays (Flax params, `nnx.to_pure_dict`) or the whole
        `nnx.state(model)` (only `nnx.Param`s are weights; a variable named `input_amax` on a
        linear is its recorded activation amax; rng state is skipped).
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
      force: replace an existing non-empty directory (files besides weights and configs,
        e.g. a tokenizer, are kept).
      implementation: as in `quantize`.

    Returns:
      An `ExportReport`.

    Raises:
      ValueError: a leaf no rule maps, two leaves on one HF name, a missing input amax for
        W4A4, a half-excluded fused group, a kernel that cannot be quantized and is not
        excluded, a model config lacking what engines need.
      FileExistsError: `directory` is not empty and `force` is False.
    """
    if quant_algo not in QUANT_ALGOS:
        raise ValueError(
            f"export_hf_checkpoint: quant_algo must be one of {QUANT_ALGOS}, got {quant_algo!r}"
        )
    if input_amax and quant_algo != "NVFP4":
        raise ValueError("export_hf_checkpoint: input_amax is for quant_algo='NVFP4' (W4A4) only")
    directory = os.path.abspath(os.fspath(directory))
    max_size = _parse_size(max_shard_size)
    _check_target(directory, force)
    model_config = _model_config(config, directory)
    leaves = _collect_leaves(params, tuple(skip))
    tensors = _map_tensors(leaves, _as_name_map(name_map))
    if not tensors:
        raise ValueError("export_hf_checkpoint: params hold no weights")
    ignore = _plan_modules(tensors, tuple(exclude), tuple(map(tuple, fused_groups)), block_2d)
    model_config = _check_config_against(model_config, tensors, dtype)
    scales = _input_scales(tensors, leaves, input_amax) if quant_algo == "NVFP4" else {}
    amaxes = _weight_amaxes(tensors, implementation)
    units = _units(tensors, amaxes, scales, block_2d, dtype, implementation)
    model_config["quantization_config"] = _quantization_config(quant_algo, ignore)

    def write(tmp: str):
        files, total = _write_weights(tmp, units, max_size)
        _write_json(os.path.join(tmp, CONFIG_NAME), model_config)
        _write_json(os.path.join(tmp, QUANT_CONFIG_NAME), _legacy_quant_config(quant_algo, ignore))
        return files, total

    files, total = _write_directory(directory, write)
    quantized = tuple(t.module for t in tensors if t.quantized)
    return ExportReport(
        directory, quant_algo, quantized, tuple(ignore), tuple(files), total, tuple(leaves.skipped)
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
    """The checkpoint's quantization, from config.json or hf_quant_config.json; None if none."""
    raw = config.get("quantization_config")
    legacy_path = os.path.join(directory, QUANT_CONFIG_NAME)
    if raw is None and os.path.isfile(legacy_path):
        raw = {"quant_method": "modelopt", **_read_json(legacy_path)}
    if raw is None:
        return None
    method = str(raw.get("quant_method", ""))
    if not method.lower().startswith("modelopt"):
        raise ValueError(
            f"load_hf_checkpoint: {directory} has quant_method {method!r}; only NVIDIA "
            "ModelOpt NVFP4 checkpoints (quant_method 'modelopt') are read"
        )
    inner = raw.get("quantization", raw)
    algo = str(inner.get("quant_algo", "")).upper()
    if algo not in QUANT_ALGOS:
        raise ValueError(
            f"load_hf_checkpoint: {directory} has quant_algo {inner.get('quant_algo')!r}; "
            f"only {QUANT_ALGOS} are read"
        )
    _check_group_size(directory, inner)
    groups = inner.get("config_groups") or {}
    no_inputs = bool(groups) and all(g.get("input_activations") is None for g in groups.values())
    ignore = inner.get("ignore", inner.get("exclude_modules")) or []
    return _Quant(algo, algo == "W4A16_NVFP4" or no_inputs, tuple(ignore))


def _check_group_size(directory: str, inner: dict) -> None:
    sizes = [inner.get("group_size")]
    for group in (inner.get("config_groups") or {}).values():
        sizes += [
            (group.get(part) or {}).get("group_size") for part in ("weights", "input_activations")
        ]
    bad = [s for s in sizes if s is not None and s != formats.BLOCK_SIZE]
    if bad:
        raise ValueError(f"load_hf_checkpoint: {directory} has group_size {bad[0]}; NVFP4 needs 16")


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
    weight_map = _read_json(path).get("weight_map", {})
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


# A function that places one array: (flax path, shape, dtype, read(index) -> numpy) -> Array.
_Place = Callable[[str, tuple, np.dtype, Callable[[tuple | None], np.ndarray]], jax.Array]


def _placer(sharding) -> _Place:
    if sharding is None:
        return lambda path, shape, dtype, read: jnp.asarray(read(None))

    def place(path, shape, dtype, read):
        if isinstance(sharding, jax.sharding.Sharding):
            target = _fit(sharding, shape)
        else:
            target = sharding(path, tuple(shape), np.dtype(dtype))
        try:
            return jax.make_array_from_callback(tuple(shape), target, read)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"load_hf_checkpoint: cannot place {path} {shape} on {target}: {error}"
            ) from error

    return place


def _fit(sharding: jax.sharding.Sharding, shape) -> jax.sharding.Sharding:
    """A single sharding for every array: scalars are replicated over its mesh."""
    if not shape and isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def _reader(owner, name, transpose=False, dtype=None, shape=None):
    """`read(index)` of tensor `name`: the (transposed, cast) array or its slice."""
    file = owner[name]

    def read(index):
        source = None if index is None else (tuple(index)[::-1] if transpose else tuple(index))
        array = file.read(name, source)
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
    codes = place(f"{kernel}/codes", weight.shape, weight.dtype, _reader(owner, parts["weight"]))
    block = place(
        f"{kernel}/scales", scales.shape, scales.dtype, _reader(owner, parts["weight_scale"])
    )
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
    return path, place(path, (), np.dtype(np.float32), lambda _: _read_scalar(owner, name))


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
        array (scalars replicated over its mesh), or a function `(flax path, shape, dtype)
        -> Sharding` (called for every array; an NVFP4Array's parts have the paths
        `<kernel>/codes`, `/scales`, `/amax` and `/decode_scale` and their stored shapes).
        Arrays are built with `jax.make_array_from_callback`, so each process reads only
        the slices its devices hold.

    Returns:
      A nested dict (all-digit path components as int keys, like an nnx list's) for
      `nnx.update(model, tree)` or `nnx.merge`.

    Raises:
      ValueError: another quantization method or algorithm, a group size other than 16,
        missing or mis-shaped scales, an `input_scale` missing in a W4A4 checkpoint, a
        tensor no rule maps, an index that disagrees with the files.
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
