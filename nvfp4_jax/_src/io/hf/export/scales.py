"""Export: the scales of the quantized linears, shared as engines need them.

`input_scales` (W4A4) gives every quantized linear its `input_scale` from the recorded input
amaxes or scales (or `input_amax=`), the maximum over its set: a fused group, or one
projection kind of an MoE block over all its experts (M4). `weight_amaxes` gives every float
kernel the amax it is quantized with, its fused group's maximum; NVFP4 kernels keep theirs,
once their scales are checked to be ones `load_hf_checkpoint` reads back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.array import is_nvfp4_array
from nvfp4_jax._src.core.multihost import to_host
from nvfp4_jax._src.core.ops import tensor_amax
from nvfp4_jax._src.io.hf.export.plan import (
    compact,
    quantized_sets,
)
from nvfp4_jax._src.io.hf.export.tensors import Leaves, Tensor
from nvfp4_jax._src.io.hf.format import FIRST_BAD_SCALE_BYTE


def input_scales(tensors, leaves: Leaves, input_amax) -> dict[str, np.float32]:
    """The `input_scale` of every quantized linear (W4A4); members of a set share the max.

    Sources: `input_scale` leaves (written as they are: a layer built from a checkpoint keeps
    its scale bit for bit), else `input_amax` leaves (times f32(1/2688)); the `input_amax`
    argument wins over both. Excluded linears' are ignored. A stacked experts layer's source
    is a scalar or one value per expert, (E,) (`nvfp4_jax.nnx.Experts.input_amax`, the
    `input_scale` `load_hf_checkpoint` gives); `input_amax=` may also name one expert by its
    HF module name. The sets (`_scale_sets`): each fused group; each projection kind of an
    MoE block over all its experts (gate and up together, M4); each other linear alone.
    """
    plain = [t for t in tensors if t.kind in ("linear", "router")]
    by_name = {t.module: t.module for t in plain} | {t.flax_module: t.module for t in plain}
    stacks: dict[str, list[Tensor]] = {}
    for t in tensors:
        if t.kind == "experts":
            stacks.setdefault(t.flax_module, []).append(t)
            by_name[t.module] = t.module
    quantized = {t.module for t in tensors if t.quantized}
    found: dict[str, tuple[str, Any, str]] = {}
    for kind, values in (("input_scale", leaves.input_scale), ("input_amax", leaves.input_amax)):
        for path, (where, value) in values.items():
            module = path if path in stacks else _module_for(by_name, path, where)
            found.setdefault(module, (kind, value, where))  # an input_scale leaf comes first
    for key, amax in (input_amax or {}).items():
        module = key if key in stacks else _module_for(by_name, key, f"input_amax[{key!r}]")
        found[module] = ("input_amax", amax, f"input_amax[{key!r}]")
    scales = {}
    for path, members in stacks.items():
        if path in found:
            per_expert = _to_expert_scales(*found[path], len(members))
            scales.update({t.module: per_expert[t.expert] for t in members})
    for module, (kind, value, where) in found.items():
        if module in quantized:
            scales[module] = _to_input_scale(value, kind, where)
    return _share_in_groups(tensors, {m: v for m, v in scales.items() if m in quantized})


def _module_for(by_name: dict, key: str, where: str) -> str:
    if key not in by_name:
        raise ValueError(
            f"export_hf_checkpoint: {where} names {key!r}, which is no linear of the model "
            "(give a Flax module path such as 'layers/0/self_attn/q_proj' or "
            "'layers/0/mlp/experts/up_proj', or an HF module name)"
        )
    return by_name[key]


def _to_expert_scales(kind: str, value, where, experts: int) -> np.ndarray:
    """(E,) f32 input scales of a stacked layer from a scalar or (E,) amax or scale."""
    value = to_host(value).astype(np.float32)
    if value.size == 1:
        value = np.full((experts,), value.reshape(()), np.float32)
    if value.shape != (experts,):
        raise ValueError(
            f"export_hf_checkpoint: {kind} of {where} must be a scalar or one value per "
            f"expert, shape ({experts},), got {value.shape}"
        )
    return value * formats.RCP2688 if kind == "input_amax" else value


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
    """Each set's max scale for all its members; one error naming every module lacking one.

    A scale must be positive and finite; an expert's may be 0 (an expert calibration sent no
    token to) as long as its set's maximum is positive, since that maximum is what engines
    quantize every expert's activations with.
    """
    sets = _scale_sets(tensors)
    order = [t.module for t in tensors if t.quantized]
    missing = [m for m in order if m not in scales]
    experts = {t.module for t in tensors if t.quantized and t.expert is not None}
    bad = [
        m
        for m in order
        if m in scales
        and not (np.isfinite(scales[m]) and (scales[m] >= 0 if m in experts else scales[m] > 0))
    ]
    for members in sets:  # experts: the set's maximum must be positive
        values = [scales.get(t.module) for t in members]
        if members[0].expert is not None and None not in values and np.all(np.isfinite(values)):
            if max(values) == 0:
                bad.extend(t.module for t in members)
    if missing or bad:
        problems = [f"no input amax for {compact(missing)}"] if missing else []
        if bad:
            values = sorted({float(scales[m]) * 2688 for m in bad})
            problems.append(
                f"an input amax of {values[:3]} (not positive and finite; 0: never calibrated) "
                f"for {compact(bad)}"
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


def _scale_sets(tensors) -> list[list[Tensor]]:
    """Quantized linears in sets that share their input scale.

    Each fused group; for the experts of an MoE block, one set per fused group (gate and up)
    or projection (down) over all experts (M4: one input quantizer per projection kind); each
    other linear alone.
    """
    sets: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        if not t.quantized:
            continue
        if t.block:
            kind = t.group[1] if t.group is not None else t.module.rpartition(".")[2]
            key: tuple = ("experts", t.block, kind)
        else:
            key = ("group", t.group) if t.group is not None else ("alone", t.module)
        sets.setdefault(key, []).append(t)
    return list(sets.values())


def weight_amaxes(tensors, implementation) -> dict[str, np.float32 | None]:
    """The amax each float kernel is quantized with: its group's max (None: already NVFP4)."""
    check_nvfp4_scales([t for t in tensors if t.quantized and is_nvfp4_array(t.value)])
    out = {}
    for members in quantized_sets(tensors):
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


def check_nvfp4_scales(tensors: list[Tensor]) -> None:
    """One error naming every NVFP4 kernel whose scales the importer (and engines) refuse.

    An `NVFP4Array` is written as it is: its decode scale as `weight_scale_2`, which must be
    finite and >= 0, and its block scales as `weight_scale`, which must hold no E4M3 NaN and
    no sign bit. A NaN amax (and NaN scales) is what quantizing a tensor holding NaN or inf
    gives; a negative or infinite one can only have been made by hand.
    """
    faults = {}  # (a stack is read once for all its experts)
    bad_decode, bad_blocks = [], []
    for t in tensors:
        if t.path not in faults:
            faults[t.path] = _scale_faults(t.value)
        decode, blocks = (part if t.expert is None else part[t.expert] for part in faults[t.path])
        if not (np.isfinite(decode) and decode >= 0):
            bad_decode.append((t, float(decode)))
        if blocks:
            bad_blocks.append(t)
    if not bad_decode and not bad_blocks:
        return
    problems = []
    if bad_decode:
        values = ", ".join(list(dict.fromkeys(str(value) for _, value in bad_decode))[:3])
        problems.append(
            f"{_modules_at(t for t, _ in bad_decode)} would be written with weight_scale_2 "
            f"(the decode scale) {values}, which must be finite and >= 0"
        )
    if bad_blocks:
        problems.append(
            f"{_modules_at(bad_blocks)} would be written with weight_scale (the block scales) "
            "holding E4M3 NaN or negative values"
        )
    raise ValueError(
        f"export_hf_checkpoint: the NVFP4Array kernel of {'; and '.join(problems)}. "
        "load_hf_checkpoint and engines refuse such a checkpoint. NaN scales come from "
        "quantizing a kernel that held NaN or inf: quantize finite weights, or pass the float "
        "kernel"
    )


def _scale_faults(q) -> tuple[np.ndarray, np.ndarray]:
    """(decode scales, whether each tensor's block scales hold a bad byte): () or (E,) each."""
    decode = np.asarray(to_host(q.global_scale), np.float32)
    bits = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
    axes = tuple(range(q.amax.ndim, bits.ndim))
    blocks = jnp.any(bits >= FIRST_BAD_SCALE_BYTE, axis=axes)
    return decode, np.asarray(to_host(blocks))


def _modules_at(tensors) -> str:
    """`compact` module names, with the Flax leaf of the first (e.g. `['layers'][0]...`)."""
    tensors = list(tensors)
    return f"{', '.join(compact([t.module for t in tensors]))} ({tensors[0].where})"


def _kernel_amax(t: Tensor, implementation) -> np.float32:
    amax = np.float32(to_host(tensor_amax(t.kernel, axis=0, implementation=implementation)))
    if not np.isfinite(amax):
        raise ValueError(
            f"export_hf_checkpoint: the kernel of {t.module} ({t.where}) holds NaN or inf"
        )
    return amax


def _decode_scale(t: Tensor) -> np.float32:
    """The decode scale D of an NVFP4 kernel (of one expert's, without slicing the codes)."""
    scale = t.value.global_scale
    return np.float32(to_host(scale if t.expert is None else scale[t.expert]))


def _check_equal_scales(members) -> None:
    scales = {_decode_scale(t).tobytes() for t in members}
    if len(scales) > 1:
        raise ValueError(
            f"export_hf_checkpoint: the fused group {[t.module for t in members]} holds "
            "NVFP4Arrays with different decode scales; engines decode the fused layer with one "
            "(the max), so quantize the members with the group's max amax"
        )
