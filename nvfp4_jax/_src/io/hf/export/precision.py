"""Export: the precision the model itself was trained in, and its weight Four Over Six.

An nnx model tells which linears computed in NVFP4 (`nvfp4_jax.nnx.Linear`, `Experts` with
a recipe) and with which weight Four Over Six setting; `rules=` (a `QuantizeReport`, or the
`Rule`s `quantize_model` was given, duck-typed: hf may not import the rules) tells instead.
`decider` turns that into `decide(t)`, and `four_over_six_of` into each quantized kernel's
(mode, M), the same within a fused group.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flax import nnx

from nvfp4_jax._src.core import checks, formats
from nvfp4_jax._src.core.array import is_nvfp4_array
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.io.hf.export.options import FOLLOW_MODEL
from nvfp4_jax._src.io.hf.export.plan import (
    quantized_sets,
)
from nvfp4_jax._src.io.hf.export.tensors import Leaves, Tensor


def experts_recipes(model: nnx.Module) -> dict[str, bool]:
    """`{Flax path: computes in NVFP4}` of every `nvfp4_jax.nnx.Experts` layer of `model`.

    An `Experts` layer holds an `input_amax` whether it has a recipe or not, and its recipe
    is no state: only the model itself tells.
    """
    return {
        "/".join(str(key) for key in path): node.recipe is not None
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nvfp4_nnx.Experts)
    }


def model_four_over_six(model: nnx.Module) -> dict[str, tuple[str | None, int]]:
    """`{Flax path: (weight_four_over_six, four_over_six_e4m3_max)}` of the NVFP4 layers.

    Every `nvfp4_jax.nnx.Linear` and `Experts` of `model` with a recipe.
    """
    out = {}
    for path, node in nnx.iter_graph(model):
        recipe = getattr(node, "recipe", None)
        if isinstance(node, (nvfp4_nnx.Linear, nvfp4_nnx.Experts)) and recipe is not None:
            out["/".join(str(key) for key in path)] = (
                recipe.weight_four_over_six,
                recipe.four_over_six_e4m3_max,
            )
    return out


def _rules_four_over_six(rules, t: Tensor) -> tuple[str | None, int] | None:
    """The weight Four Over Six `rules` (a QuantizeReport or Rules) give `t`'s layer, or None."""
    recipe = None
    decisions = getattr(rules, "layers", None)
    if isinstance(decisions, Mapping):
        recipe = getattr(decisions.get(t.flax_module), "recipe", None)
    else:
        for rule in rules:
            if re.search(rule.pattern, t.flax_module):
                recipe = rule.recipe
                break
    if recipe is None:
        return None
    return recipe.weight_four_over_six, recipe.four_over_six_e4m3_max


def four_over_six_of(four_over_six, e4m3_max, model_fos, rules, tensors) -> Callable:
    """`fos(t)`: (mode, M) of a quantized kernel, the argument's or the training recipe's.

    With `four_over_six="model"`: `rules` first, else the model's layers, else plain NVFP4.
    The members of a fused group must agree: they share one amax and are one layer to engines.
    """
    if four_over_six != FOLLOW_MODEL:
        mode, m = checks.check_four_over_six(four_over_six, e4m3_max, "export_hf_checkpoint")
        return lambda t: (mode, m)

    def own(t: Tensor) -> tuple[str | None, int]:
        found = _rules_four_over_six(rules, t) if rules is not None else None
        plain = (None, formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX)  # (M is ignored when plain)
        found = found or model_fos.get(t.flax_module) or plain
        return found if found[0] is not None else plain

    chosen = {t.module: own(t) for t in tensors if t.quantized}
    for members in quantized_sets(tensors):
        kinds = {chosen[t.module] for t in members}
        if len(kinds) > 1:
            raise ValueError(
                f"export_hf_checkpoint: the fused group {[t.module for t in members]} was "
                f"trained with different weight Four Over Six settings {sorted(kinds, key=str)}; "
                "engines decode it as one layer: pass four_over_six= to choose one"
            )
    return lambda t: chosen[t.module]


def _held_by_model(leaves: Leaves, experts: Mapping[str, bool]) -> Callable[[Tensor], bool]:
    """`held(t)`: whether the model computed the linear `t` in NVFP4, as its layers say."""

    def held(t: Tensor) -> bool:
        if t.kind != "experts":
            return t.flax_module in leaves.nvfp4
        if t.flax_module in experts:
            return experts[t.flax_module]
        if t.flax_module in leaves.nvfp4:
            raise ValueError(
                f"export_hf_checkpoint: {t.flax_module} holds an input_amax, as an "
                "nvfp4_jax.nnx.Experts layer does, but a state does not record whether the "
                "layer computed in NVFP4 or in high precision (recipe None): pass the model "
                "itself, or rules= (the QuantizeReport of nvfp4_jax.quantize_model, or its rules)"
            )
        return False  # a stacked kernel of some other module: computed in high precision

    return held


def decider(rules, leaves: Leaves, experts: Mapping[str, bool]) -> tuple[str, Callable | None]:
    """(where the linears' precisions come from, `decide(t)`), or ("", None): quantize all.

    `rules` (a `QuantizeReport`, or `Rule`s, duck-typed: hf may not import rules) decides;
    else the state itself: where it holds `nvfp4_jax.nnx.Linear` layers (or `Experts` with a
    recipe, `experts` as `experts_recipes` gives), the linears it holds otherwise (plain
    `nnx.Linear`, `Experts` with recipe None) computed in high precision.
    """
    held = _held_by_model(leaves, experts)
    if rules is None:
        nvfp4 = any(experts.get(path, True) for path in leaves.nvfp4) or any(experts.values())
        return ("model", held) if nvfp4 else ("", None)
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

    def from_rules(t: Tensor) -> bool:
        for rule in rules:  # first match wins, re.search on the module path (Rule.matches)
            if re.search(rule.pattern, t.flax_module):
                # quantize_model leaves a kernel it cannot quantize in high precision.
                return rule.recipe is not None and _quantizable(t)
        return held(t)  # no rule: the layer was left as it was

    return "rules", from_rules


def _report_decider(decisions: Mapping, held: Callable) -> Callable:
    def from_report(t: Tensor) -> bool | None:
        if t.flax_module not in decisions:
            return None
        action = getattr(decisions[t.flax_module], "action", None)
        # "unmatched": the layer was left as it was; "skipped": it stayed high precision.
        return True if action == "nvfp4" else held(t) if action == "unmatched" else False

    return from_report


def _quantizable(t: Tensor) -> bool:
    """Whether `quantize_model` turns a kernel into NVFP4: its (in, out) multiples of 16."""
    if is_nvfp4_array(t.value):
        return True
    shape = tuple(np.shape(t.value))
    rank = 3 if t.kind == "experts" else 2
    return len(shape) == rank and not any(n % formats.BLOCK_SIZE for n in shape[-2:])
