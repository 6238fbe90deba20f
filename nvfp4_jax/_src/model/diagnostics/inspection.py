"""`inspect_model`: one forward and backward pass, and what NVFP4 does to each linear."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from nvfp4_jax._src.core.sr_keys import fold_in
from nvfp4_jax._src.model.convert.rules import Rule, check_rules
from nvfp4_jax._src.model.diagnostics.capture import capture, default_loss, select_targets
from nvfp4_jax._src.model.diagnostics.numbers import analyze_layer, as_key
from nvfp4_jax._src.model.diagnostics.report import ModelReport


def inspect_model(
    model: nnx.Module,
    *inputs: Any,
    loss_fn: Callable[..., jax.Array] | None = None,
    rules: Sequence[Rule] | None = None,
    key: jax.Array | None = None,
) -> ModelReport:
    """Runs one forward and backward pass and measures what NVFP4 does to each linear layer.

    Which layers: with `rules`, every `nnx.Linear` (NVFP4 or not) whose first matching rule has
    a recipe, quantized as that recipe would (so a high-precision model shows what
    `quantize_model(model, rules)` would do; an `nnx.Einsum` such a rule covers is reported
    skipped, not analyzed); without, every `nvfp4_jax.nnx.Linear` with its own recipe. The pass
    itself runs the model as it is. The model is not changed: the pass runs on a copy
    (`nnx.split`/`nnx.merge`) in which each analyzed layer is wrapped by a tap that records its
    input x and weight W (as the GEMM sees them, after dtype promotion) and adds a zero probe to
    its output, whose gradient is dy. The tap is an nnx Module whose records are nnx Variables,
    so layers the model runs through `nnx.remat`, `nnx.scan`, `nnx.vmap` or `nnx.jit` are
    observed too (one extra forward pass counts the tokens first). A layer called several
    times contributes the tokens of every call; a layer the pass does not call is reported
    skipped. A layer held at several paths is analyzed once, at its first path (its paths'
    rules must agree, see `match_layer`). A stacked layer (kernel `(L, K, N)` run under
    `nnx.scan`) is reported per slice, `path[i]` with `module_path` the layer's path: each
    slice is its own GEMM with its own amax. An `nvfp4_jax.nnx.Experts` layer (an MoE
    block's (G, K, N) experts) is reported per expert the same way, `path[e]` (`path[i,e]`
    when stacked): expert e's tokens, weight and output gradient, its own GEMMs. A frozen
    layer (`Linear.from_quantized`, `Experts.from_quantized`) is not analyzed (skipped under
    rules that reach it, `rules.frozen_problem`; high precision without); the pass
    differentiates through it as through any other.
    Memory: the pass keeps x, W and dy of every analyzed layer at once (one batch).
    Speed: the pass is compiled once per model structure, analyzed paths, `loss_fn` and input
    types; inspecting again (the same model after some steps, or another instance of the same
    architecture) reuses it (a tiny example model's warm call: 1.15 s -> 0.28 s).

    Args:
      model: the nnx model.
      *inputs: the model's inputs (`model(*inputs)`), or `loss_fn`'s.
      loss_fn: `loss_fn(model, *inputs) -> scalar`; default `mean(model(*inputs) ** 2)` in
        f32.
      rules: what to analyze (see above), or None.
      key: the key (or an int seed) of the stochastic rounding of dy (default
        `jax.random.key(0)`); layer `i` (in path order) uses `jax.random.fold_in(key, i)`,
        see `analyze_layer`.

    Returns:
      The `ModelReport`.

    Example:
      >>> import jax.numpy as jnp
      >>> from nvfp4_jax import nnx as nvfp4_nnx
      >>> model = nvfp4_nnx.Linear(32, 16, rngs=nnx.Rngs(0))
      >>> report = inspect_model(model, jnp.ones((16, 32)))
      >>> [stats.path for stats in report.layers], report.layers[0].tokens
      ([''], 16)
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"inspect_model: model must be a flax.nnx.Module, got {type(model)}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"inspect_model: loss_fn must be callable or None, got {loss_fn!r}")
    rules = None if rules is None else check_rules(rules, "inspect_model")
    key = as_key(key)
    targets = select_targets(model, rules)
    paths = list(targets.recipes)
    loss, operands = capture(model, paths, loss_fn or default_loss, inputs)
    layers = []
    for index, path in enumerate(paths):
        if path not in operands:
            targets.skipped[path] = "not called in the pass"
            continue
        layer_key = fold_in(key, index)
        for where, flat, x, w, dy in operands[path]:
            name, module_path, slice_key = path, None, layer_key
            if where is not None:  # a slice of a stacked layer: its own GEMM
                name, module_path = f"{path}[{','.join(map(str, where))}]", path
                slice_key = fold_in(layer_key, flat)
            recipe = targets.recipes[path]
            stats = analyze_layer(x, w, dy, recipe=recipe, key=slice_key, path=name)
            layers.append(dataclasses.replace(stats, module_path=module_path))
    return ModelReport(
        layers=tuple(layers),
        loss=float(loss),
        high_precision=tuple(targets.high_precision),
        skipped=dict(targets.skipped),
        rules=rules,
    )
