"""Where NVFP4 hurts a model: per-layer quantization errors of the three GEMMs' operands.

`inspect_model(model, *inputs)` runs one forward and backward pass of an nnx model,
captures, for every linear layer that computes (or, under `rules`, would compute) in NVFP4,
the operands of its three GEMMs (x, W, dy), and quantizes each exactly as the layer's
`NVFP4Recipe` does:

| operand    | GEMM  | quantized                                                  |
| `x`        | fprop | 1x16 blocks along K                                        |
| `w`        | fprop | 16x16 tiles (`weight_2d`), else 1x16 along K               |
| `dy`       | dgrad | 1x16 along N, stochastic rounding (SR) if the recipe has it |
| `x_wgrad`  | wgrad | 1x16 along the tokens M, with the RHT (`wgrad_rht`)        |
| `dy_wgrad` | wgrad | 1x16 along the tokens M, with the RHT, SR                  |

Per operand it reports the relative error `||dequantize(q) - x|| / ||x||`, the share of
underflowing 16-blocks, the share of saturated values and the tensor amax; per layer the
relative errors of the NVFP4 fprop and dgrad products and the angle between the NVFP4 weight
gradient and the exact one `x^T dy`, each with and without stochastic rounding. The report
prints as a `rich` table, plots with matplotlib, serializes to JSON, and suggests `Rule`s
that keep the worst layers in high precision (ranked by the weight-gradient angle, or by
the summed relative error of the operands: `ModelReport.scores`).

Definitions (docs/NUMERICS.md's names: `S_enc` the tensor encode scale, `s_b` a block's
E4M3 scale):

* underflow: a block whose values are not all zero but whose scale `s_b` rounds to 0, so
  that it dequantizes to zeros; the share is over all blocks (1x16, or rows of 16x16 tiles).
* saturated: a value with `|x * enc_b| > 6` before rounding, `enc_b = 1 / (s_b / S_enc)`:
  the E4M3 rounding of the block scale went down and the block's largest values clip to 6
  (blocks that underflow are not counted); the share is over all values.
* amax: the tensor amax the operand is quantized with (after the RHT for the wgrad ones).
* angle: `2 asin(|a/|a| - b/|b|| / 2)` in degrees, the angle between two matrices seen as
  vectors (0 for equal directions; 90 if one of them is zero and the other not).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich import box
from rich.console import Console
from rich.table import Table

from nvfp4_jax._src.core import formats, ops, reference
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.model.rules import (
    Rule,
    check_rules,
    experts_problem,
    layer_paths,
    layer_recipe,
    layer_stack,
    linear_problem,
    match_layer,
    named_layers,
    recipe_from_dict,
    recipe_to_dict,
    replace_layers,
    weight_problem,
)
from nvfp4_jax._src.training.dot_general import dot_general, pad_tokens
from nvfp4_jax._src.training.recipe import NVFP4Recipe

_F32 = jnp.float32
_DENSE = (((1,), (0,)), ((), ()))
OPERANDS = ("x", "w", "dy", "x_wgrad", "dy_wgrad")
# The operands' names in the table: the wgrad ones are transposed (quantized along M).
SHORT_NAMES = {"x": "x", "w": "W", "dy": "dy", "x_wgrad": "xᵀ", "dy_wgrad": "dyᵀ"}
SCORES = ("wgrad_angle", "error")


# --- the numbers --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OperandStats:
    """How one GEMM operand fares in NVFP4 (see the module docstring for the definitions).

    Attributes:
      rel_error: `||dequantize(q) - x|| / ||x||` (0 for an all-zero x).
      underflow: the share of 16-blocks with nonzero values whose scale rounds to 0.
      saturated: the share of values clipped to 6 before rounding.
      amax: the tensor amax used (after the RHT for the wgrad operands).
    """

    rel_error: float
    underflow: float
    saturated: float
    amax: float


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """The NVFP4 diagnostics of one linear layer `y = x W` (x: M x K, W: K x N).

    Attributes:
      path: the module path.
      tokens: M, the rows of x over every call of the layer in the pass.
      in_features: K.
      out_features: N.
      recipe: the recipe the operands were quantized with.
      operands: `OperandStats` of `x`, `w`, `dy`, `x_wgrad`, `dy_wgrad`.
      fprop_error: relative error of the NVFP4 `y` against `x W` in f32.
      dgrad_error: relative error of the recipe's NVFP4 `dx` against `dy W^T` in f32.
      dgrad_error_sr: the same with stochastic rounding of dy.
      dgrad_error_rtn: the same with round-to-nearest of dy.
      wgrad_angle: angle (degrees) between the recipe's NVFP4 `dW` and `x^T dy` in f32.
      wgrad_angle_sr: the same with stochastic rounding of dy.
      wgrad_angle_rtn: the same with round-to-nearest of dy.
      module_path: for one slice of a stacked layer (a kernel `(L, K, N)` run under
        `nnx.scan`), the layer's module path (the one rules match), `path` being
        `module_path[i]`; None for a plain layer, whose `path` is its module path.
    """

    path: str
    tokens: int
    in_features: int
    out_features: int
    recipe: NVFP4Recipe
    operands: dict[str, OperandStats]
    fprop_error: float
    dgrad_error: float
    dgrad_error_sr: float
    dgrad_error_rtn: float
    wgrad_angle: float
    wgrad_angle_sr: float
    wgrad_angle_rtn: float
    module_path: str | None = None

    @property
    def rule_path(self) -> str:
        """The module path rules match: `module_path` for a slice, else `path`."""
        return self.path if self.module_path is None else self.module_path

    @property
    def summed_error(self) -> float:
        """The sum of the five operands' relative errors."""
        return sum(stats.rel_error for stats in self.operands.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["recipe"] = recipe_to_dict(self.recipe)
        fields["operands"] = {k: dataclasses.asdict(v) for k, v in self.operands.items()}
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> LayerStats:
        """The inverse of `to_dict`."""
        fields = dict(fields)
        fields["recipe"] = recipe_from_dict(fields["recipe"])
        fields["operands"] = {k: OperandStats(**v) for k, v in fields["operands"].items()}
        return cls(**fields)


def _norm(v: jax.Array) -> jax.Array:
    """The 2-norm of `v` in f32, scaled by max |v| first so that squares do not overflow."""
    scale = jnp.max(jnp.abs(v), initial=_F32(0))
    safe = jnp.where(scale > 0, scale, 1)
    return safe * jnp.linalg.norm((v / safe).ravel())


def _relative(approx: jax.Array, exact: jax.Array) -> jax.Array:
    """`||approx - exact|| / ||exact||` in f32; 0 where both are 0, inf where only exact is."""
    approx, exact = approx.astype(_F32), exact.astype(_F32)
    num, den = _norm(approx - exact), _norm(exact)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), jnp.where(num > 0, jnp.inf, 0))


def angle_degrees(a: jax.Array, b: jax.Array) -> jax.Array:
    """The angle between `a` and `b` as vectors, in degrees (stable near 0).

    `2 asin(|a/|a| - b/|b|| / 2)`: 0 for equal directions, 90 when exactly one is zero.

    Example:
      >>> round(float(angle_degrees(jnp.array([1.0, 0.0]), jnp.array([1.0, 1.0]))), 4)
      45.0
    """
    a, b = a.astype(_F32).ravel(), b.astype(_F32).ravel()
    na, nb = _norm(a), _norm(b)
    chord = _norm(a / jnp.where(na > 0, na, 1) - b / jnp.where(nb > 0, nb, 1))
    angle = jnp.degrees(2 * jnp.arcsin(jnp.clip(chord / 2, 0, 1)))
    one_zero = (na > 0) != (nb > 0)
    return jnp.where(one_zero, _F32(90), jnp.where((na > 0) & (nb > 0), angle, 0))


def _is_seed(key) -> bool:
    return key is None or (isinstance(key, int) and not isinstance(key, bool))


def operand_stats(
    x: jax.Array,
    *,
    axis: int,
    block_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | None = None,
    implementation=None,
    four_over_six: str | None = None,
    four_over_six_e4m3_max: int = formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
) -> dict[str, jax.Array]:
    """The `OperandStats` numbers (as f32 scalars) of `x` quantized as `nvfp4_jax.quantize`.

    Takes `quantize`'s arguments (Four Over Six's too); see the module docstring for the
    definitions.

    Example:
      >>> stats = operand_stats(jnp.linspace(-1.0, 1.0, 64).reshape(4, 16), axis=-1)
      >>> sorted(stats)
      ['amax', 'rel_error', 'saturated', 'underflow']
    """
    flags = dict(
        block_2d=block_2d,
        rht=rht,
        implementation=implementation,
        four_over_six=four_over_six,
        four_over_six_e4m3_max=four_over_six_e4m3_max,
    )
    q = ops.quantize(x, axis=axis, stochastic_rounding=stochastic_rounding, key=key, **flags)
    rel_error = _relative(ops.dequantize(q, _F32, implementation=implementation), x)
    stored = jnp.moveaxis(x, axis, -1)
    if rht:
        stored = ops.apply_rht(stored, implementation=implementation)
    blocks = jnp.abs(stored.astype(_F32)).reshape(*q.scales.shape, formats.BLOCK_SIZE)
    scales = q.scales.astype(_F32)
    underflow = (scales == 0) & (jnp.max(blocks, axis=-1) > 0)
    s_dec = _F32(1) / reference.encode_scale(q.amax, q.e4m3_max)
    encode = jnp.minimum(_F32(1) / (scales * s_dec), _F32(formats.FLT_MAX))
    clipped = (blocks * encode[..., None] > formats.FP4_MAX) & (scales > 0)[..., None]
    return dict(
        rel_error=rel_error,
        underflow=jnp.mean(underflow.astype(_F32)),
        saturated=jnp.mean(clipped.astype(_F32)),
        amax=q.amax,
    )


def _gemms(x, w, dy, key, recipe: NVFP4Recipe) -> tuple[jax.Array, ...]:
    """The NVFP4 (y, dx, dW) of the recipe: `nvfp4_jax.dot_general` and its VJP."""
    y, pullback = jax.vjp(lambda a, b: dot_general(a, b, _DENSE, recipe=recipe, key=key), x, w)
    dx, dw = pullback(dy.astype(y.dtype))
    return y, dx, dw


def _operands(x, w, dy, key, recipe: NVFP4Recipe) -> dict[str, dict[str, jax.Array]]:
    sr, impl = recipe.stochastic_rounding, recipe.implementation
    # The keys `nvfp4_jax.dot_general` gives dgrad's and wgrad's dy.
    dgrad_key, wgrad_key = jax.random.split(key) if sr else (None, None)
    rht = recipe.wgrad_rht
    fos_w, fos_x, fos_dy = (recipe.four_over_six(k) for k in ("weight", "activation", "gradient"))
    return {
        "x": operand_stats(x, axis=1, implementation=impl, **fos_x),
        "w": operand_stats(w, axis=0, block_2d=recipe.weight_2d, implementation=impl, **fos_w),
        "dy": operand_stats(
            dy, axis=1, stochastic_rounding=sr, key=dgrad_key, implementation=impl, **fos_dy
        ),
        "x_wgrad": operand_stats(pad_tokens(x), axis=0, rht=rht, implementation=impl, **fos_x),
        "dy_wgrad": operand_stats(
            pad_tokens(dy), axis=0, rht=rht, stochastic_rounding=sr, key=wgrad_key,
            implementation=impl, **fos_dy,
        ),
    }  # fmt: skip


def _layer_numbers(x, w, dy, key, recipe: NVFP4Recipe) -> dict[str, Any]:
    """Every number of `LayerStats` (f32 scalars), for 2-D x (M, K), w (K, N), dy (M, N)."""
    hi = jax.lax.Precision.HIGHEST
    xf, wf, dyf = x.astype(_F32), w.astype(_F32), dy.astype(_F32)
    exact_y, exact_dx, exact_dw = (
        jnp.matmul(xf, wf, precision=hi),
        jnp.matmul(dyf, wf.T, precision=hi),
        jnp.matmul(xf.T, dyf, precision=hi),
    )
    numbers: dict[str, Any] = {"operands": _operands(x, w, dy, key, recipe)}
    for sr, name in ((True, "sr"), (False, "rtn")):
        variant = dataclasses.replace(recipe, stochastic_rounding=sr)
        y, dx, dw = _gemms(x, w, dy, key, variant)
        numbers[f"dgrad_error_{name}"] = _relative(dx, exact_dx)
        numbers[f"wgrad_angle_{name}"] = angle_degrees(dw, exact_dw)
    numbers["fprop_error"] = _relative(y, exact_y)
    return numbers


def analyze_layer(
    x: jax.Array,
    w: jax.Array,
    dy: jax.Array,
    *,
    recipe: NVFP4Recipe = NVFP4Recipe(),
    key: jax.Array | None = None,
    path: str = "",
) -> LayerStats:
    """The diagnostics of one dense layer from its operands: x (..., K), w (K, N), dy (..., N).

    The operands are taken as the GEMMs see them (x and w in the compute dtype, dy in the
    output's); stochastic rounding uses `key` (a key or an int seed; default
    `jax.random.key(0)`) as `nvfp4_jax.dot_general(..., key=key)` does:
    `jax.random.split(key)` gives dgrad's and wgrad's keys.

    Example:
      >>> x = jax.random.normal(jax.random.key(1), (32, 64))
      >>> w = jax.random.normal(jax.random.key(2), (64, 16))
      >>> stats = analyze_layer(x, w, jnp.ones((32, 16)))
      >>> 0 < stats.operands["x"].rel_error < 0.2, stats.wgrad_angle < 10
      (True, True)
    """
    x, w, dy = jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)
    if w.ndim != 2 or x.shape[-1] != w.shape[0] or dy.shape != (*x.shape[:-1], w.shape[1]):
        raise ValueError(
            f"analyze_layer: needs x (..., K), w (K, N) and dy (..., N), got x {x.shape}, "
            f"w {w.shape}, dy {dy.shape}"
        )
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"analyze_layer: recipe must be an NVFP4Recipe, got {recipe!r}")
    problem = weight_problem(w.shape)
    if problem:
        raise ValueError(f"analyze_layer: {problem}")
    key = jax.random.key(0 if key is None else key) if _is_seed(key) else key
    x2, dy2 = x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1])
    numbers = jax.device_get(_jitted_numbers(x2, w, dy2, key, recipe))
    return _stats_from_numbers(path, x2.shape[0], w.shape, recipe, numbers)


_jitted_numbers = jax.jit(_layer_numbers, static_argnums=4)


def _stats_from_numbers(path, tokens, shape, recipe, numbers) -> LayerStats:
    sr = recipe.stochastic_rounding
    scalars = {k: float(v) for k, v in numbers.items() if k != "operands"}
    operands = {
        name: OperandStats(**{k: float(v) for k, v in values.items()})
        for name, values in numbers["operands"].items()
    }
    return LayerStats(
        path=path,
        tokens=int(tokens),
        in_features=int(shape[0]),
        out_features=int(shape[1]),
        recipe=recipe,
        operands={name: operands[name] for name in OPERANDS},
        dgrad_error=scalars["dgrad_error_sr" if sr else "dgrad_error_rtn"],
        wgrad_angle=scalars["wgrad_angle_sr" if sr else "wgrad_angle_rtn"],
        **scalars,
    )


# --- capturing the operands ---------------------------------------------------------------------


@dataclasses.dataclass
class _Targets:
    """The layers `inspect_model` analyzes, and the others."""

    recipes: dict[str, NVFP4Recipe] = dataclasses.field(default_factory=dict)
    high_precision: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)


def _classify(paths: tuple[str, ...], layer: nnx.Module, rules, targets: _Targets) -> None:
    path = paths[0]
    if rules is None:
        recipe = layer_recipe(layer)
    else:
        found = match_layer(rules, paths, "inspect_model")
        recipe = None if found is None else found[1].recipe
    if recipe is None:
        targets.high_precision.append(path)
        return
    if isinstance(layer, nnx.Linear):
        problem = linear_problem(layer)
    elif isinstance(layer, nvfp4_nnx.Experts):
        problem = experts_problem(layer)
    else:  # an nnx.Einsum: quantize_model applies the rules to it, this pass cannot analyze it
        problem = "an nnx.Einsum layer: only nnx.Linear layers are analyzed"
    if problem:
        targets.skipped[path] = problem
    else:
        targets.recipes[path] = recipe


def _targets(model: nnx.Module, rules) -> _Targets:
    targets = _Targets()
    for layer, paths in layer_paths(model).values():
        _classify(paths, layer, rules, targets)
    return targets


class _Seen(nnx.Variable):
    """What a tap saw in the pass: rows counted, x and W (f32 buffers). Not a parameter."""


class _Probe(nnx.Variable):
    """Zeros added to a tapped layer's output rows: the loss's gradient with respect to it is dy."""


class _Dtypes:
    """Static facts the taps note while traced: per path, the dtypes of x (and W) and of y."""

    def __init__(self):
        self.of: dict[str, tuple[Any, Any]] = {}


class _Tap(nnx.Module):
    """Stands in for a layer in the copy `inspect_model` runs: records x and W, adds a probe.

    An nnx Module whose records are nnx Variables, so that it can be traced through the nnx
    transforms a model applies to its layers (`nnx.remat`, `nnx.scan`, `nnx.vmap`,
    `nnx.jit`): the records flow out as the state updates those transforms carry. Each call
    appends its x rows (flattened to (M, K)) at `rows`, and adds the matching rows of the
    zero probe to the layer's output, whose gradient is dy. A stacked layer (kernel
    `(*stack, K, N)`, see `linear_stack`) gets stacked records: each step of a scan over its
    layer axis writes its own slice. An `Experts` layer gets one record per expert (an
    extra last stack axis G): each expert's tokens go to its own rows. Without buffers (the
    first pass), the tap only counts the rows.
    """

    def __init__(self, layer, path: str, dtypes: _Dtypes, rows: int | None):
        stack = layer_stack(layer)
        if isinstance(layer, nvfp4_nnx.Experts):
            stack = (*stack, layer.num_experts)
        k, n = layer.in_features, layer.out_features
        self.layer, self.path, self.dtypes = layer, path, dtypes
        self.rows = _Seen(jnp.zeros(stack, jnp.int32))
        if rows is None:
            self.x = self.w = self.probe = nnx.data(None)
        else:
            self.x = _Seen(jnp.zeros((*stack, rows, k), _F32))
            self.w = _Seen(jnp.zeros((*stack, k, n), _F32))
            self.probe = _Probe(jnp.zeros((*stack, rows, n), _F32))

    def __call__(self, inputs, *args, **kwargs):
        if isinstance(self.layer, nvfp4_nnx.Experts):
            return self._experts(inputs, *args, **kwargs)
        layer = self.layer
        y = layer(inputs, *args, **kwargs)
        x, w, _ = layer.promote_dtype((inputs, layer.kernel[...], None), dtype=layer.dtype)
        self.dtypes.of[self.path] = (x.dtype, y.dtype)
        x = x.reshape(-1, layer.in_features)
        start = self.rows[...]
        self.rows[...] = start + x.shape[0]
        if self.probe is None:
            return y
        corner = (start, jnp.zeros_like(start))
        self.x[...] = jax.lax.dynamic_update_slice(self.x[...], x.astype(_F32), corner)
        self.w[...] = w.astype(_F32)
        probe = jax.lax.dynamic_slice(self.probe[...], corner, (x.shape[0], y.shape[-1]))
        return y + probe.reshape(y.shape).astype(y.dtype)

    def _experts(self, inputs, group_sizes=None):
        """The tap of an `Experts` layer: each row to its expert's records, at its rows."""
        layer, g = self.layer, self.layer.num_experts
        y = layer(inputs, group_sizes)
        dtype = layer.dtype or jnp.result_type(inputs, layer.kernel[...])
        x, w = inputs.astype(dtype), layer.kernel[...].astype(dtype)
        self.dtypes.of[self.path] = (x.dtype, y.dtype)
        if group_sizes is None:  # dispatched: (G, C, K), expert e's rows are x[e]
            c = x.shape[1]
            expert, position = jnp.repeat(jnp.arange(g), c), jnp.tile(jnp.arange(c), g)
            sizes = jnp.full((g,), c, jnp.int32)
        else:  # sorted by expert; rows past sum(group_sizes) belong to none (expert g)
            sizes = jnp.asarray(group_sizes, jnp.int32)
            ends = jnp.cumsum(sizes)
            rows = jnp.arange(x.shape[0], dtype=jnp.int32)
            expert = jnp.searchsorted(ends, rows, side="right")
            position = rows - (ends - sizes)[jnp.minimum(expert, g - 1)]
        x = x.reshape(-1, layer.in_features)
        start = self.rows[...]
        self.rows[...] = start + sizes
        if self.probe is None:
            return y
        row = start[jnp.minimum(expert, g - 1)] + position
        self.x[...] = self.x[...].at[expert, row].set(x.astype(_F32), mode="drop")
        self.w[...] = w.astype(_F32)
        probe = self.probe[...].at[expert, row].get(mode="fill", fill_value=0)
        return y + probe.reshape(y.shape).astype(y.dtype)


def _default_loss(model, *inputs) -> jax.Array:
    out = model(*inputs)
    return jnp.mean(jnp.square(out.astype(_F32)))


def _split_inputs(inputs: tuple) -> tuple[list, Callable[[list], tuple]]:
    """(the array leaves of `inputs`, a function rebuilding `inputs` from them)."""
    leaves, treedef = jax.tree.flatten(inputs)
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

    def rebuild(arrays: list) -> tuple:
        arrays = iter(arrays)
        return treedef.unflatten(
            [next(arrays) if a else leaf for a, leaf in zip(is_array, leaves, strict=True)]
        )

    return [leaf for a, leaf in zip(is_array, leaves, strict=True) if a], rebuild


def _tapped(graphdef, state, paths, dtypes: _Dtypes, rows: dict | None):
    """A copy of the model whose target layers are taps (with `rows` buffer rows, or none)."""
    model = nnx.merge(graphdef, state, copy=True)

    def tap(layer, path):
        return _Tap(layer, path, dtypes, None if rows is None else rows[path])

    if paths == [""]:  # the model is the layer itself: the loss calls the tap
        return tap(model, "")
    layers = named_layers(model)
    reasons = replace_layers(model, [(layers[p], tap(layers[p], p)) for p in paths])
    for path, reason in zip(paths, reasons, strict=True):
        if reason:
            raise ValueError(f"inspect_model: cannot observe {path!r}: {reason}")
    return model


def _taps(model) -> dict[str, _Tap]:
    return {node.path: node for _, node in nnx.iter_graph(model) if isinstance(node, _Tap)}


def _capture(model, paths, loss_fn, inputs):
    """(loss, {path: [(slice index, flat index, x (M, K), w (K, N), dy (M, N)), ...]}).

    Two passes over a copy: the first counts the rows each tap sees (per slice of a stacked
    layer), the second records x and W into buffers of that size and takes the gradient of
    the loss with respect to the probes. A plain layer has one entry, with slice index None.
    """
    graphdef, state = nnx.split(model)
    arrays, rebuild = _split_inputs(inputs)
    dtypes = _Dtypes()

    def count(state, arrays):
        tapped = _tapped(graphdef, state, paths, dtypes, None)
        loss_fn(tapped, *rebuild(arrays))
        return {path: tap.rows[...] for path, tap in _taps(tapped).items()}

    counts = jax.device_get(jax.jit(count)(state, arrays)) if paths else {}
    sizes = {path: int(np.max(rows, initial=0)) for path, rows in counts.items()}

    def loss_and_grads(state, arrays):
        tapped = _tapped(graphdef, state, paths, dtypes, sizes)
        probe_graphdef, probes, rest = nnx.split(tapped, _Probe, ...)

        def run(probes):
            model = nnx.merge(probe_graphdef, probes, rest, copy=True)
            loss = loss_fn(model, *rebuild(arrays))
            seen = {path: (t.rows[...], t.x[...], t.w[...]) for path, t in _taps(model).items()}
            return jnp.asarray(loss, _F32), seen

        (loss, seen), grads = jax.value_and_grad(run, has_aux=True)(probes)
        dys = {
            path: t.probe[...] for path, t in _taps(nnx.merge(probe_graphdef, grads, rest)).items()
        }
        return loss, seen, dys

    loss, seen, dys = jax.jit(loss_and_grads)(state, arrays)
    operands = {}
    for path in paths:
        rows, xs, ws = (np.asarray(a) for a in seen[path])
        x_dtype, y_dtype = dtypes.of.get(path, (_F32, _F32))
        slices = []
        for flat, index in enumerate(np.ndindex(rows.shape)):  # () for a plain layer
            if rows[index]:
                x = jnp.asarray(xs[index][: rows[index]], x_dtype)
                w = jnp.asarray(ws[index], x_dtype)
                dy = jnp.asarray(np.asarray(dys[path])[index][: rows[index]], y_dtype)
                slices.append((index if rows.shape else None, flat, x, w, dy))
        if slices:  # a layer not called has no operands
            operands[path] = slices
    return loss, operands


# --- the report ---------------------------------------------------------------------------------


_CAPTION = (
    "x, W, dy: relative error of the fprop/dgrad operands; xᵀ, dyᵀ: of the wgrad operands "
    "(along the tokens M, RHT). uflow, sat: the largest share of underflowing blocks and of "
    "saturated values over the operands (and which). ∠dW: angle between the NVFP4 and the "
    "exact weight gradient; dx: relative error of dgrad; each with stochastic rounding (SR) "
    "or round-to-nearest (RTN) of dy."
)


def _exact(path: str) -> str:
    return f"^{re.escape(path)}$"


def _percent(value: float, digits: int = 2) -> str:
    return f"{100 * value:.{digits}f}"


def _worst(stats: LayerStats, field: str) -> str:
    name, value = max(
        ((name, getattr(s, field)) for name, s in stats.operands.items()), key=lambda kv: kv[1]
    )
    return f"{_percent(value)} {SHORT_NAMES[name]}" if value > 0 else "0"


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """What `inspect_model` found: per-layer `LayerStats`, and the layers it left out.

    Attributes:
      layers: the analyzed layers, in path order.
      loss: the loss of the pass.
      high_precision: linear layers that compute (or, under the rules, would compute) in
        high precision: not analyzed.
      skipped: linear layers a rule puts in NVFP4 that cannot be (path -> why).
      rules: the rules the model was inspected under, or None.
    """

    layers: tuple[LayerStats, ...]
    loss: float
    high_precision: tuple[str, ...] = ()
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    rules: tuple[Rule, ...] | None = None

    def __getitem__(self, path: str) -> LayerStats:
        for stats in self.layers:
            if stats.path == path:
                return stats
        raise KeyError(path)

    # -- serialization

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`json.dumps` takes it as is)."""
        return {
            "loss": self.loss,
            "layers": [stats.to_dict() for stats in self.layers],
            "high_precision": list(self.high_precision),
            "skipped": dict(self.skipped),
            "rules": None if self.rules is None else [rule.to_dict() for rule in self.rules],
        }

    def to_json(self, **kwargs) -> str:
        """`json.dumps(self.to_dict(), **kwargs)`."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelReport:
        """The inverse of `to_dict`."""
        rules = data.get("rules")
        return cls(
            layers=tuple(LayerStats.from_dict(layer) for layer in data["layers"]),
            loss=float(data["loss"]),
            high_precision=tuple(data.get("high_precision", ())),
            skipped=dict(data.get("skipped", {})),
            rules=None if rules is None else tuple(Rule.from_dict(rule) for rule in rules),
        )

    @classmethod
    def from_json(cls, text: str) -> ModelReport:
        """The inverse of `to_json`."""
        return cls.from_dict(json.loads(text))

    # -- scores and suggestions

    def scores(self, score: str | Callable[[LayerStats], float] = "wgrad_angle") -> dict:
        """Maps path -> score (larger is worse), for every analyzed layer.

        Args:
          score: "wgrad_angle" (the default: the angle between the recipe's NVFP4 weight
            gradient and the exact one, what the optimizer sees; the NVFP4 paper finds it
            largest in the last blocks), "error" (the summed relative error of the five
            operands), or a function of a `LayerStats`.
        """
        if callable(score):
            return {stats.path: float(score(stats)) for stats in self.layers}
        if score not in SCORES:
            raise ValueError(
                f"ModelReport: score must be one of {SCORES} or callable, got {score!r}"
            )
        field = "summed_error" if score == "error" else "wgrad_angle"
        return {stats.path: float(getattr(stats, field)) for stats in self.layers}

    def suggest_rules(
        self, share: float = 0.1, *, score: str | Callable[[LayerStats], float] = "wgrad_angle"
    ) -> list[Rule]:
        """Rules keeping the worst `share` of the analyzed layers in high precision as well.

        Args:
          share: the share of the analyzed layers (GEMMs) to keep in high precision, in
            [0, 1]; the count is rounded up.
          score: how layers are ranked (`scores`); the worst come first.

        Returns:
          One exact-path rule (`^path$`, recipe None) per kept layer, worst first (a slice
          of a stacked layer keeps the whole stacked layer: one rule for its module path,
          which rules match; the share counts the slices, each a GEMM), followed
          by the rules the model was inspected under (which end with their catch-all), or,
          for a model inspected as it is, by exact-path rules for the layers in high
          precision and for those whose recipe is not the most common one, and a catch-all
          `Rule(".*", most common recipe)`. Pass them to `quantize_model`.
        """
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"suggest_rules: share must be a number in [0, 1], got {share!r}")
        scores = self.scores(score)
        ranked = sorted(scores, key=lambda path: -scores[path])
        count = math.ceil(share * len(ranked) - 1e-9)
        keep = [Rule(_exact(self[path].rule_path), None) for path in ranked[:count]]
        rest = self.rules if self.rules is not None else self._current_rules()
        return [*dict.fromkeys(keep), *rest]

    def _current_rules(self) -> list[Rule]:
        """Rules reproducing the inspected model: its high-precision layers, its recipes."""
        counts = collections.Counter(stats.recipe for stats in self.layers)
        common = counts.most_common(1)[0][0] if counts else NVFP4Recipe()
        rules = [Rule(_exact(path), None) for path in self.high_precision]
        rules += [Rule(_exact(s.rule_path), s.recipe) for s in self.layers if s.recipe != common]
        return [*dict.fromkeys(rules), Rule(".*", common)]

    # -- presentation

    def table(self) -> Table:
        """A `rich` table, one row per layer (the caption explains the columns)."""
        table = Table(title=self._title(), caption=_CAPTION, box=box.SIMPLE_HEAD)
        table.add_column("layer", no_wrap=True)
        headers = ["K×N", *(f"{SHORT_NAMES[n]}\n%" for n in OPERANDS), "uflow\n%", "sat\n%"]
        for header in [*headers, "∠dW°\nSR/RTN", "dx %\nSR/RTN"]:
            table.add_column(header, justify="right", no_wrap=True)
        for s in self.layers:
            table.add_row(
                s.path,
                f"{s.in_features}×{s.out_features}",
                *(_percent(s.operands[name].rel_error, 1) for name in OPERANDS),
                _worst(s, "underflow"),
                _worst(s, "saturated"),
                f"{s.wgrad_angle_sr:.1f}/{s.wgrad_angle_rtn:.1f}",
                f"{_percent(s.dgrad_error_sr, 1)}/{_percent(s.dgrad_error_rtn, 1)}",
            )
        return table

    def _title(self) -> str:
        tokens = sorted({stats.tokens for stats in self.layers})
        span = (
            ""
            if not tokens
            else f"{tokens[0]}"
            if len(tokens) == 1
            else f"{tokens[0]}-{tokens[-1]}"
        )
        count = f", {span} tokens" if span else ""
        return f"NVFP4 diagnostics: {len(self.layers)} layers{count}, loss {self.loss:.4g}"

    def print(self, console: Console | None = None) -> None:
        """Prints `table()` (to `console`, default a new `rich` Console)."""
        (console or Console()).print(self.table())

    def plot(self, path: str) -> str:
        """Draws the per-layer errors and weight-gradient angles into the image file `path`.

        Needs matplotlib (the `examples` extra). Returns `path`.
        """
        from matplotlib.figure import Figure  # noqa: PLC0415  (optional, only needed here)

        names = [stats.path for stats in self.layers]
        positions = list(range(len(names)))
        fig = Figure(figsize=(max(6.0, 0.45 * len(names) + 2), 7), layout="constrained")
        errors, angles = fig.subplots(2, 1, sharex=True)
        for name in OPERANDS:
            values = [100 * stats.operands[name].rel_error for stats in self.layers]
            errors.plot(positions, values, marker="o", label=name)
        errors.set_ylabel("relative error (%)")
        errors.set_title("NVFP4 quantization error of the GEMM operands", pad=24)
        errors.legend(
            ncols=len(OPERANDS), fontsize="small", loc="lower left", bbox_to_anchor=(0, 1.0)
        )
        for offset, label in ((-0.2, "SR"), (0.2, "RTN")):
            field = f"wgrad_angle_{label.lower()}"
            values = [getattr(stats, field) for stats in self.layers]
            angles.bar([p + offset for p in positions], values, 0.4, label=label)
        angles.set_xlim(-0.6, len(names) - 0.4)
        angles.set_ylabel("wgrad angle (degrees)")
        angles.set_title("angle between the NVFP4 and the exact weight gradient")
        angles.legend(fontsize="small")
        angles.set_xticks(positions, names, rotation=60, ha="right", fontsize="small")
        fig.savefig(path, dpi=100)
        return path


# --- the entry point ----------------------------------------------------------------------------


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
    key = jax.random.key(0 if key is None else key) if _is_seed(key) else key
    targets = _targets(model, rules)
    paths = list(targets.recipes)
    loss, operands = _capture(model, paths, loss_fn or _default_loss, inputs)
    layers = []
    for index, path in enumerate(paths):
        if path not in operands:
            targets.skipped[path] = "not called in the pass"
            continue
        layer_key = jax.random.fold_in(key, index)
        for where, flat, x, w, dy in operands[path]:
            name, module_path, slice_key = path, None, layer_key
            if where is not None:  # a slice of a stacked layer: its own GEMM
                name, module_path = f"{path}[{','.join(map(str, where))}]", path
                slice_key = jax.random.fold_in(layer_key, flat)
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
