"""Import: a ModelOpt NVFP4 (or plain) Hugging Face checkpoint as a Flax tree.

`load_hf_checkpoint` reads the quantization config (every field checked for its JSON type),
opens every safetensors file and checks them against the index, checks the tensors of each
NVFP4 linear (dtypes, shapes, scale values), gathers the experts of a mixture-of-experts
layer into one stacked array (all experts present, their shapes equal), and places every
array with `jax.make_array_from_callback`, so each process reads only the slices its devices
hold.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.array import NVFP4Array, validate_nvfp4_array
from nvfp4_jax._src.io.hf.common import (
    _KV_SUFFIXES,
    _QUANT_SUFFIXES,
    CONFIG_NAME,
    INDEX_NAME,
    QUANT_ALGOS,
    QUANT_CONFIG_NAME,
    _read_json,
    _short,
)
from nvfp4_jax._src.io.hf.names import NameMap, _as_name_map, _engine_ignores, _expert_block
from nvfp4_jax._src.io.hf.st_io import _ST_NAMES, _Entry, _is_float, _SafetensorsFile

# --- import: the quantization config ------------------------------------------------------


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


# --- import: the files and their tensors --------------------------------------------------


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


# --- import: placing the arrays -----------------------------------------------------------

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
    entries for the last two axes swapped, (E, out, in) those of a stacked (E, in, out)
    one); arrays of lower rank, scalars included, are replicated over its mesh. Other
    shardings are used as they are.
    """
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    if len(spec) > len(shape):
        spec = ()
    elif transposed:
        spec = (*spec, *(None,) * (len(shape) - len(spec)))
        spec = (*spec[:-2], spec[-1], spec[-2])
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


# --- import -------------------------------------------------------------------------------


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


def _plain_path(name, owner, name_map) -> tuple[str, str, int | None]:
    """(Flax path, kind, expert index) of the tensor `name` stored without weight_scale."""
    entry = _spec(owner, name)
    mapped = name_map._match_hf(name, len(entry.shape))
    if mapped is None:
        raise ValueError(
            f"load_hf_checkpoint: the tensor {name} {entry.shape} matches no rule of the name "
            "map; pass name_map= with a rule for it"
        )
    if not _is_float(entry.dtype) and mapped[1] != "plain":
        raise ValueError(
            f"load_hf_checkpoint: {name} is {_ST_NAMES[entry.dtype]} without weight_scale"
        )
    return mapped


def _load_plain(name, path, kind, owner, dtype, place) -> tuple[str, jax.Array]:
    entry = _spec(owner, name)
    target = np.dtype(dtype) if dtype is not None and _is_float(entry.dtype) else entry.dtype
    transpose = kind in ("linear", "router")
    shape = entry.shape[::-1] if transpose else entry.shape
    read = _reader(owner, name, transpose=transpose, dtype=target)
    return path, place(path, shape, target, read)


# --- import: mixture-of-experts layers ----------------------------------------------------


@dataclasses.dataclass
class _Stack:
    """The experts of one stacked Flax kernel as found: expert -> (HF module, tensors, NVFP4).

    The tensors are a quantized expert's `{suffix: tensor name}`, or `{"weight": name}` for
    one stored in high precision.
    """

    path: str
    block: str
    experts: dict[int, tuple[str, dict[str, str], bool]] = dataclasses.field(default_factory=dict)


def _expert_count(config: dict) -> int | None:
    """The config's expert count (`num_experts`, or `num_local_experts`), None if it has none."""
    for key in ("num_experts", "num_local_experts"):
        if key in config:
            value = config[key]
            if type(value) is not int or value < 1:
                raise ValueError(
                    f"load_hf_checkpoint: {CONFIG_NAME}: {key} must be a positive integer (the "
                    f"experts per MoE layer), got {_short(value)}"
                )
            return value
    return None


def _first_missing(present: dict, expected: int, limit: int = 10) -> list[int]:
    """Up to `limit` indices below `expected` not in `present` (a bounded search)."""
    missing = []
    for e in range(expected):  # at most len(present) + limit steps
        if e not in present:
            missing.append(e)
            if len(missing) == limit:
                break
    return missing


def _check_stack(stack: _Stack, owner, count: int | None) -> tuple[int, bool]:
    """(E, quantized) of a stack: experts 0..E-1 all there, all stored alike, equal shapes."""
    found = sorted(stack.experts)
    expected = count if count is not None else found[-1] + 1
    missing = _first_missing(stack.experts, expected)
    extra = [e for e in found if e >= expected]
    example = stack.experts[found[0]][0]
    if missing or extra:
        source = "the config says" if count is not None else "the highest index found implies"
        absent = expected - (len(found) - len(extra))
        more = f" ({absent} in all)" if absent > len(missing) else ""
        problems = [f"experts {missing} are missing{more}"] if missing else []
        problems += [f"experts {extra} lie beyond them"] if extra else []
        raise ValueError(
            f"load_hf_checkpoint: the experts of {stack.path} (HF {stack.block}) are "
            f"incomplete: {source} {expected} experts, and {' and '.join(problems)} (found "
            f"e.g. {example}); a checkpoint must hold every expert of every MoE layer"
        )
    nvfp4 = [e for e in found if stack.experts[e][2]]
    if nvfp4 and len(nvfp4) != len(found):
        raise ValueError(
            f"load_hf_checkpoint: the experts of {stack.path} (HF {stack.block}) are stored "
            f"partly in NVFP4 (experts {nvfp4}) and partly not; engines load an MoE layer "
            "all quantized or all not"
        )
    first_module, first, _ = stack.experts[0]
    for e in range(1, expected):
        module, parts, _ = stack.experts[e]
        if set(parts) != set(first):
            raise ValueError(
                f"load_hf_checkpoint: {first_module} holds {sorted(first)}, {module} holds "
                f"{sorted(parts)}; every expert of {stack.path} must hold the same tensors"
            )
        for suffix in ("weight", "weight_scale"):
            if suffix not in parts:
                continue
            a, b = (_spec(owner, p[suffix]) for p in (first, parts))
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"load_hf_checkpoint: the experts of {stack.path} disagree: "
                    f"{first[suffix]} is {_ST_NAMES[a.dtype]} {a.shape}, "
                    f"{parts[suffix]} is {_ST_NAMES[b.dtype]} {b.shape}; one MoE layer's "
                    "experts must have equal shapes"
                )
    return expected, bool(nvfp4)


def _stacked_reader(readers: list[Callable], shape: tuple[int, ...], dtype) -> Callable:
    """`read(index)` of the stack (E, *shape) from one reader per expert."""

    def read(index):
        if index is None:
            return np.stack([reader(None) for reader in readers])
        first, rest = index[0], tuple(index[1:])
        chosen = [readers[e] for e in range(len(readers))[first]]
        if not chosen:
            sizes = (len(range(n)[part]) for n, part in zip(shape, rest, strict=False))
            return np.empty((0, *sizes), dtype)
        return np.stack([reader(rest) for reader in chosen])

    return read


def _vector(values: np.ndarray) -> Callable:
    return lambda index: values if index is None else values[tuple(index)]


def _load_stack(stack: _Stack, owner, count, quantized, kernel_dtype, dtype, place) -> dict:
    """One stacked array (E, in, out) from its experts' tensors: an NVFP4Array or floats."""
    experts = [stack.experts[e][1] for e in range(count)]
    if not quantized:
        names = [parts["weight"] for parts in experts]
        entry = _spec(owner, names[0])
        target = np.dtype(dtype) if dtype is not None else entry.dtype
        shape = entry.shape[::-1]
        readers = [_reader(owner, n, transpose=True, dtype=target) for n in names]
        read = _stacked_reader(readers, shape, target)
        return {stack.path: place(stack.path, (count, *shape), target, read)}
    kernel, parent = stack.path, stack.path.rpartition("/")[0]
    f32 = np.dtype(np.float32)
    arrays = {}
    for suffix, leaf in (("weight", "codes"), ("weight_scale", "scales")):
        names = [parts[suffix] for parts in experts]
        entry = _spec(owner, names[0])
        readers = [
            _reader(owner, n, check=_check_block_scales(n, owner[n].path))
            if suffix == "weight_scale"
            else _reader(owner, n)
            for n in names
        ]
        read = _stacked_reader(readers, entry.shape, entry.dtype)
        shape = (count, *entry.shape)
        arrays[leaf] = place(f"{kernel}/{leaf}", shape, entry.dtype, read, transposed=True)
    ws2 = np.array([_read_scalar(owner, parts["weight_scale_2"]) for parts in experts], f32)
    d = place(f"{kernel}/decode_scale", (count,), f32, _vector(ws2))
    amax = place(f"{kernel}/amax", (count,), f32, _vector(ws2 * np.float32(2688)))
    dtype = jnp.dtype(kernel_dtype)
    q = NVFP4Array(arrays["codes"], arrays["scales"], amax, dtype, -2, False, False, d)
    out = {kernel: validate_nvfp4_array(q, f"load_hf_checkpoint: {stack.block} ({kernel})")}
    if "input_scale" in experts[0]:
        scales = np.array([_read_scalar(owner, parts["input_scale"]) for parts in experts], f32)
        path = f"{parent}/input_scale"
        out[path] = place(path, (count,), f32, _vector(scales))
    return out


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
        keys = [int(k) if _is_index(k) else k for k in path.split("/")]
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"load_hf_checkpoint: {path} lies below another leaf")
        if keys[-1] in node:
            raise ValueError(f"load_hf_checkpoint: {path} is both a leaf and a parent")
        node[keys[-1]] = value
    return tree


def _is_index(key: str) -> bool:
    """An all-digit path component: an int key (ASCII digits, not too long for `int`)."""
    return key.isascii() and key.isdigit() and len(key) <= 18


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
    for a linear (and for an MoE router, kind "router").

    Mixture-of-experts layers (a name map with "experts" rules: `qwen3_moe_name_map()`,
    `mixtral_name_map()`): the E linears `...experts.{e}.<proj>` of one projection become
    one stacked array at the stacked kernel's Flax path (e.g.
    `layers/0/mlp/experts/gate_proj/kernel`, as `nvfp4_jax.nnx.Experts` holds it): an
    `NVFP4Array` of logical shape (E, in, out) with codes (E, out, in/2), scales
    (E, out, in/16), `amax` and `decode_scale` (E,) (expert e's `weight_scale_2`), bit for
    bit the file's, so each expert dequantizes as ModelOpt decodes it; or, stored in high
    precision, a float array (E, in, out). Every expert 0..E-1 must be there (E: the
    config's `num_experts` / `num_local_experts`, else the highest index + 1), all stored
    alike with equal shapes. The leaf `input_scale` beside it holds each expert's stored
    value, shape (E,). ModelOpt writes one value on all of them (M4); a foreign checkpoint's
    may differ, and engines then reduce them differently: vLLM's FlashInfer and emulation
    backends and SGLang's FlashInfer ones quantize every expert's activations with the
    maximum over the experts (and over gate and up), other backends per expert. The
    per-expert values are kept; `export_hf_checkpoint` writes back the maximum (FlashInfer's
    choice, the one that clips no expert's calibrated range).

    Args:
      directory: the checkpoint directory.
      name_map: a `NameMap` or a list of rules; default `llama_name_map()` (for MoE models
        `qwen3_moe_name_map()` or `mixtral_name_map()`).
      dtype: cast float tensors not quantized to it, and the `dtype` an NVFP4Array records
        (default: the file's dtypes, and the config's `dtype`/`torch_dtype` or bfloat16).
      sharding: None (arrays on the default device), one `jax.sharding.Sharding` for every
        array, or a function `(flax path, shape, dtype) -> Sharding` (called for every
        array; an NVFP4Array's parts have the paths `<kernel>/codes`, `/scales`, `/amax`
        and `/decode_scale` and their stored shapes, (E, out, in/2) etc. for experts). One
        `NamedSharding` applies its
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
        and KV-cache scales may not), block scales with E4M3 NaN or negative bytes. For
        mixture-of-experts layers: missing experts (named), experts of one projection
        stored with different shapes, dtypes or tensors, or partly in NVFP4, an expert
        count in the config that is not a positive integer, a router (kind "router")
        stored in NVFP4, NVFP4 experts whose MoE block `ignore` names. Nothing is
        allocated from a header's numbers before they are checked.
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
    stacks: dict[str, _Stack] = {}
    for module, parts in modules.items():
        _check_quantized(module, parts, owner, quant)
        path, kind, expert = name_map._match_hf(f"{module}.weight", 2) or ("", "", None)
        if kind == "experts":
            block = _add_expert(stacks, name_map, path, expert, module, parts, True)
            if _engine_ignores(block, quant.ignore):
                raise ValueError(
                    f"load_hf_checkpoint: {module} is stored in NVFP4 but its MoE block "
                    f"{block} is listed in ignore (engines would build the block unquantized)"
                )
        elif kind == "router":
            raise ValueError(
                f"load_hf_checkpoint: the router {module} is stored in NVFP4; engines serve "
                "an MoE router in high precision only (as a float .weight named in ignore)"
            )
        else:
            loaded = _load_quantized(module, parts, owner, name_map, kernel_dtype, place)
            _add(flat, loaded.items())
    _add(flat, [_load_kv_scale(name, owner, name_map, place) for name in kv])
    for name in plain:
        path, kind, expert = _plain_path(name, owner, name_map)
        if kind == "experts":
            module = name.removesuffix(".weight")
            _add_expert(stacks, name_map, path, expert, module, {"weight": name}, False)
        else:
            _add(flat, [_load_plain(name, path, kind, owner, dtype, place)])
    count = _expert_count(config) if stacks else None
    for stack in stacks.values():
        experts, quantized = _check_stack(stack, owner, count)
        loaded = _load_stack(stack, owner, experts, quantized, kernel_dtype, dtype, place)
        _add(flat, loaded.items())
    return _nest(flat)


def _add_expert(stacks, name_map, path, expert, module, parts, quantized) -> str:
    """Files expert `expert` of the stack at `path`; returns the stack's HF block name."""
    if path not in stacks:
        stacks[path] = _Stack(path, _expert_block(name_map.to_hf(path)[0]))
    stacks[path].experts[expert] = (module, parts, quantized)
    return stacks[path].block


def _add(flat: dict, items: Iterable[tuple[str, Any]]) -> None:
    for path, value in items:
        if path in flat:
            raise ValueError(f"load_hf_checkpoint: two tensors map to the Flax path {path!r}")
        flat[path] = value
