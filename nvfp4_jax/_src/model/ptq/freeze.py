"""`quantize_for_export`: a copy of a model with its selected linears frozen to NVFP4.

Example:
  >>> import jax
  >>> class MLP(nnx.Module):
  ...     def __init__(self, rngs):
  ...         self.up_proj = nnx.Linear(32, 64, rngs=rngs)
  ...         self.down_proj = nnx.Linear(64, 32, rngs=rngs)
  ...     def __call__(self, x):
  ...         return self.down_proj(jax.nn.relu(self.up_proj(x)))
  >>> model = MLP(nnx.Rngs(0))
  >>> batches = [jax.random.normal(jax.random.key(i), (8, 32)) for i in range(2)]
  >>> frozen, report = quantize_for_export(model, batches, method="gptq")
  >>> report["up_proj"].action, report["down_proj"].action
  ('nvfp4', 'nvfp4')
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4_jax._src.core import formats, ops
from nvfp4_jax._src.core.multihost import to_host
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.flax.walk import DEFAULT_FUSED_GROUPS, layer_paths, replace_layers
from nvfp4_jax._src.model.convert.rules import Rule
from nvfp4_jax._src.model.ptq.calibration import Calibration, calibrate
from nvfp4_jax._src.model.ptq.methods import (
    dequantized,
    group_amax,
    output_error,
    quantize_gptq,
    quantize_max,
    search_amax,
)
from nvfp4_jax._src.model.ptq.report import PTQLayer, PTQReport
from nvfp4_jax._src.model.ptq.select import decide, groups
from nvfp4_jax._src.model.ptq.settings import (
    DEFAULT_GPTQ_DAMP,
    DEFAULT_MSE_GRID,
    OP,
    Settings,
    check_batches,
    check_settings,
)


def _frozen_dtype(layer: nnx.Linear):
    """The dtype the frozen layer computes in: the layer's, else its kernel's."""
    return layer.dtype if layer.dtype is not None else jnp.dtype(layer.kernel[...].dtype)


def _quantize_set(kernels, members, stats, settings: Settings):
    """The arrays of one set sharing a global amax (a fused group, or one layer).

    Returns (arrays, the "max" arrays, the amax used, its factor c, per member damping).
    """
    amax = group_amax(kernels, members)
    maxes = [quantize_max(k, amax, settings.block_2d) for k in kernels]
    factor, used, dampings = 1.0, amax, [None] * len(members)
    if settings.method == "max":
        arrays = maxes
    elif settings.method == "mse":
        factor, used, arrays = search_amax(kernels, amax, settings.block_2d, settings.mse_grid)
    elif settings.method == "four_over_six":
        arrays = [
            ops.quantize(
                k,
                axis=0,
                block_2d=settings.block_2d,
                amax=jnp.float32(amax),
                four_over_six=settings.four_over_six,
                four_over_six_e4m3_max=settings.e4m3_max,
            )
            for k in kernels
        ]
    else:
        arrays, dampings = [], []
        for k, path in zip(kernels, members, strict=True):
            q, damping = quantize_gptq(
                k,
                stats[path].gram,
                amax,
                settings.block_2d,
                settings.damp,
                settings.act_order,
                path,
            )
            arrays.append(q)
            dampings.append(damping)
    return arrays, maxes, used, factor, dampings


def _input_scale(members, stats, settings: Settings) -> tuple[np.float32, np.float32 | None]:
    """(the set's max input amax, W4A4's input scale `amax * RCP2688` or None for W4A16)."""
    input_amax = np.float32(max(stats[p].amax for p in members))
    if settings.activations != "nvfp4":
        return input_amax, None
    if not (np.isfinite(input_amax) and input_amax > 0):
        raise ValueError(
            f"{OP}: the calibrated input amax of {list(members)} is {input_amax}; W4A4 needs "
            "a positive, finite one (calibration inputs that are not all zero)"
        )
    return input_amax, np.float32(input_amax * formats.RCP2688)


def _check_weights(found, selected: list[str]) -> None:
    """One error naming every selected layer whose kernel or bias holds NaN or inf.

    Checked before calibration, which would otherwise blame the inputs such a layer spoils.
    """
    bad = []
    for path in selected:
        layer = found[path][0]
        for name in ("kernel", "bias"):
            variable = getattr(layer, name, None)
            if variable is not None and not bool(jnp.all(jnp.isfinite(variable[...]))):
                bad.append(f"the {name} of {path!r}")
    if bad:
        raise ValueError(
            f"{OP}: {', '.join(bad)} holds NaN or inf; quantize a model with finite weights"
        )


def _entry(path, layer, kernel, q, q_max, stat: Calibration, **fields) -> PTQLayer:
    """The report entry of a frozen layer."""
    w = np.asarray(to_host(kernel), np.float64)
    w_hat, w_max = dequantized(q), dequantized(q_max)
    norm = float(np.sum(np.square(w)))
    seen = stat.rows > 0
    return PTQLayer(
        path=path,
        layer=type(layer).__name__,
        action="nvfp4",
        shape=tuple(kernel.shape),
        weight_error=float(np.sum(np.square(w_hat - w))) / norm if norm else 0.0,
        max_weight_error=float(np.sum(np.square(w_max - w))) / norm if norm else 0.0,
        output_error=output_error(stat.gram, w, w_hat) if seen else None,
        max_output_error=output_error(stat.gram, w, w_max) if seen else None,
        rows=stat.rows,
        **fields,
    )


def _freeze(found, selected, stats, settings: Settings, report: PTQReport) -> list[tuple]:
    """Quantizes every selected layer; returns the (old layer, frozen layer) replacements."""
    in_group = {
        p: tuple(m)
        for m in groups(found, settings.fused_groups).values()
        for p in m
        if p in selected
    }
    replacements = []
    for members in dict.fromkeys(in_group.get(p, (p,)) for p in selected):
        layers = [found[p][0] for p in members]
        kernels = [layer.kernel[...] for layer in layers]
        arrays, maxes, used, factor, dampings = _quantize_set(kernels, members, stats, settings)
        input_amax, input_scale = _input_scale(members, stats, settings)
        for i, path in enumerate(members):
            layer = layers[i]
            report.layers[path] = _entry(
                path,
                layer,
                kernels[i],
                arrays[i],
                maxes[i],
                stats[path],
                method=settings.method,
                group=members if len(members) > 1 else (),
                amax=float(used),
                amax_factor=factor,
                input_amax=float(input_amax if input_scale is not None else stats[path].amax),
                input_scale=None if input_scale is None else float(input_scale),
                damping=dampings[i],
                aliases=found[path][1][1:],
            )
            new = nvfp4_nnx.Linear.from_quantized(
                arrays[i],
                bias=None if layer.bias is None else layer.bias[...],
                input_scale=None if input_scale is None else jnp.float32(input_scale),
                activations=settings.activations,
                dtype=_frozen_dtype(layer),
            )
            replacements.append((layer, new))
    return replacements


def _attention_modules(found) -> dict[str, tuple[str, str]]:
    """`{parent: (its k_proj path, its v_proj path)}` of every module holding both."""
    by_parent: dict[str, dict[str, str]] = {}
    for path in found:
        parent, _, name = path.rpartition("/")
        if name in ("k_proj", "v_proj"):
            by_parent.setdefault(parent, {})[name] = path
    return {p: (m["k_proj"], m["v_proj"]) for p, m in by_parent.items() if len(m) == 2}


def quantize_for_export(
    model: nnx.Module,
    batches: Iterable[Any],
    *,
    method: str = "max",
    rules: Sequence[Rule] | None = None,
    activations: str = "high_precision",
    forward: Callable[[nnx.Module, Any], Any] | None = None,
    block_2d: bool = True,
    fused_groups: Sequence[Sequence[str]] = DEFAULT_FUSED_GROUPS,
    mse_grid: Sequence[float] = DEFAULT_MSE_GRID,
    four_over_six: str = "mse",
    four_over_six_e4m3_max: int = formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
    gptq_damp: float = DEFAULT_GPTQ_DAMP,
    gptq_act_order: bool = False,
    jit: bool = True,
    kv_cache: bool = False,
) -> tuple[nnx.Module, PTQReport]:
    """Post-training quantization: a copy of `model` with its selected linears frozen to NVFP4.

    The rules select layers as for `quantize_model` (first match by module path; a rule with
    recipe None keeps a layer in high precision, an unmatched layer stays as it is; only
    None or not matters, the recipe itself is not used). Each selected `nnx.Linear` (or
    `nvfp4_jax.nnx.Linear` of a quantization-aware model) becomes
    `nvfp4_jax.nnx.Linear.from_quantized(kernel=NVFP4Array, bias=..., input_scale=...,
    activations=...)` computing in the layer's `dtype` (its kernel's when None). Not
    frozen, reported "skipped" with the reason: layers whose sizes are not multiples of 16,
    stacked layers (a (L, in, out) kernel under `nnx.scan`), `nnx.Einsum` and `Experts`
    layers, frozen ones, subclasses. A fused group (siblings under one parent module whose
    names are in one group of `fused_groups`: q/k/v, gate/up) is frozen whole or not at all
    (engines load it all quantized or all not): when a member is not selected or skipped,
    the others are kept in high precision, with the reason.

    Calibration: a copy of the model runs `forward(copy, batch)` for every batch (under
    `nnx.jit` unless `jit=False`), each selected linear accumulating `H = X^T X` (f32) of
    its inputs as it multiplies them, their max |x| and the row count. Memory: one
    (in, in) f32 matrix per selected layer. `H` gives every layer's output error, and GPTQ
    its Hessian.

    Weights (the kernel (in, out) quantized along in, `block_2d`: 16x16 tiles, else 1x16;
    the stored format is plain NVFP4). A fused group shares its global amax A, the max of
    its members' `max |W|` (so its decode scales are equal, as engines need):

    * "max": `quantize(W, axis=0, block_2d=block_2d, amax=A)`: bit for bit what
      `export_hf_checkpoint` writes for the float model.
    * "mse": the same with `amax = f32(c) * A` for every c of `mse_grid` (default 0.70,
      0.71, ..., 1.20; 1 is always tried); the c with the least squared weight error
      (summed over a fused group) wins, ties to the c nearest 1. Below 1 the largest
      values saturate (docs/NUMERICS.md section 6), which the search trades against finer
      steps elsewhere; above 1 the block scales move on the E4M3 grid. Never worse than
      "max" in weight error (c = 1 is "max").
    * "four_over_six": `quantize(..., four_over_six=four_over_six,
      four_over_six_e4m3_max=...)` with the group's A (docs/NUMERICS.md section 13): decode
      scale `A * f32(1/(6M))`, written by the exporter as `weight_scale_2`; bit for bit what
      `export_hf_checkpoint(..., four_over_six=...)` writes for the float model.
    * "gptq": GPTQ (Frantar et al. 2022, arXiv 2210.17323) with NVFP4's block scales. From
      `H` (dead inputs, diag 0, get diag 1 and are rounded to nearest; damping
      `gptq_damp * mean(diag H)`, times 10 while not positive definite) the upper Cholesky
      factor U of H^-1 (NumPy, f64). The input channels run in order (with
      `gptq_act_order`, the 16-channel blocks by decreasing summed diag H, each block's
      channels by decreasing diag H); at the start of every 16-channel block its E4M3
      scales are fixed from the current, error-updated weights exactly as the contract
      computes block scales, with the fixed global amax A (of the original weights); each
      channel is rounded to nearest with them, and its error, divided by U's diagonal, is
      taken off the later channels along U's row. The codes, scales and A form an
      `NVFP4Array` whose dequantization is the GPTQ weight.

    KV cache (`kv_cache=True`): calibration also records the max |y| of every `k_proj` and
    `v_proj` linear whose parent holds both (an attention module, selected or not), and
    `report.kv_cache_amax` maps that parent's path to (k_amax, v_amax): the amaxes of the
    keys and values an NVFP4 KV cache stores, which `export_hf_checkpoint(...,
    kv_cache_amax=report.kv_cache_amax)` writes as vLLM's `k_scale` and `v_scale`. The keys'
    amax is taken before the rotary embedding, which the model applies outside the linear;
    the rotation can raise it by up to sqrt(2), well inside the headroom of the scale's
    `amax / 448` convention (`nvfp4_jax.kv_cache.scale_from_amax`).

    Activations: "high_precision" (W4A16, weight-only) or "nvfp4" (W4A4: the inputs are
    quantized in 1x16 blocks with the static scale `input_scale = f32(input_amax) *
    f32(1/2688)`, input_amax the calibrated max |x|, the max over a fused group, as
    engines quantize the fused layer's input).

    Export: `export_hf_checkpoint(directory, nnx.state(frozen), config=...,
    quant_algo=report.quant_algo)` writes the frozen kernels as they are (their codes,
    scales and decode scales) and, for W4A4, their `input_scale`s; the exporter's default
    `exclude` (lm_head, the embeddings) matches the default rules, which keep those in high
    precision.

    Args:
      model: an nnx model holding `nnx.Linear` layers (bf16/f16/f32 kernels); not changed.
      batches: the calibration inputs, an iterable of batches (each one `forward`'s second
        argument).
      method: "max", "mse", "four_over_six" or "gptq".
      rules: `Rule`s, first match wins; None: `default_rules(0, first=0, last=0)`: the
        embeddings, the output head (`lm_head`, `head`) and a mixture-of-experts router in
        high precision, every other linear quantized.
      activations: "high_precision" (W4A16) or "nvfp4" (W4A4).
      forward: `forward(model, batch)`, called for its side effects (default
        `model(batch)`).
      block_2d: 16x16 weight blocks (the exporter's and the training recipe's default),
        else 1x16 along in.
      fused_groups: the names of sibling linears that share one global amax.
      mse_grid: "mse": the factors c of the global amax to try.
      four_over_six: "four_over_six": the error measure, "mse" or "mae".
      four_over_six_e4m3_max: "four_over_six": M, 256 or 448.
      gptq_damp: "gptq": the damping relative to mean(diag H).
      gptq_act_order: "gptq": process the blocks in activation order (see above).
      jit: run `forward` under `nnx.jit` (False: eagerly).
      kv_cache: also calibrate the KV cache's amaxes (`PTQReport.kv_cache_amax`).

    Returns:
      (the new model, a `PTQReport`).

    Raises:
      TypeError: `model` is not an nnx Module, `rules` not a sequence of `Rule`, `batches`
        not an iterable, `forward` not callable, a flag not a bool, a method option of the
        wrong type.
      ValueError: a bad `method`, `activations` or method option, empty `batches`, no linear
        to quantize (the message lists what became of each layer), two paths of one layer
        matching disagreeing rules, a selected layer's kernel or bias holding NaN or inf
        (checked before calibration), calibration inputs holding NaN or inf as a layer
        multiplies them (every such layer named, with the first such batch) or so large
        that `X^T X` overflows float32, whatever the method; a layer that saw no input
        (GPTQ or W4A4) or whose W4A4 input amax is 0; a GPTQ Hessian not positive definite
        even with damping (raise `gptq_damp`).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{OP}: model must be a flax.nnx.Module, got {type(model).__name__}")
    options = dict(
        mse_grid=mse_grid,
        four_over_six=four_over_six,
        four_over_six_e4m3_max=four_over_six_e4m3_max,
        gptq_damp=gptq_damp,
        gptq_act_order=gptq_act_order,
        jit=jit,
        kv_cache=kv_cache,
    )
    settings = check_settings(method, activations, rules, forward, block_2d, fused_groups, options)
    batches = check_batches(batches)
    frozen = nnx.clone(model)
    found = layer_paths(frozen)
    decided = decide(frozen, found, settings)
    selected = [p for p, (action, _) in decided.items() if action == "nvfp4"]
    _check_weights(found, selected)
    attention = _attention_modules(found) if settings.kv_cache else {}
    observed = list(dict.fromkeys([*selected, *(p for pair in attention.values() for p in pair)]))
    stats = calibrate(model, observed, batches, settings.forward, settings.jit)
    unseen = [p for p in selected if stats[p].rows == 0]
    if unseen and (settings.method == "gptq" or settings.activations == "nvfp4"):
        raise ValueError(
            f"{OP}: {unseen} saw no calibration input (forward never called them); "
            f"{'GPTQ' if settings.method == 'gptq' else 'W4A4'} needs their inputs"
        )
    report = PTQReport(settings.method, settings.activations, settings.block_2d)
    report.kv_cache_amax = {
        parent: (float(stats[k].out_amax), float(stats[v].out_amax))
        for parent, (k, v) in attention.items()
    }
    replacements = _freeze(found, selected, stats, settings, report)
    for reason in replace_layers(frozen, replacements):
        if reason:  # (decide checked that every selected layer can be replaced)
            raise ValueError(f"{OP}: cannot replace a layer of the copy: {reason}")
    for path, (action, reason) in decided.items():
        if action != "nvfp4":
            layer, paths = found[path]
            shape = tuple(layer.kernel.shape) if hasattr(layer, "kernel") else ()
            report.layers[path] = PTQLayer(
                path, type(layer).__name__, action, reason=reason, shape=shape, aliases=paths[1:]
            )
    report.layers = {p: report.layers[p] for p in found}
    report.aliases = {alias: p for p, (_, paths) in found.items() for alias in paths[1:]}
    return frozen, report
