"""Import: a ModelOpt NVFP4 (or plain) Hugging Face checkpoint as a Flax tree.

`load_hf_checkpoint` reads the quantization config (`config`), opens every safetensors
file and checks them against the index, checks the tensors of each NVFP4 linear
(`files`), gathers the experts of a mixture-of-experts layer into one stacked array
(`experts`), and places every array with `jax.make_array_from_callback`, so each
process reads only the slices its devices hold (`place`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core.array import NVFP4Array, validate_nvfp4_array
from nvfp4_jax._src.io.hf.format import (
    CONFIG_NAME,
    read_json,
)
from nvfp4_jax._src.io.hf.load.config import (
    config_dtype,
    expert_count,
    read_quant_config,
)
from nvfp4_jax._src.io.hf.load.experts import Stack, add_expert, check_stack, load_stack
from nvfp4_jax._src.io.hf.load.files import (
    check_block_scales,
    check_quantized,
    checked_scalar,
    entry_of,
    open_checkpoint,
    read_scalar,
    split_tensors,
)
from nvfp4_jax._src.io.hf.load.place import placer, reader
from nvfp4_jax._src.io.hf.names import NameMap, as_name_map, engine_ignores, match_hf
from nvfp4_jax._src.io.hf.safetensors_files import ST_NAMES, is_float


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
    config = read_json(config_path) if os.path.isfile(config_path) else {}
    quant = read_quant_config(directory, config)
    owner = open_checkpoint(directory)
    modules, kv, plain = split_tensors(owner, quant)
    name_map = as_name_map(name_map)
    place = placer(sharding)
    kernel_dtype = jnp.dtype(dtype) if dtype is not None else config_dtype(config)
    flat: dict[str, Any] = {}
    stacks: dict[str, Stack] = {}
    for module, parts in modules.items():
        check_quantized(module, parts, owner, quant)
        path, kind, expert = match_hf(name_map, f"{module}.weight", 2) or ("", "", None)
        if kind == "experts":
            block = add_expert(stacks, name_map, path, expert, module, parts, True)
            if engine_ignores(block, quant.ignore):
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
            add_expert(stacks, name_map, path, expert, module, {"weight": name}, False)
        else:
            _add(flat, [_load_plain(name, path, kind, owner, dtype, place)])
    count = expert_count(config) if stacks else None
    for stack in stacks.values():
        experts, quantized = check_stack(stack, owner, count)
        loaded = load_stack(stack, owner, experts, quantized, kernel_dtype, dtype, place)
        _add(flat, loaded.items())
    return _nest(flat)


def _linear_path(name_map: NameMap, module: str, what: str) -> str:
    mapped = name_map.to_flax(f"{module}.weight", ndim=2)
    if mapped is None or mapped[1] != "linear":
        raise ValueError(f"load_hf_checkpoint: {what} {module} maps to no linear of the name map")
    return mapped[0]


def _load_quantized(module, parts, owner, name_map, dtype, place) -> dict[str, Any]:
    kernel = _linear_path(name_map, module, "the NVFP4 linear")
    parent = kernel.rpartition("/")[0]
    weight, scales = (entry_of(owner, parts[k]) for k in ("weight", "weight_scale"))
    f32 = np.dtype(np.float32)
    # The codes and scales are stored (out, in/2), (out, in/16): one sharding for the whole
    # checkpoint applies to them as to the (in, out) kernel they hold (see `_fit`).
    read_codes = reader(owner, parts["weight"])
    codes = place(f"{kernel}/codes", weight.shape, weight.dtype, read_codes, transposed=True)
    check = check_block_scales(parts["weight_scale"], owner[parts["weight_scale"]].path)
    read_scales = reader(owner, parts["weight_scale"], check=check)
    block = place(f"{kernel}/scales", scales.shape, scales.dtype, read_scales, transposed=True)
    d = place(f"{kernel}/decode_scale", (), f32, reader(owner, parts["weight_scale_2"], shape=()))
    amax = place(
        f"{kernel}/amax",
        (),
        f32,
        lambda _: read_scalar(owner, parts["weight_scale_2"]) * np.float32(2688),
    )
    q = NVFP4Array(codes, block, amax, jnp.dtype(dtype), -2, False, False, decode_scale=d)
    out = {kernel: validate_nvfp4_array(q, f"load_hf_checkpoint: {module}")}
    if "input_scale" in parts:
        out[f"{parent}/input_scale"] = place(
            f"{parent}/input_scale", (), f32, reader(owner, parts["input_scale"], shape=())
        )
    return out


def _plain_path(name, owner, name_map) -> tuple[str, str, int | None]:
    """(Flax path, kind, expert index) of the tensor `name` stored without weight_scale."""
    entry = entry_of(owner, name)
    mapped = match_hf(name_map, name, len(entry.shape))
    if mapped is None:
        raise ValueError(
            f"load_hf_checkpoint: the tensor {name} {entry.shape} matches no rule of the name "
            "map; pass name_map= with a rule for it"
        )
    if not is_float(entry.dtype) and mapped[1] != "plain":
        raise ValueError(
            f"load_hf_checkpoint: {name} is {ST_NAMES[entry.dtype]} without weight_scale"
        )
    return mapped


def _load_plain(name, path, kind, owner, dtype, place) -> tuple[str, jax.Array]:
    entry = entry_of(owner, name)
    target = np.dtype(dtype) if dtype is not None and is_float(entry.dtype) else entry.dtype
    transpose = kind in ("linear", "router")
    shape = entry.shape[::-1] if transpose else entry.shape
    read = reader(owner, name, transpose=transpose, dtype=target)
    return path, place(path, shape, target, read)


def _load_kv_scale(name, owner, name_map, place) -> tuple[str, jax.Array]:
    module, _, suffix = name.rpartition(".")
    parent = _linear_path(name_map, module, "the KV-cache scale of").rpartition("/")[0]
    path = f"{parent}/{suffix}"
    value = checked_scalar(owner, name, zero_ok=False)
    return path, place(path, (), np.dtype(np.float32), lambda _: value)


def _add(flat: dict, items: Iterable[tuple[str, Any]]) -> None:
    for path, value in items:
        if path in flat:
            raise ValueError(f"load_hf_checkpoint: two tensors map to the Flax path {path!r}")
        flat[path] = value


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
