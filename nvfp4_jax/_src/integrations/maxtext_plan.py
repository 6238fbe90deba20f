"""The export of a MaxText tree, without MaxText: which linears, how quantized, which bytes.

`precisions` decides each linear's precision as the launcher's rules decided it in training
(the qwix rules of `rules_from_config`, matched as qwix matches them: the first rule whose
`module_path` fullmatches the module issuing the op and whose `op_names` hold it; a linear
NVFP4 cannot block, K or N not a multiple of 16, stayed in high precision), then makes every
fused group (q/k/v, gate/up) and every mixture-of-experts block (gate, up, down of all
experts) all NVFP4 or all high precision, as engines load them (docs/SERVING_FORMATS.md
T3, M1-M5).

`hf_params` builds the HF-named Flax tree `nvfp4_jax.export_hf_checkpoint` writes. A linear
the rules trained in NVFP4 becomes an `NVFP4Array` quantized here, so that the export writes
these bits and no others:

    quantize_with_spec(T(bf16(kernel)), recipe.spec("weight", "fprop"), amax=A)

where `bf16(kernel)` is what MaxText's layer multiplies by (it casts its f32 kernel to the
compute dtype before the GEMM), T the mapping to Hugging Face's layout (`maxtext_names`: a
reshape; the query's sqrt(E); llama3.1's RoPE order), the spec the training forward's (16x16
blocks, Four Over Six as the recipe had it) and A the largest tensor amax of T(...) over the
linear's fused group (one expert's gate and up), since engines decode a fused layer with one
`weight_scale_2` (T3, M2). Where T is a reshape or a power-of-two scale and the linear's own
amax is its group's, these are the codes and block scales the training forward quantized the
weight to, bit for bit (`Plan.training_exact`); the others (`Plan.requantized`, with the
reason) are the same weight quantized with the group's amax or after the RoPE reorder.

With `base` (the released checkpoint a MaxText run was fine-tuned from, as
`load_hf_checkpoint` reads it), a group whose MaxText weights are still exactly what the
import made of the released tensors is written with the released tensors themselves (codes,
scales, input scales, or the float weight): importing then exporting returns the released
bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nvfp4_jax._src.core.array import is_nvfp4_array
from nvfp4_jax._src.core.ops import dequantize, quantize_with_spec, tensor_amax
from nvfp4_jax._src.integrations import maxtext_names as names
from nvfp4_jax._src.io.hf.format import KV_SUFFIXES, QUANT_OPTIONAL
from nvfp4_jax._src.training.recipe import NVFP4Recipe

LINEARS = ("linear", "experts", "router", "head")
# The fields of a recipe that decide how its weight is quantized in the forward.
WEIGHT_FIELDS = ("weight_2d", "weight_four_over_six", "four_over_six_e4m3_max")


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one linear (an expert stack counts as one) was trained.

    Attributes:
      recipe: the recipe of its GEMMs (None: high precision).
      reason: why high precision ("" when NVFP4).
    """

    recipe: NVFP4Recipe | None
    reason: str = ""


def _first_rule(rules: Sequence, module: str, op: str):
    for rule in rules:
        names_ok = not getattr(rule, "op_names", None) or op in rule.op_names
        if re.fullmatch(rule.module_path, module) and names_ok:
            return rule
    return None


def _group_key(entry: names.Entry) -> tuple:
    """The set a linear's precision must agree with: its fused group or its MoE block."""
    parts = entry.hf.split("/")
    if entry.kind == "experts":
        return ("moe", parts[1])
    if parts[-2] in ("q_proj", "k_proj", "v_proj"):
        return ("qkv", parts[1])
    if parts[-2] in ("gate_proj", "up_proj"):
        return ("gate_up", parts[1])
    return ("alone", entry.hf)


def groups(entries: Sequence[names.Entry]) -> dict[tuple, list[names.Entry]]:
    """The linears in their sets (fused groups, MoE blocks; each other linear alone)."""
    out: dict[tuple, list[names.Entry]] = {}
    for entry in entries:
        if entry.kind in LINEARS:
            out.setdefault(_group_key(entry), []).append(entry)
    return out


def _kn(entry: names.Entry, spec: names.ModelSpec, shapes: Mapping) -> tuple[int, int]:
    shape = names.layer_shape(entry, shapes[entry.maxtext], spec)
    return names.hf_shape(entry, shape)[-2:]


def precisions(
    spec: names.ModelSpec, rules: Sequence, shapes: Mapping | None = None
) -> dict[str, Decision]:
    """`{HF path of a linear: Decision}`: what training did, made whole per set.

    Args:
      spec: the model.
      rules: the qwix rules the launcher trained with (`rules_from_config(config, recipe,
        rules=...)`): NVFP4Rules (recipe None: high precision).
      shapes: `{MaxText leaf path: shape}` (default `expected_shapes(spec)`).

    Raises:
      ValueError: a fused group or MoE block whose members were trained in NVFP4 with
        different weight settings (engines decode them as one layer).
    """
    shapes = names.expected_shapes(spec) if shapes is None else shapes
    out: dict[str, Decision] = {}
    for members in groups(names.entries(spec)).values():
        own = {}
        for entry in members:
            rule = _first_rule(rules, entry.module, entry.op)
            recipe = getattr(rule, "recipe", None)
            reason = "" if recipe else "trained in high precision (the rules)"
            if recipe is not None and entry.kind in ("router",):
                recipe, reason = None, "a router, kept in high precision"
            if recipe is not None:
                k, n = _kn(entry, spec, shapes)
                problem = names.check_blocks(entry, (k, n))
                if problem:
                    recipe, reason = None, f"trained in high precision: {problem}"
            own[entry.hf] = Decision(recipe, reason)
        out.update(_whole(members, own))
    return out


def _whole(members: list[names.Entry], own: dict[str, Decision]) -> dict[str, Decision]:
    """The set's decisions: all NVFP4 with one weight setting, or all high precision."""
    high = [e.hf for e in members if own[e.hf].recipe is None]
    if high and len(high) < len(members):
        why = f"in a set with {high[0]}, which was trained in high precision"
        return {
            e.hf: own[e.hf] if own[e.hf].recipe is None else Decision(None, why) for e in members
        }
    settings = {
        tuple(getattr(own[e.hf].recipe, f) for f in WEIGHT_FIELDS) for e in members if not high
    }
    if len(settings) > 1:
        raise ValueError(
            f"nvfp4_jax.maxtext: the fused set {[e.hf for e in members]} was trained with "
            f"different weight settings {sorted(settings, key=str)}; engines decode it as one "
            "layer, so it cannot be exported as trained"
        )
    return own


# --- the arrays -------------------------------------------------------------------------------


def hf_layer(entry: names.Entry, params: Mapping, spec: names.ModelSpec, dtype=None):
    """The entry's HF-side tensor from the MaxText tree.

    `dtype` first casts MaxText's array (the layer's compute dtype, as its GEMM sees the
    kernel).
    """
    array = names.layer_of(names.leaf(params, entry.maxtext), entry, spec)
    if dtype is not None:
        array = np.asarray(array).astype(dtype)
    return names.to_hf(entry, array, spec)


def _amax(x) -> np.float32:
    value = np.float32(tensor_amax(jnp.asarray(x), axis=0))
    if not np.isfinite(value):
        raise ValueError("nvfp4_jax.maxtext: a kernel holds NaN or inf")
    return value


def _expert_amaxes(x) -> np.ndarray:
    return np.asarray(jax.vmap(lambda w: tensor_amax(w, axis=0))(jnp.asarray(x)), np.float32)


def _quantize(x, recipe: NVFP4Recipe, amax):
    spec = recipe.spec("weight", "fprop")
    x = jnp.asarray(x)
    if x.ndim == 3:  # an expert stack: each expert its own tensor (ragged_dot's weights)
        amaxes = jnp.asarray(amax, jnp.float32)
        return jax.vmap(lambda w, a: quantize_with_spec(w, spec, amax=a))(x, amaxes)
    return quantize_with_spec(x, spec, amax=jnp.float32(amax))


def _exact_scale(scale: float) -> bool:
    """Whether multiplying by `scale` is exact in f32 (1 or a power of two)."""
    mantissa, _ = math.frexp(scale)
    return mantissa == 0.5


def _module(hf: str) -> str:
    return hf.rpartition("/")[0]


@dataclasses.dataclass
class Plan:
    """What `hf_params` made of each linear (HF-named Flax module paths).

    Attributes:
      nvfp4: the linears written in NVFP4 (an expert stack as its module path).
      high_precision: `{linear: why}` of those written in high precision.
      training_exact: NVFP4 linears whose codes and block scales are the training
        forward's; for experts `path[e]` per expert.
      requantized: `{linear: why}` of the NVFP4 linears whose weights were quantized with
        their fused group's amax or after a reorder: same recipe, not the training forward's
        bits.
      from_base: linears (and other tensors) written as the released checkpoint holds them.
    """

    nvfp4: list[str] = dataclasses.field(default_factory=list)
    high_precision: dict[str, str] = dataclasses.field(default_factory=dict)
    training_exact: list[str] = dataclasses.field(default_factory=list)
    requantized: dict[str, str] = dataclasses.field(default_factory=dict)
    from_base: list[str] = dataclasses.field(default_factory=list)


def _quantized_set(members, params, spec, recipe, plan: Plan, compute_dtype) -> dict[str, Any]:
    """The NVFP4Arrays of one fused set, quantized with its shared amax (one per expert)."""
    arrays = {e.hf: hf_layer(e, params, spec, compute_dtype) for e in members}
    experts = members[0].kind == "experts"
    own = {hf: (_expert_amaxes(x) if experts else _amax(x)) for hf, x in arrays.items()}
    out = {}
    fused = [e for e in members if e.hf.split("/")[-2] != "down_proj"] if experts else members
    shared = np.max(np.stack([own[e.hf] for e in fused]), axis=0)
    for entry in members:
        amax = shared if entry in fused else own[entry.hf]
        out[entry.hf] = _quantize(arrays[entry.hf], recipe, amax)
        _classify(entry, own[entry.hf], amax, plan)
    return out


def _classify(entry: names.Entry, own, used, plan: Plan) -> None:
    module = _module(entry.hf)
    plan.nvfp4.append(module)
    why = []
    if entry.rope:
        why.append("its rows reordered to Hugging Face's RoPE halves")
    if not _exact_scale(entry.scale):
        why.append(f"scaled by sqrt(head_dim) = {entry.scale:.6g}, not a power of two")
    own, used = np.atleast_1d(own), np.atleast_1d(used)
    for index, (mine, shared) in enumerate(zip(own, used, strict=True)):
        name = f"{module}[{index}]" if entry.kind == "experts" else module
        reasons = list(why)
        if mine != shared:
            reasons.append("quantized with its fused group's larger amax")
        if reasons:
            plan.requantized[name] = "; ".join(reasons)
        else:
            plan.training_exact.append(name)


def _float_tensor(entry, params, spec, base_dtype) -> np.ndarray:
    return np.asarray(hf_layer(entry, params, spec)).astype(base_dtype)


def hf_params(
    params: Mapping,
    spec: names.ModelSpec,
    decisions: Mapping[str, Decision],
    *,
    compute_dtype=jnp.bfloat16,
    dtype=jnp.bfloat16,
    base: Mapping | None = None,
    master_dtype=np.float32,
) -> tuple[dict, Plan]:
    """The HF-named Flax tree of a MaxText tree, and the `Plan` of what became of each linear.

    Args:
      params: MaxText's parameter tree (`{"decoder": ..., "token_embedder": ...}`), arrays.
      spec: the model (`model_spec`).
      decisions: `precisions(spec, rules)`.
      compute_dtype: the dtype MaxText casts kernels to before its GEMMs (`config.dtype`).
      dtype: the dtype of every tensor written in high precision.
      base: the released checkpoint, flat (`{"layers/0/self_attn/q_proj/kernel": leaf}`, with
        its `input_scale` leaves): unchanged sets are written as it holds them.
      master_dtype: the dtype the import gave MaxText's weights (to tell unchanged ones).

    Returns:
      (`{HF-named Flax path: array or NVFP4Array}` flat, `Plan`).
    """
    plan = Plan()
    entries = names.entries(spec)
    out: dict[str, Any] = {}
    for entry in entries:
        if entry.kind not in LINEARS:
            out[entry.hf] = _from_base(entry, params, spec, base, master_dtype, plan)
            if out[entry.hf] is None:
                out[entry.hf] = _float_tensor(entry, params, spec, dtype)
    for members in groups(entries).values():
        released = [_from_base(e, params, spec, base, master_dtype, plan) for e in members]
        if base is not None and all(r is not None for r in released):
            _take_base(members, released, base, out, plan)
            continue
        for entry in members:
            if entry.hf in plan.from_base:
                plan.from_base.remove(entry.hf)
        recipe = decisions[members[0].hf].recipe
        if recipe is None:
            for entry in members:
                out[entry.hf] = _float_tensor(entry, params, spec, dtype)
                plan.high_precision[_module(entry.hf)] = decisions[entry.hf].reason
            continue
        out.update(_quantized_set(members, params, spec, recipe, plan, compute_dtype))
    return out, plan


def _take_base(members, released, base, out: dict, plan: Plan) -> None:
    for entry, value in zip(members, released, strict=True):
        out[entry.hf] = value
        scale = base.get(f"{_module(entry.hf)}/input_scale")
        if scale is not None and is_nvfp4_array(value):
            out[f"{_module(entry.hf)}/input_scale"] = scale
        if is_nvfp4_array(value):
            plan.nvfp4.append(_module(entry.hf))
        else:
            plan.high_precision[_module(entry.hf)] = "as the released checkpoint holds it"


def _from_base(entry, params, spec, base, master_dtype, plan: Plan):
    """The released tensor of `entry` if the MaxText weight is still its import, else None."""
    if base is None or entry.hf not in base:
        return None
    released = base[entry.hf]
    mine = names.layer_of(names.leaf(params, entry.maxtext), entry, spec)
    value = dequantize(released, jnp.float32) if is_nvfp4_array(released) else released
    imported = names.to_maxtext(entry, np.asarray(value), np.shape(mine), master_dtype)
    if imported.dtype != np.asarray(mine).dtype or not np.array_equal(
        imported.view(np.uint8), np.asarray(mine).view(np.uint8)
    ):
        return None
    plan.from_base.append(entry.hf)
    return released


def input_amaxes(
    spec: names.ModelSpec, plan: Plan, recorded: Mapping[str, Any]
) -> dict[str, np.float32]:
    """`export_hf_checkpoint`'s `input_amax=` for the NVFP4 linears, from recorded amaxes.

    `recorded` is `AmaxRecorder.amaxes`: keyed by the unscanned MaxText leaf path
    (`decoder/layers_0/self_attention/query/kernel`), an MoE block's experts by the block's
    `ragged_dot` index (`decoder/layers_0/MoeBlock_0/ragged_dot0` for wi_0, 1 for wi_1, 2 for
    wo).
    A linear written from the released checkpoint keeps its released input scale.
    """
    unscanned = dataclasses.replace(spec, scan_layers=False)
    source = {e.hf: _recorded_key(e) for e in names.entries(unscanned)}
    out = {}
    for hf, key in source.items():
        module = _module(hf)
        if module in plan.nvfp4 and hf not in plan.from_base and key in recorded:
            out[module] = np.float32(recorded[key])
    return out


_RAGGED_ORDER = {"wi_0": 0, "wi_1": 1, "wo": 2}


def _recorded_key(entry: names.Entry) -> str:
    if entry.kind == "experts":
        return f"{entry.module}/ragged_dot{_RAGGED_ORDER[entry.maxtext[-1]]}"
    return "/".join(entry.maxtext)


def missing_input_amaxes(plan: Plan, amaxes: Mapping) -> list[str]:
    """The NVFP4 linears that a W4A4 export lacks an input amax (or released scale) for."""
    from_base = {_module(hf) for hf in plan.from_base}
    return [m for m in dict.fromkeys(plan.nvfp4) if m not in amaxes and m not in from_base]


def bf16(x) -> np.ndarray:
    """`x` as bfloat16 (numpy, via ml_dtypes)."""
    return np.asarray(x).astype(ml_dtypes.bfloat16)


def to_maxtext_tree(hf_flat: Mapping[str, Any], spec: names.ModelSpec, dtype=np.float32) -> dict:
    """MaxText's parameter tree of an HF-named Flax tree (`load_hf_checkpoint`'s, flat).

    Every NVFP4 tensor is dequantized (`dequantize(q, f32)`, the values ModelOpt's decode
    gives) and mapped back (`maxtext_names.to_maxtext`); the layers stacked where the spec
    scans them. Raises a ValueError naming a tensor the model needs that the tree lacks, or
    one of another shape.
    """
    shapes = names.expected_shapes(spec)
    flat = {}
    for leaf_path, group in names.by_leaf(names.entries(spec)).items():
        arrays = []
        for entry in group:
            if entry.hf not in hf_flat:
                raise ValueError(
                    f"nvfp4_jax.maxtext: the checkpoint has no {entry.hf} (needed for "
                    f"{'/'.join(leaf_path)}): a checkpoint of another architecture?"
                )
            value = hf_flat[entry.hf]
            value = dequantize(value, jnp.float32) if is_nvfp4_array(value) else value
            shape = names.layer_shape(entry, shapes[leaf_path], spec)
            arrays.append(names.to_maxtext(entry, np.asarray(value), shape, dtype))
        flat[leaf_path] = names.stack(group, arrays, spec)
    extra = sorted(set(hf_flat) - {e.hf for e in names.entries(spec)} - _inert(hf_flat))
    if extra:
        raise ValueError(
            f"nvfp4_jax.maxtext: the checkpoint holds {extra[:3]}, which the MaxText config's "
            f"model (decoder_block={spec.family.block}) has no place for"
        )
    return names.nested(flat)


def _inert(hf_flat: Mapping) -> set[str]:
    """Leaves that carry no weight of the model: input and KV-cache scales."""
    inert = (*QUANT_OPTIONAL, *KV_SUFFIXES)  # input_scale, k_scale, v_scale
    return {p for p in hf_flat if p.rpartition("/")[2] in inert}
