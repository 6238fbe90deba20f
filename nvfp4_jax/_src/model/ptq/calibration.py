"""Calibration: the inputs each linear multiplies (`X^T X`, max |x|, rows) and its max |y|.

The max |y| of `k_proj` and `v_proj` are the amaxes of the keys and values a KV cache stores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4_jax._src.core.multihost import to_host
from nvfp4_jax._src.flax.walk import named_layers, replace_layers
from nvfp4_jax._src.model.ptq.settings import OP

_F32 = jnp.float32


class _Stat(nnx.Variable):
    """A calibration statistic a `_Recorder` accumulates (not a parameter)."""


class _Recorder(nnx.Module):
    """Stands in for a linear in the calibration copy: records `X^T X`, max |x|, rows, max |y|.

    x is the input as the layer multiplies it (promoted to its `dtype`), flattened to
    (rows, in). The statistics are nnx Variables, so they flow out of `nnx.jit` (and of the
    other nnx transforms) as state updates; `batch`, shared by every recorder, is the index
    of the batch running, kept in `first_bad` the first time x holds NaN or inf. Other
    attributes are the layer's (model code reading `kernel` or `in_features` of a layer
    keeps working).
    """

    def __init__(self, layer: nnx.Linear, batch: _Stat):
        k = layer.in_features
        self.layer = layer
        self.batch = batch
        self.gram = _Stat(jnp.zeros((k, k), _F32))
        self.amax = _Stat(jnp.zeros((), _F32))
        self.rows = _Stat(jnp.zeros((), jnp.int32))
        self.out_amax = _Stat(jnp.zeros((), _F32))
        self.first_bad = _Stat(jnp.full((), -1, jnp.int32))

    def __call__(self, inputs, *args, **kwargs):
        layer = self.layer
        x, _, _ = layer.promote_dtype((inputs, layer.kernel[...], None), dtype=layer.dtype)
        x = jax.lax.stop_gradient(x).astype(_F32).reshape(-1, layer.in_features)
        gram = jnp.dot(x.T, x, precision=jax.lax.Precision.HIGHEST, preferred_element_type=_F32)
        self.gram[...] = self.gram[...] + gram
        self.amax[...] = jnp.maximum(self.amax[...], jnp.max(jnp.abs(x), initial=_F32(0)))
        self.rows[...] = self.rows[...] + x.shape[0]
        first = self.first_bad[...]
        bad = (first < 0) & ~jnp.all(jnp.isfinite(x))
        self.first_bad[...] = jnp.where(bad, self.batch[...], first)
        y = layer(inputs, *args, **kwargs)
        out = jnp.max(jnp.abs(jax.lax.stop_gradient(y).astype(_F32)), initial=_F32(0))
        self.out_amax[...] = jnp.maximum(self.out_amax[...], out)
        return y

    def __getattr__(self, name: str):
        if name == "layer":  # not set yet (the graph builds the object before its fields)
            raise AttributeError(name)
        return getattr(self.layer, name)


@dataclasses.dataclass
class Calibration:
    """What one layer saw in calibration: `X^T X`, max |x|, the rows and max |y|.

    `first_bad`: the index of the first batch whose inputs to the layer held NaN or inf, -1
    if none did. `out_amax`: the max |y| of its outputs (as the layer computed them).
    """

    gram: np.ndarray  # (in, in) f64, X^T X
    amax: np.float32
    rows: int
    first_bad: int = -1
    out_amax: np.float32 = np.float32(0)


def calibrate(
    model: nnx.Module, paths: Sequence[str], batches: list, forward: Callable, jit: bool
) -> dict[str, Calibration]:
    """Runs the batches through a copy of `model` whose layers at `paths` record their inputs.

    Raises:
      ValueError: a layer's inputs held NaN or inf (named with the first such batch), or
        overflowed f32 in `X^T X`: statistics that neither GPTQ's Hessian, W4A4's input
        scale nor the report's output error can use.
    """
    copy = nnx.clone(model)
    layers = named_layers(copy)
    batch = _Stat(jnp.zeros((), jnp.int32))
    recorders = {path: _Recorder(layers[path], batch) for path in paths}
    reasons = replace_layers(copy, [(layers[p], recorders[p]) for p in paths])
    for path, reason in zip(paths, reasons, strict=True):
        if reason:  # (checked on the output copy before; the two copies are alike)
            raise ValueError(f"{OP}: cannot observe {path!r}: {reason}")

    def run(model, batch) -> None:
        forward(model, batch)

    step = nnx.jit(run) if jit else run
    for index, value in enumerate(batches):
        batch[...] = jnp.int32(index)
        step(copy, value)
    stats = {
        path: Calibration(
            gram=np.asarray(to_host(r.gram[...]), np.float64),
            amax=np.float32(to_host(r.amax[...])),
            rows=int(to_host(r.rows[...])),
            first_bad=int(to_host(r.first_bad[...])),
            out_amax=np.float32(to_host(r.out_amax[...])),
        )
        for path, r in recorders.items()
    }
    _check_finite(stats)
    return stats


def _check_finite(stats: dict[str, Calibration]) -> None:
    """One error naming every layer whose inputs held NaN or inf, or overflowed `X^T X`."""
    bad = [f"{p!r} (batch {s.first_bad})" for p, s in stats.items() if s.first_bad >= 0]
    overflow = [p for p, s in stats.items() if s.first_bad < 0 and not np.all(np.isfinite(s.gram))]
    problems = []
    if bad:
        problems.append(
            f"the calibration inputs of {', '.join(bad)} hold NaN or inf as the layers "
            "multiply them (in their dtype): pass finite batches, or look for the layer "
            "before them whose output is not finite"
        )
    if overflow:
        largest = max(float(stats[p].amax) for p in overflow)
        problems.append(
            f"the calibration inputs of {', '.join(map(repr, overflow))} overflow float32 in "
            f"X^T X (max |x| = {largest:g}): pass inputs of the model's usual range"
        )
    if problems:
        raise ValueError(f"{OP}: {'; and '.join(problems)}")
