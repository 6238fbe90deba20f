"""Import: a ModelOpt NVFP4 (or plain) Hugging Face checkpoint as a Flax tree.

`load_hf_checkpoint` reads the quantization config (every field checked for its JSON type),
opens every safetensors file and checks them against the index, checks the tensors of each
NVFP4 linear (dtypes, shapes, scale values), and places every array with
`jax.make_array_from_callback`, so each process reads only the slices its devices hold.
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

from nvfp4_jax import formats
from nvfp4_jax.array import NVFP4Array, validate_nvfp4_array
from nvfp4_jax.hf.common import (
    _KV_SUFFIXES,
    _QUANT_SUFFIXES,
    CONFIG_NAME,
    INDEX_NAME,
    QUANT_ALGOS,
    QUANT_CONFIG_NAME,
    _read_json,
    _short,
)
from nvfp4_jax.hf.names import NameMap, _as_name_map, _engine_ignores
from nvfp4_jax.hf.st_io import _ST_NAMES, _Entry, _is_float, _SafetensorsFile

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
