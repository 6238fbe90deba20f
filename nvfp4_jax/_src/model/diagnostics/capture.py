"""Capturing the operands: which layers `inspect_model` analyzes, and their x, W and dy.

A copy of the model runs with each analyzed layer wrapped in a tap (an nnx Module) that
records its input x and weight W and adds a zero probe to its output, whose gradient is dy.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.flax.layer_info import (
    experts_problem,
    layer_recipe,
    layer_stack,
    linear_problem,
)
from nvfp4_jax._src.flax.walk import layer_paths, named_layers, replace_layers
from nvfp4_jax._src.model.convert.rules import match_layer
from nvfp4_jax._src.training.recipe import NVFP4Recipe

_F32 = jnp.float32


@dataclasses.dataclass
class Targets:
    """The layers `inspect_model` analyzes, and the others."""

    recipes: dict[str, NVFP4Recipe] = dataclasses.field(default_factory=dict)
    high_precision: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)


def _classify(paths: tuple[str, ...], layer: nnx.Module, rules, targets: Targets) -> None:
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


def select_targets(model: nnx.Module, rules) -> Targets:
    """The layers of `model` to analyze (under `rules`, or as they are), and the others."""
    targets = Targets()
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


def default_loss(model, *inputs) -> jax.Array:
    """`inspect_model`'s default loss: `mean(model(*inputs) ** 2)` in f32."""
    out = model(*inputs)
    return jnp.mean(jnp.square(out.astype(_F32)))


def _split_inputs(inputs: tuple) -> tuple[list, _Inputs]:
    """The array leaves of `inputs`, and the rest of them.

    The rest is an `_Inputs`: hashable when the non-array leaves are, and holding no array.
    """
    leaves, treedef = jax.tree.flatten(inputs)
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]
    pairs = zip(is_array, leaves, strict=True)
    # A static leaf's type is part of the key: 1, 1.0 and True are equal but trace apart.
    statics = tuple((True, None, None) if a else (False, type(leaf), leaf) for a, leaf in pairs)
    arrays = [leaf for a, leaf in zip(is_array, leaves, strict=True) if a]
    return arrays, _Inputs(treedef, statics)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The structure and the non-array leaves of `inspect_model`'s inputs."""

    treedef: Any
    statics: tuple

    def rebuild(self, arrays: list) -> tuple:
        """The inputs, with `arrays` in the array leaves' places."""
        arrays = iter(arrays)
        leaves = [next(arrays) if is_array else leaf for is_array, _, leaf in self.statics]
        return self.treedef.unflatten(leaves)


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


@dataclasses.dataclass(frozen=True)
class _Programs:
    """The two compiled passes of `capture` for one model graph, paths, loss and input types."""

    count: Callable
    loss_and_grads: Callable
    dtypes: _Dtypes


def _programs(graphdef, paths: tuple[str, ...], loss_fn, inputs: _Inputs) -> _Programs:
    dtypes = _Dtypes()

    def count(state, arrays):
        tapped = _tapped(graphdef, state, list(paths), dtypes, None)
        loss_fn(tapped, *inputs.rebuild(arrays))
        return {path: tap.rows[...] for path, tap in _taps(tapped).items()}

    def loss_and_grads(state, arrays, sizes: tuple):
        tapped = _tapped(graphdef, state, list(paths), dtypes, dict(sizes))
        probe_graphdef, probes, rest = nnx.split(tapped, _Probe, ...)

        def run(probes):
            model = nnx.merge(probe_graphdef, probes, rest, copy=True)
            loss = loss_fn(model, *inputs.rebuild(arrays))
            seen = {path: (t.rows[...], t.x[...], t.w[...]) for path, t in _taps(model).items()}
            return jnp.asarray(loss, _F32), seen

        (loss, seen), grads = jax.value_and_grad(run, has_aux=True)(probes)
        dys = {
            path: t.probe[...] for path, t in _taps(nnx.merge(probe_graphdef, grads, rest)).items()
        }
        return loss, seen, dys

    return _Programs(jax.jit(count), jax.jit(loss_and_grads, static_argnums=2), dtypes)


# The programs of the latest calls (least recently used first): a model inspected again (the
# same graph, paths, loss function and input types, e.g. every N steps of a training run)
# reuses its compiled passes instead of tracing and compiling them anew. Each entry holds a
# graph definition and two compiled programs, no array.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_MAX_PROGRAMS = 8


def _avals(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(
        (np.shape(a), str(getattr(a, "dtype", type(a))), bool(getattr(a, "weak_type", False)))
        for a in leaves
    )


def _cached_programs(graphdef, paths, loss_fn, inputs: _Inputs, state, arrays) -> _Programs:
    """`_programs` for these arguments, from `_PROGRAMS` when an earlier call made them.

    The key holds the types of the state and the input arrays: the taps note their layers'
    dtypes while traced, so one entry serves exactly one trace. Arguments that cannot be
    hashed (a non-array input leaf such as a list) are compiled anew each time.
    """
    key = (graphdef, tuple(paths), loss_fn, inputs, _avals(state), _avals(arrays))
    try:
        hash(key)
    except TypeError:
        return _programs(graphdef, tuple(paths), loss_fn, inputs)
    if key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return _PROGRAMS[key]
    programs = _programs(graphdef, tuple(paths), loss_fn, inputs)
    _PROGRAMS[key] = programs
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return programs


def capture(model, paths, loss_fn, inputs):
    """(loss, {path: [(slice index, flat index, x (M, K), w (K, N), dy (M, N)), ...]}).

    Two passes over a copy: the first counts the rows each tap sees (per slice of a stacked
    layer), the second records x and W into buffers of that size and takes the gradient of
    the loss with respect to the probes. A plain layer has one entry, with slice index None.
    Both passes are compiled once per model graph, paths, loss function and input types
    (`_cached_programs`).
    """
    graphdef, state = nnx.split(model)
    arrays, structure = _split_inputs(inputs)
    programs = _cached_programs(graphdef, paths, loss_fn, structure, state, arrays)
    counts = jax.device_get(programs.count(state, arrays)) if paths else {}
    sizes = {path: int(np.max(rows, initial=0)) for path, rows in counts.items()}
    loss, seen, dys = programs.loss_and_grads(state, arrays, tuple(sorted(sizes.items())))
    dtypes = programs.dtypes
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
