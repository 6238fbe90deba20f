"""Rules applied to an nnx model: `quantize_model` converts its layers in place.

* `quantize_model(model, rules)` turns the model's `nnx.Linear` layers into
  `nvfp4_jax.nnx.Linear` in place, keeping their parameter variables, and points the
  `nnx.Einsum` layers whose contraction is a plain dense one at the NVFP4 `dot_general`.
* Mixture-of-experts layers (`nvfp4_jax.nnx.Experts`: a (G, K, N) kernel) are matched by
  their path like a linear and take the rule's recipe (None: high precision), each expert's
  GEMMs with its own tensor amaxes.
* A frozen layer (an NVFP4 weight: `Linear.from_quantized`, `Experts.from_quantized`)
  computes as it is: a rule matching it reports it "skipped" (`frozen_problem`).

Example:
  >>> class MLP(nnx.Module):
  ...     def __init__(self, rngs):
  ...         self.up = nnx.Linear(32, 64, rngs=rngs)
  ...         self.down = nnx.Linear(64, 32, rngs=rngs)
  ...     def __call__(self, x):
  ...         return self.down(jax.nn.relu(self.up(x)))
  >>> model = MLP(nnx.Rngs(0))
  >>> report = quantize_model(model, [Rule("down", None), Rule(".*", NVFP4Recipe())])
  >>> isinstance(model.up, nvfp4_nnx.Linear), isinstance(model.down, nvfp4_nnx.Linear)
  (True, False)
  >>> report["up"].action, report["down"].action
  ('nvfp4', 'high_precision')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.flax.einsum import NVFP4Einsum
from nvfp4_jax._src.flax.layer_info import (
    dot_general_recipe,
    einsum_problem,
    experts_problem,
    experts_stack,
    frozen_problem,
    layer_recipe,
    layer_stack,
    linear_kind_problem,
    linear_shape_problem,
    linear_stack,
)
from nvfp4_jax._src.flax.walk import layer_paths, replace_layers
from nvfp4_jax._src.model.convert.report import QuantizeReport, record
from nvfp4_jax._src.model.convert.rules import (
    DEFAULT_RNG_COLLECTION,
    Rule,
    check_rules,
    match_layer,
)
from nvfp4_jax._src.training.recipe import NVFP4Recipe


def _linear_config(layer: nnx.Linear) -> dict[str, Any]:
    return dict(
        use_bias=layer.bias is not None,
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
        precision=layer.precision,
        promote_dtype=layer.promote_dtype,
        preferred_element_type=layer.preferred_element_type,
    )


def _adopt(new: nnx.Linear, old: nnx.Linear) -> nnx.Linear:
    """`new` (built abstract) with `old`'s very parameter variables."""
    new.kernel = old.kernel
    new.bias = old.bias if old.bias is not None else nnx.data(None)
    return new


def _to_nvfp4(layer: nnx.Linear, recipe: NVFP4Recipe, rngs: nnx.Rngs, stream: str):
    """An NVFP4 `Linear` holding `layer`'s variables (`layer` itself if nothing changes).

    A stacked layer's per-layer state gets its layer axes too, so that `nnx.scan` (or
    `nnx.vmap`) hands every step its own: the calibration `input_amax` is `zeros(stack)`,
    the stochastic-rounding stream holds one key and one count per layer.
    """
    if layer_recipe(layer) == recipe:
        return layer
    stack = linear_stack(layer)
    config = _linear_config(layer)
    new = nnx.eval_shape(
        lambda: nvfp4_nnx.Linear(
            layer.in_features, layer.out_features, recipe=recipe, rngs=nnx.Rngs(0), **config
        )
    )
    new.input_amax = nvfp4_nnx.InputAmax(jnp.zeros(stack, jnp.float32))
    if not recipe.random_backward:
        new.quantize_rngs = nnx.data(None)
    else:
        new.quantize_rngs = rngs[stream].split(stack) if stack else rngs[stream].fork()
    return _adopt(new, layer)


def _to_high_precision(layer: nnx.Linear) -> nnx.Linear:
    """A plain `nnx.Linear` holding `layer`'s variables (`layer` itself if it is one).

    An `nnx.Linear` built with `dot_general=nvfp4_dot_general(...)` gets back the default
    `jax.lax.dot_general`.
    """
    if not isinstance(layer, nvfp4_nnx.Linear):
        if dot_general_recipe(layer.dot_general) is not None:
            layer.dot_general = jax.lax.dot_general
        return layer
    config = _linear_config(layer)
    new = nnx.eval_shape(
        lambda: nnx.Linear(layer.in_features, layer.out_features, rngs=nnx.Rngs(0), **config)
    )
    return _adopt(new, layer)


def _set_experts_recipe(
    layer: nvfp4_nnx.Experts, recipe: NVFP4Recipe | None, rngs: nnx.Rngs, stream: str
) -> None:
    """Points an `Experts` layer (in place) at `recipe`, with a stacked SR stream if stacked."""
    if layer.recipe == recipe:
        return
    if recipe is not None and recipe.random_backward and layer.quantize_rngs is None:
        stack = experts_stack(layer) or ()
        layer.quantize_rngs = rngs[stream].split(stack) if stack else rngs[stream].fork()
    layer.set_recipe(recipe)


def _check_rngs(rngs, stream: str) -> nnx.Rngs:
    if rngs is None:
        return nnx.Rngs(**{stream: 0})
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"quantize_model: rngs must be an nnx.Rngs or None, got {rngs!r}")
    try:
        rngs[stream]
    except KeyError:
        raise ValueError(
            f"quantize_model: rngs has neither a {stream!r} stream nor a default one"
        ) from None
    return rngs


def _convert_experts(layer: nvfp4_nnx.Experts, rule: Rule, rngs: nnx.Rngs, stream: str):
    problem = experts_problem(layer) if rule.recipe is not None else ""
    if problem:
        return layer, "skipped", problem
    _set_experts_recipe(layer, rule.recipe, rngs, stream)
    return layer, "nvfp4" if rule.recipe is not None else "high_precision", ""


def _convert_einsum(layer: nnx.Einsum, rule: Rule):
    if rule.recipe is None:
        if isinstance(layer.einsum_op, NVFP4Einsum):
            layer.einsum_op = jnp.einsum
        return layer, "high_precision", ""
    problem = einsum_problem(layer)
    if problem:
        return layer, "skipped", problem
    layer.einsum_op = NVFP4Einsum(rule.recipe)
    return layer, "nvfp4", ""


def _convert(layer, rule: Rule, rngs: nnx.Rngs, stream: str):
    """(new layer, action, reason) for a layer a rule matched."""
    problem = frozen_problem(layer)
    if problem:  # whatever the rule's recipe: a frozen weight stays as it is
        return layer, "skipped", problem
    if isinstance(layer, nvfp4_nnx.Experts):
        return _convert_experts(layer, rule, rngs, stream)
    if isinstance(layer, nnx.Einsum):
        return _convert_einsum(layer, rule)
    problem = linear_kind_problem(layer)
    if problem:
        return layer, "skipped", problem
    if rule.recipe is None:
        return _to_high_precision(layer), "high_precision", ""
    problem = linear_shape_problem(layer)
    if problem:
        return layer, "skipped", problem
    return _to_nvfp4(layer, rule.recipe, rngs, stream), "nvfp4", ""


def quantize_model(
    model: nnx.Module,
    rules: Sequence[Rule],
    *,
    rngs: nnx.Rngs | None = None,
    rng_collection: str = DEFAULT_RNG_COLLECTION,
) -> QuantizeReport:
    """Puts the linear layers of an nnx model in NVFP4 (or high precision) by rules, in place.

    Every `nnx.Linear` whose path matches a rule with a recipe becomes an
    `nvfp4_jax.nnx.Linear` with that recipe, holding the very same kernel and bias variables
    (values, dtype, metadata) and the layer's `dtype`, `param_dtype`, `precision`,
    `promote_dtype` and `preferred_element_type`; one matching a rule with recipe None
    becomes (or stays) a plain `nnx.Linear` computing with `jax.lax.dot_general` (also one
    built with `dot_general=nvfp4_dot_general()`). An `nnx.Einsum` whose contraction is a
    plain dense one (`einsum_plan`) gets `einsum_op=NVFP4Einsum(recipe)`. A layer whose sizes
    are not multiples of 16, an einsum with batch dimensions or sums, and a frozen quantized
    layer (`Linear.from_quantized`, `Experts.from_quantized`: `frozen_problem`; whatever the
    rule's recipe) stay as they are, reported "skipped" with the reason. A layer no rule
    matches is left alone. An `nvfp4_jax.nnx.Experts` layer (the (G, K, N)
    experts of an MoE block) stays the same object and takes the rule's recipe
    (`Experts.set_recipe`; None: high precision); its sizes K and N must be multiples of 16.

    A layer held at several paths (a tied head) is decided by the rules its paths match
    (`match_layer`: they must agree, else ValueError), replaced at all of them, and reported
    once, at its first path, with the others as `aliases`. A stacked layer (an
    `nnx.Linear` made under `nnx.vmap`, kernel `(L, K, N)`, run under `nnx.scan`) becomes
    one `nvfp4_jax.nnx.Linear` holding the same stacked kernel, its calibration amax and
    stochastic-rounding stream stacked alike, so that every step of the scan runs the
    ordinary NVFP4 GEMM of its own (K, N) slice, with its own amax; the report gives its
    `stack`.

    Stochastic rounding: each converted `Linear` forks its own stream from
    `rngs[rng_collection]` (the default stream if there is none of that name) and draws a
    fresh key on every call; without `rngs`, from `nnx.Rngs(quantize=0)`. An `Einsum` derives
    its key from the incoming gradient's bits (`nvfp4_dot_general`'s default).

    Args:
      model: the nnx model; changed in place (create the optimizer afterwards, or keep
        using the one you have: the parameter variables are the same objects).
      rules: `Rule`s, first match wins.
      rngs: where the converted layers' stochastic-rounding streams fork from.
      rng_collection: the stream name.

    Returns:
      The `QuantizeReport`: per path, what the layer became and by which rule.

    Raises:
      TypeError: `model` is not an nnx Module, `rules` holds something other than `Rule`s,
        `rngs` is not an `nnx.Rngs`.
      ValueError: `rngs` has no stream to fork from, or two paths of one layer match rules
        that disagree (nothing is changed then).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"quantize_model: model must be a flax.nnx.Module, got {type(model)}")
    rules = check_rules(rules, "quantize_model")
    rngs = _check_rngs(rngs, rng_collection)
    layers = layer_paths(model)
    # Every rule is resolved (and a shared layer's conflict raised) before anything changes.
    found = {
        path: match_layer(rules, paths, "quantize_model") for path, (_, paths) in layers.items()
    }
    report = QuantizeReport()
    pending = []
    for path, (layer, paths) in layers.items():
        kind = type(layer).__name__
        stack = layer_stack(layer)
        notes = dict(aliases=paths[1:], stack=stack)
        if found[path] is None:
            record(report, path, kind, "unmatched", None, **notes)
            continue
        new, action, reason = _convert(layer, found[path][1], rngs, rng_collection)
        record(report, path, kind, action, found[path], reason, **notes)
        if new is not layer:
            pending.append((path, layer, new))
    failures = replace_layers(model, [(layer, new) for _, layer, new in pending])
    for (path, _, _), reason in zip(pending, failures, strict=True):
        if reason:
            entry = report[path]
            record(
                report,
                path,
                entry.layer,
                "skipped",
                (entry.rule, rules[entry.rule]),
                reason,
                aliases=entry.aliases,
                stack=entry.stack,
            )
    return report
