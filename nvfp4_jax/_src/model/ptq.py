"""Post-training quantization: an nnx model's linear layers frozen to NVFP4, ready to export.

`quantize_for_export(model, batches, method=...)` takes a model trained in high precision
(plain `nnx.Linear` layers, or `nvfp4_jax.nnx.Linear` ones of a quantization-aware run), runs
the calibration batches through a copy of it, and returns a new model in which every linear
the rules select is an `nvfp4_jax.nnx.Linear.from_quantized` layer holding an `NVFP4Array`
kernel (weight-only, "W4A16", or with a static activation scale, "W4A4"), together with a
`PTQReport`. The new model computes what an engine serving its export computes, and
`export_hf_checkpoint(directory, nnx.state(frozen), config=...)` writes it as it is (the
NVFP4 kernels pass through unchanged, with their scales).

Every method writes plain NVFP4 (docs/NUMERICS.md sections 2-4): packed E2M1 codes, E4M3
block scales (1x16 along `in`, or 16x16 tiles) and one f32 global amax `A` per tensor, with
the decode factor `D` engines read as `weight_scale_2`. They differ in how they choose them:

* "max": round to nearest with `A = max |W|` (of the fused group): what the exporter writes
  for the float model, bit for bit.
* "mse": searches `A = c * max |W|` over a grid of c (values above `A` saturate) for the
  least squared weight error.
* "four_over_six": Four Over Six (section 13): each block keeps the better of its amax
  mapped to 6 or to 4.
* "gptq": GPTQ (Frantar et al. 2022): rounds the input channels in order, pushing each
  channel's error onto the later ones through the inverse Hessian `H = X^T X` of the
  layer's calibration inputs.

Fused groups (q/k/v, gate/up: siblings engines fuse into one layer) share one global amax,
hence one decode scale, as engines need. A fused group is quantized whole or kept whole in
high precision.

Example:
  >>> class MLP(nnx.Module):
  ...     def __init__(self, rngs):
  ...         self.up_proj = nnx.Linear(32, 64, rngs=rngs)
  ...         self.down_proj = nnx.Linear(64, 32, rngs=rngs)
  ...     def __call__(self, x):
  ...         return self.down_proj(jax.nn.relu(self.up_proj(x)))
  >>> model = MLP(nnx.Rngs(0))
  >>> batches = [jax.random.normal(jax.random.key(i), (8, 32)) for i in range(2)]
  >>> frozen, report = quantize_for_export(model, batches, method="gptq")
  >>> type(frozen.up_proj).__module__, report["down_proj"].action
  ('nvfp4_jax.nnx', 'nvfp4')
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich import box
from rich.console import Console
from rich.table import Table

from nvfp4_jax._src.core import formats, ops
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.reference.quantize import (
    block_amax,
    block_encode,
    encode_scale,
    quantized_array,
)
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.io.hf.names import DEFAULT_FUSED_GROUPS
from nvfp4_jax._src.io.storage import to_host
from nvfp4_jax._src.model.rules import (
    Rule,
    check_rules,
    default_rules,
    layer_paths,
    layer_stack,
    linear_problem,
    match_layer,
    named_layers,
    replace_layers,
)

_F32 = jnp.float32
_OP = "quantize_for_export"

METHODS = ("max", "mse", "four_over_six", "gptq")
ACTIVATIONS = ("high_precision", "nvfp4")
# The global-amax factors c the "mse" method tries: 0.70, 0.71, ..., 1.20 (1 is always in).
DEFAULT_MSE_GRID = tuple(round(0.70 + 0.01 * i, 2) for i in range(51))
DEFAULT_GPTQ_DAMP = 0.01
# How often GPTQ multiplies its damping by 10 when H + damping is not positive definite.
_DAMP_RETRIES = 6


# --- the report ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PTQLayer:
    """What `quantize_for_export` did with one layer.

    Errors are relative: `||W_hat - W||^2 / ||W||^2` for the weight (the (in, out) kernel)
    and `||X W_hat - X W||^2 / ||X W||^2` for the output on the calibration inputs X
    (computed from `H = X^T X`: `tr(dW^T H dW) / tr(W^T H W)`); the `max_` ones are those of
    the "max" method (round to nearest with the tensor's or group's max amax), for
    comparison.

    Attributes:
      path: the "/"-joined module path.
      layer: the layer's class name.
      action: "nvfp4" (frozen to NVFP4), "high_precision" (a rule with recipe None, or a
        fused sibling kept so), "unmatched" (no rule matched: left as it was) or "skipped"
        (selected but not quantizable: left as it was, see `reason`).
      method: the method ("nvfp4" only).
      reason: why a layer was skipped or kept in high precision beyond its rule.
      shape: the kernel's (in, out).
      group: the paths sharing the global amax (a fused group), this one included.
      amax: the global amax A the weight was quantized with (c times the group's max for
        "mse"; the group's max otherwise).
      amax_factor: c of "mse" (1.0 for the other methods).
      weight_error, max_weight_error: relative weight errors.
      output_error, max_output_error: relative output errors on the calibration inputs
        (None when the layer saw no input).
      input_amax: the calibrated max |x| of the inputs (the fused group's max for W4A4).
      input_scale: W4A4's static activation scale, `input_amax * f32(1/2688)`.
      damping: GPTQ's damping `lambda` added to diag(H), relative to mean(diag H).
      rows: calibration rows (tokens) the layer saw.
      aliases: the other paths of a layer held at several paths.
    """

    path: str
    layer: str
    action: str
    method: str | None = None
    reason: str = ""
    shape: tuple[int, ...] = ()
    group: tuple[str, ...] = ()
    amax: float | None = None
    amax_factor: float | None = None
    weight_error: float | None = None
    max_weight_error: float | None = None
    output_error: float | None = None
    max_output_error: float | None = None
    input_amax: float | None = None
    input_scale: float | None = None
    damping: float | None = None
    rows: int = 0
    aliases: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PTQReport:
    """Per module path, what `quantize_for_export` did (a `PTQLayer`), and the settings.

    Index it by path (`report["layers/0/mlp/up_proj"]`, an alias works too); `paths(action)`
    lists the paths of one action; `quant_algo` is what to pass to `export_hf_checkpoint`.
    """

    method: str
    activations: str
    block_2d: bool
    layers: dict[str, PTQLayer] = dataclasses.field(default_factory=dict)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def quant_algo(self) -> str:
        """`export_hf_checkpoint`'s `quant_algo`: "NVFP4" (W4A4) or "W4A16_NVFP4" (W4A16)."""
        return "NVFP4" if self.activations == "nvfp4" else "W4A16_NVFP4"

    def __getitem__(self, path: str) -> PTQLayer:
        return self.layers[self.aliases.get(path, path)]

    def __contains__(self, path: object) -> bool:
        return path in self.layers or path in self.aliases

    def __len__(self) -> int:
        return len(self.layers)

    def paths(self, action: str) -> list[str]:
        """The paths of the layers whose action is `action`, in path order."""
        return [path for path, entry in self.layers.items() if entry.action == action]

    def mean(self, field: str) -> float | None:
        """The mean of a `PTQLayer` error field over the quantized layers (None if none)."""
        values = [getattr(self.layers[p], field) for p in self.paths("nvfp4")]
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the settings and path -> `PTQLayer.to_dict()`."""
        return {
            "method": self.method,
            "activations": self.activations,
            "block_2d": self.block_2d,
            "quant_algo": self.quant_algo,
            "layers": {path: entry.to_dict() for path, entry in self.layers.items()},
        }

    def to_json(self, **kwargs) -> str:
        """`to_dict()` as JSON (`kwargs` go to `json.dumps`, default `indent=1`)."""
        return json.dumps(self.to_dict(), **{"indent": 1, **kwargs})

    def table(self) -> Table:
        """A rich table: one row per layer, errors in percent."""
        table = Table(
            title=f"quantize_for_export: {self.method}, "
            f"{'W4A4' if self.activations == 'nvfp4' else 'W4A16'}, "
            f"{'16x16' if self.block_2d else '1x16'} weight blocks",
            caption="W err, out err: relative squared error of the weight and of the layer's "
            "output on the calibration inputs, in %; (max): the same for round-to-nearest "
            "with the max amax",
            box=box.SIMPLE_HEAD,
        )
        columns = ("path", "method", "in x out", "amax (c)", "W err", "(max)", "out err", "(max)")
        for column in columns:
            table.add_column(column, justify="left" if column in ("path", "method") else "right")
        for path, e in self.layers.items():
            if e.action != "nvfp4":
                table.add_row(path, e.action, _shape(e.shape), e.reason, "", "", "", "")
                continue
            table.add_row(
                path,
                e.method,
                _shape(e.shape),
                f"{e.amax:.4g} ({e.amax_factor:g})",
                _percent(e.weight_error),
                _percent(e.max_weight_error),
                _percent(e.output_error),
                _percent(e.max_output_error),
            )
        return table

    def print(self, console: Console | None = None) -> None:
        """Prints `table()`."""
        (console or Console()).print(self.table())

    def __str__(self) -> str:
        console = Console(width=160, record=True, file=io.StringIO())
        console.print(self.table())
        return console.export_text()


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(map(str, shape)) if shape else ""


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.3f}"


# --- calibration --------------------------------------------------------------------------


class _Stat(nnx.Variable):
    """A calibration statistic a `_Recorder` accumulates (not a parameter)."""


class _Recorder(nnx.Module):
    """Stands in for a linear in the calibration copy: accumulates `X^T X`, max |x| and rows.

    x is the input as the layer multiplies it (promoted to its `dtype`), flattened to
    (rows, in). The statistics are nnx Variables, so they flow out of `nnx.jit` (and of the
    other nnx transforms) as state updates. Other attributes are the layer's (model code
    reading `kernel` or `in_features` of a layer keeps working).
    """

    def __init__(self, layer: nnx.Linear):
        k = layer.in_features
        self.layer = layer
        self.gram = _Stat(jnp.zeros((k, k), _F32))
        self.amax = _Stat(jnp.zeros((), _F32))
        self.rows = _Stat(jnp.zeros((), jnp.int32))

    def __call__(self, inputs, *args, **kwargs):
        layer = self.layer
        x, _, _ = layer.promote_dtype((inputs, layer.kernel[...], None), dtype=layer.dtype)
        x = jax.lax.stop_gradient(x).astype(_F32).reshape(-1, layer.in_features)
        gram = jnp.dot(x.T, x, precision=jax.lax.Precision.HIGHEST, preferred_element_type=_F32)
        self.gram[...] = self.gram[...] + gram
        self.amax[...] = jnp.maximum(self.amax[...], jnp.max(jnp.abs(x), initial=_F32(0)))
        self.rows[...] = self.rows[...] + x.shape[0]
        return layer(inputs, *args, **kwargs)

    def __getattr__(self, name: str):
        if name == "layer":  # not set yet (the graph builds the object before its fields)
            raise AttributeError(name)
        return getattr(self.layer, name)


@dataclasses.dataclass
class _Calibration:
    gram: np.ndarray  # (in, in) f64, X^T X
    amax: np.float32
    rows: int


def _default_forward(model, batch) -> Any:
    return model(batch)


def _calibrate(
    model: nnx.Module, paths: Sequence[str], batches: list, forward: Callable, jit: bool
) -> dict[str, _Calibration]:
    """Runs the batches through a copy of `model` whose layers at `paths` record their inputs."""
    copy = nnx.clone(model)
    layers = named_layers(copy)
    recorders = {path: _Recorder(layers[path]) for path in paths}
    reasons = replace_layers(copy, [(layers[p], recorders[p]) for p in paths])
    for path, reason in zip(paths, reasons, strict=True):
        if reason:  # (checked on the output copy before; the two copies are alike)
            raise ValueError(f"{_OP}: cannot observe {path!r}: {reason}")

    def run(model, batch) -> None:
        forward(model, batch)

    step = nnx.jit(run) if jit else run
    for batch in batches:
        step(copy, batch)
    return {
        path: _Calibration(
            gram=np.asarray(to_host(r.gram[...]), np.float64),
            amax=np.float32(to_host(r.amax[...])),
            rows=int(to_host(r.rows[...])),
        )
        for path, r in recorders.items()
    }


# --- the methods --------------------------------------------------------------------------


def _group_amax(kernels: Sequence[jax.Array], paths: Sequence[str]) -> np.float32:
    """The group's max of `max |W|`, as `export_hf_checkpoint` computes it."""
    amaxes = []
    for kernel, path in zip(kernels, paths, strict=True):
        amax = np.float32(to_host(ops.tensor_amax(kernel, axis=0)))
        if not np.isfinite(amax):
            raise ValueError(f"{_OP}: the kernel of {path!r} holds NaN or inf")
        amaxes.append(amax)
    return np.float32(max(amaxes))


def _dequantized(q: NVFP4Array) -> np.ndarray:
    return np.asarray(to_host(ops.dequantize(q, _F32)), np.float64)


def _squared_error(q: NVFP4Array, w: np.ndarray) -> float:
    return float(np.sum(np.square(_dequantized(q) - w)))


def _quantize_max(kernel, amax: np.float32, block_2d: bool) -> NVFP4Array:
    return ops.quantize(kernel, axis=0, block_2d=block_2d, amax=jnp.float32(amax))


def _search_amax(kernels, amax: np.float32, block_2d: bool, grid: Sequence[float]):
    """("mse") The factor c and arrays of the least summed squared weight error.

    Tries `c * A` (an f32 product) for every c of `grid`, nearest to 1 first; a later c
    wins only with a strictly smaller error, so ties keep the c nearest to 1.
    """
    weights = [np.asarray(to_host(k), np.float64) for k in kernels]
    best = None
    for c in sorted(grid, key=lambda c: (abs(c - 1.0), c)):
        scaled = np.float32(c) * amax
        arrays = [_quantize_max(k, scaled, block_2d) for k in kernels]
        error = sum(_squared_error(q, w) for q, w in zip(arrays, weights, strict=True))
        if best is None or error < best[0]:
            best = (error, float(c), scaled, arrays)
    return best[1], best[2], best[3]


@functools.partial(jax.jit, static_argnames=("block_2d",))
def _gptq_codes(w: jax.Array, u: jax.Array, amax: jax.Array, *, block_2d: bool):
    """GPTQ's rounding of the stored weight `w` (out N, in K) f32 with the fixed global `amax`.

    `u` (K, K) f32 is the upper Cholesky factor of H^-1 (`H^-1 = u^T u`, zeros below the
    diagonal). The input channels (columns) run in order, in K-blocks of 16. At the start of
    a K-block its E4M3 scales are fixed from the current (error-updated) weights exactly as
    docs/NUMERICS.md section 2 steps 3-4 compute block scales (per output row, or per 16x16
    tile over 16 rows with `block_2d`), with `S_enc` of `amax`; then each column in turn
    rounds to the nearest E2M1 code with that scale (step 5; values above the scale's range
    saturate at 6), and its error `(w - q) / u[j, j]` is taken off the later columns
    (`w[:, l] -= err * u[j, l]`): within the block at once, beyond it after the block.

    Returns (codes uint8 (N, K) unpacked, scales float8_e4m3fn (N, K/16)).
    """
    n, k = w.shape
    size = formats.BLOCK_SIZE
    s_enc = encode_scale(amax)
    s_dec = _F32(1) / s_enc
    d = formats.decode_scale(amax)

    def block(b, carry):
        w, codes, scales = carry
        start = b * size
        wb = jax.lax.dynamic_slice(w, (0, start), (n, size))
        ub = jax.lax.dynamic_slice(u, (start, start), (size, size))
        block_max = block_amax(wb.reshape(n, 1, size), block_2d)[:, 0]  # tiles over 16 rows
        scaled = jnp.minimum(block_max * (s_enc * _F32(formats.RCP6)), _F32(formats.E4M3_MAX))
        s = scaled.astype(jnp.float8_e4m3fn)
        encode = block_encode(s, s_dec)
        factor = s.astype(_F32) * d

        def column(j, inner):
            wb, errors, block_codes = inner
            x = jax.lax.dynamic_index_in_dim(wb, j, axis=1, keepdims=False)
            y = x * encode
            magnitude = formats.e2m1_magnitude_code(jnp.abs(y))
            code = magnitude | (jnp.signbit(y).astype(jnp.uint8) << 3)
            q = formats.scaled_code_values(code, factor)  # exactly what dequantize gives
            row = jax.lax.dynamic_index_in_dim(ub, j, axis=0, keepdims=False)
            error = (x - q) / row[j]
            # Columns < j are done (u is upper triangular: row[:j] = 0); column j is read.
            wb = wb - error[:, None] * row[None, :]
            errors = jax.lax.dynamic_update_index_in_dim(errors, error, j, axis=1)
            block_codes = jax.lax.dynamic_update_index_in_dim(block_codes, code, j, axis=1)
            return wb, errors, block_codes

        inner = (wb, jnp.zeros((n, size), _F32), jnp.zeros((n, size), jnp.uint8))
        _, errors, block_codes = jax.lax.fori_loop(0, size, column, inner)
        rows = jax.lax.dynamic_slice(u, (start, 0), (size, k))
        # Columns before the block get zeros (u upper triangular), the block's are done.
        w = w - jnp.dot(errors, rows, precision=jax.lax.Precision.HIGHEST)
        codes = jax.lax.dynamic_update_slice(codes, block_codes, (0, start))
        scales = jax.lax.dynamic_update_slice(scales, s[:, None], (0, b))
        return w, codes, scales

    codes = jnp.zeros((n, k), jnp.uint8)
    scales = jnp.zeros((n, k // size), jnp.float8_e4m3fn)
    _, codes, scales = jax.lax.fori_loop(0, k // size, block, (w, codes, scales))
    return codes, scales


def _inverse_hessian_factor(gram: np.ndarray, damp: float) -> tuple[np.ndarray, float]:
    """(the upper Cholesky factor of (H + lambda I)^-1 in f64, lambda / mean(diag H)).

    Dead inputs (diag 0: the channel was always 0) get diag 1, so they round to nearest and
    neither give nor take error. lambda = damp * mean(diag H), multiplied by 10 while the
    factorization fails.
    """
    h = np.array(gram, np.float64)
    k = h.shape[0]
    diag = np.diagonal(h).copy()
    dead = ~(diag > 0)
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    mean = float(np.mean(np.diagonal(h)))
    relative = damp
    for _ in range(_DAMP_RETRIES):
        try:
            lower = np.linalg.cholesky(h + (relative * mean) * np.eye(k))
            inverse_lower = np.linalg.inv(lower)
            inverse = inverse_lower.T @ inverse_lower  # H^-1 (cholesky reads its lower half)
            upper = np.linalg.cholesky(inverse).T
            return np.triu(upper), relative
        except np.linalg.LinAlgError:
            relative *= 10
    raise ValueError(
        f"{_OP}: the calibration Hessian is not positive definite even with damping "
        f"{relative / 10:g} x mean(diag H); raise gptq_damp"
    )


def _act_order(gram: np.ndarray) -> np.ndarray:
    """GPTQ's activation order, kept block-aligned (a permutation of the K input channels).

    The K-blocks by decreasing summed diag H, the channels of each block by decreasing diag
    H (a block's scale does not depend on the order of its channels).
    """
    diag = np.diagonal(gram)
    blocks = diag.reshape(-1, formats.BLOCK_SIZE)
    order = np.argsort(-blocks.sum(axis=1), kind="stable")
    within = np.argsort(-blocks, axis=1, kind="stable")
    return (order[:, None] * formats.BLOCK_SIZE + within[order]).reshape(-1)


def _quantize_gptq(
    kernel: jax.Array,
    gram: np.ndarray,
    amax: np.float32,
    block_2d: bool,
    damp: float,
    act_order: bool,
) -> tuple[NVFP4Array, float]:
    """(the GPTQ-quantized kernel, the relative damping used); see `_gptq_codes`."""
    w = np.asarray(to_host(kernel), np.float32).T  # the stored (out, in) layout
    perm = _act_order(gram) if act_order else np.arange(w.shape[1])
    upper, relative = _inverse_hessian_factor(gram[np.ix_(perm, perm)], damp)
    codes, scales = _gptq_codes(
        jnp.asarray(w[:, perm]),
        jnp.asarray(upper, _F32),
        jnp.float32(amax),
        block_2d=block_2d,
    )
    codes, scales = np.asarray(codes), np.asarray(scales)
    inverse = np.argsort(perm)
    codes = codes[:, inverse]
    block_of = perm[:: formats.BLOCK_SIZE] // formats.BLOCK_SIZE  # processed block -> block
    scales = scales[:, np.argsort(block_of)]
    q = quantized_array(
        formats.pack_nibbles(jnp.asarray(codes)),
        jnp.asarray(scales),
        jnp.float32(amax),
        kernel.dtype,
        -2,
        bool(block_2d),
        False,
        None,
        formats.E4M3_MAX,
    )
    return q, relative


def _output_error(gram: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float | None:
    """`tr(dW^T H dW) / tr(W^T H W)`: the relative squared output error on the calibration X."""
    delta = w_hat - w
    exact = float(np.sum((gram @ w) * w))
    if not exact > 0:
        return None
    return max(float(np.sum((gram @ delta) * delta)), 0.0) / exact


# --- selection ----------------------------------------------------------------------------


def _layer_problem(layer) -> str:
    """Why a layer a rule puts in NVFP4 cannot be frozen here ("" if it can)."""
    if not isinstance(layer, nnx.Linear):
        return (
            f"an {type(layer).__name__} layer: {_OP} freezes nnx.Linear layers only (it stays "
            "as it is)"
        )
    problem = linear_problem(layer)
    if problem:
        return problem
    if layer_stack(layer):
        return (
            f"a stacked layer (kernel {tuple(layer.kernel.shape)}, run under nnx.scan/vmap): "
            f"{_OP} freezes 2-D (in, out) kernels only"
        )
    return ""


def _groups(paths: Iterable[str], fused_groups) -> dict[tuple[str, int], list[str]]:
    """Linears by fused group: same parent module, names in one group of `fused_groups`."""
    groups: dict[tuple[str, int], list[str]] = {}
    for path in paths:
        parent, _, name = path.rpartition("/")
        for index, group in enumerate(fused_groups):
            if name in group:
                groups.setdefault((parent, index), []).append(path)
                break
    return groups


def _check_fused_groups(fused_groups) -> tuple[tuple[str, ...], ...]:
    if isinstance(fused_groups, str) or not isinstance(fused_groups, Iterable):
        raise TypeError(
            f"{_OP}: fused_groups must be a sequence of name groups, e.g. "
            f"(('q_proj', 'k_proj', 'v_proj'),), got {fused_groups!r}"
        )
    groups = []
    for group in fused_groups:
        if isinstance(group, str) or not isinstance(group, Iterable):
            raise TypeError(f"{_OP}: fused_groups must hold sequences of names, got {group!r}")
        group = tuple(group)
        if not all(isinstance(name, str) for name in group):
            raise TypeError(f"{_OP}: fused_groups must hold sequences of names, got {group!r}")
        groups.append(group)
    return tuple(groups)


def _check_grid(grid) -> tuple[float, ...]:
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Iterable):
        raise TypeError(f"{_OP}: mse_grid must be a sequence of positive numbers, got {grid!r}")
    values = []
    for c in grid:
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, np.number)):
            raise TypeError(f"{_OP}: mse_grid must hold numbers, got {c!r}")
        if not 0 < float(c) < math.inf:
            raise ValueError(f"{_OP}: mse_grid must hold positive, finite numbers, got {c!r}")
        values.append(float(c))
    return tuple(dict.fromkeys([1.0, *values]))


def _check_damp(damp) -> float:
    if isinstance(damp, (bool, np.bool_)) or not isinstance(damp, (int, float, np.number)):
        raise TypeError(f"{_OP}: gptq_damp must be a positive number, got {damp!r}")
    if not 0 < float(damp) < math.inf:
        raise ValueError(f"{_OP}: gptq_damp must be a positive, finite number, got {damp!r}")
    return float(damp)


def _check_batches(batches) -> list:
    if batches is None or isinstance(batches, (str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(
            f"{_OP}: batches must be an iterable of calibration inputs (one per forward call), "
            f"got {type(batches).__name__}"
        )
    if isinstance(batches, (jax.Array, np.ndarray)):
        raise TypeError(
            f"{_OP}: batches must be an iterable of batches, got one array of shape "
            f"{batches.shape}; pass [batch] for a single batch"
        )
    batches = list(batches)
    if not batches:
        raise ValueError(f"{_OP}: batches is empty; calibration needs at least one batch")
    return batches


def _check_choice(value, choices: tuple[str, ...], name: str) -> str:
    if value not in choices:
        raise ValueError(
            f"{_OP}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return value


def _frozen_dtype(layer: nnx.Linear):
    """The dtype the frozen layer computes in: the layer's, else its kernel's."""
    return layer.dtype if layer.dtype is not None else jnp.dtype(layer.kernel[...].dtype)


# --- the call -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The checked arguments of `quantize_for_export`."""

    method: str
    activations: str
    rules: tuple[Rule, ...]
    forward: Callable[[nnx.Module, Any], Any]
    block_2d: bool
    fused_groups: tuple[tuple[str, ...], ...]
    mse_grid: tuple[float, ...]
    four_over_six: str
    e4m3_max: int
    damp: float
    act_order: bool
    jit: bool


def _settings(method, activations, rules, forward, block_2d, fused_groups, options) -> _Settings:
    method = _check_choice(method, METHODS, "method")
    activations = _check_choice(activations, ACTIVATIONS, "activations")
    rules = default_rules(0, first=0, last=0) if rules is None else check_rules(rules, _OP)
    if forward is None:
        forward = _default_forward
    elif not callable(forward):
        raise TypeError(
            f"{_OP}: forward must be callable as forward(model, batch), got {forward!r}"
        )
    mode, e4m3_max = formats.check_four_over_six(
        options["four_over_six"], options["four_over_six_e4m3_max"], _OP
    )
    if mode is None:
        raise ValueError(f"{_OP}: four_over_six must be 'mse' or 'mae', got None")
    return _Settings(
        method=method,
        activations=activations,
        rules=tuple(rules),
        forward=forward,
        block_2d=formats.check_flag(block_2d, _OP, "block_2d"),
        fused_groups=_check_fused_groups(fused_groups),
        mse_grid=_check_grid(options["mse_grid"]),
        four_over_six=mode,
        e4m3_max=e4m3_max,
        damp=_check_damp(options["gptq_damp"]),
        act_order=formats.check_flag(options["gptq_act_order"], _OP, "gptq_act_order"),
        jit=formats.check_flag(options["jit"], _OP, "jit"),
    )


def _decide(frozen: nnx.Module, found: dict, settings: _Settings) -> dict[str, tuple[str, str]]:
    """Per layer path, (action, reason): the rules, what can be frozen, whole fused groups."""
    decided: dict[str, tuple[str, str]] = {}
    for path, (layer, paths) in found.items():
        match = match_layer(settings.rules, paths, _OP)
        if match is None:
            decided[path] = ("unmatched", "")
        elif match[1].recipe is None:
            decided[path] = ("high_precision", "")
        else:
            problem = _layer_problem(layer)
            decided[path] = ("skipped", problem) if problem else ("nvfp4", "")
    selected = [p for p, (action, _) in decided.items() if action == "nvfp4"]
    # Replacing a layer by itself finds the ones that cannot be replaced (held in a tuple).
    reasons = replace_layers(frozen, [(found[p][0], found[p][0]) for p in selected])
    for path, reason in zip(selected, reasons, strict=True):
        if reason:
            decided[path] = ("skipped", reason)
    for members in _groups(found, settings.fused_groups).values():
        kept = [p for p in members if decided[p][0] != "nvfp4"]
        for path in members:
            if kept and decided[path][0] == "nvfp4":
                decided[path] = (
                    "high_precision",
                    f"its fused sibling {kept[0]} is not quantized ({decided[kept[0]][0]}); "
                    "engines load a fused group all quantized or all not",
                )
    if not any(action == "nvfp4" for action, _ in decided.values()):
        listing = "; ".join(f"{p}: {a}{f' ({r})' if r else ''}" for p, (a, r) in decided.items())
        raise ValueError(
            f"{_OP}: the model has no linear layer to quantize (rules select none, or none "
            f"can be frozen): {listing or 'it holds no linear layer'}"
        )
    return decided


def _quantize_set(kernels, members, stats, settings: _Settings):
    """The arrays of one set sharing a global amax (a fused group, or one layer).

    Returns (arrays, the "max" arrays, the amax used, its factor c, per member damping).
    """
    amax = _group_amax(kernels, members)
    maxes = [_quantize_max(k, amax, settings.block_2d) for k in kernels]
    factor, used, dampings = 1.0, amax, [None] * len(members)
    if settings.method == "max":
        arrays = maxes
    elif settings.method == "mse":
        factor, used, arrays = _search_amax(kernels, amax, settings.block_2d, settings.mse_grid)
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
            q, damping = _quantize_gptq(
                k, stats[path].gram, amax, settings.block_2d, settings.damp, settings.act_order
            )
            arrays.append(q)
            dampings.append(damping)
    return arrays, maxes, used, factor, dampings


def _input_scale(members, stats, settings: _Settings) -> tuple[np.float32, np.float32 | None]:
    """(the set's max input amax, W4A4's input scale `amax * RCP2688` or None for W4A16)."""
    input_amax = np.float32(max(stats[p].amax for p in members))
    if settings.activations != "nvfp4":
        return input_amax, None
    if not (np.isfinite(input_amax) and input_amax > 0):
        raise ValueError(
            f"{_OP}: the calibrated input amax of {list(members)} is {input_amax}; W4A4 needs "
            "a positive, finite one (calibration inputs that are not all zero)"
        )
    return input_amax, np.float32(input_amax * formats.RCP2688)


def _entry(path, layer, kernel, q, q_max, stat: _Calibration, **fields) -> PTQLayer:
    """The report entry of a frozen layer."""
    w = np.asarray(to_host(kernel), np.float64)
    w_hat, w_max = _dequantized(q), _dequantized(q_max)
    norm = float(np.sum(np.square(w)))
    seen = stat.rows > 0
    return PTQLayer(
        path=path,
        layer=type(layer).__name__,
        action="nvfp4",
        shape=tuple(kernel.shape),
        weight_error=float(np.sum(np.square(w_hat - w))) / norm if norm else 0.0,
        max_weight_error=float(np.sum(np.square(w_max - w))) / norm if norm else 0.0,
        output_error=_output_error(stat.gram, w, w_hat) if seen else None,
        max_output_error=_output_error(stat.gram, w, w_max) if seen else None,
        rows=stat.rows,
        **fields,
    )


def _freeze(found, selected, stats, settings: _Settings, report: PTQReport) -> list[tuple]:
    """Quantizes every selected layer; returns the (old layer, frozen layer) replacements."""
    in_group = {
        p: tuple(m)
        for m in _groups(found, settings.fused_groups).values()
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

    Returns:
      (the new model, a `PTQReport`).

    Raises:
      TypeError: `model` is not an nnx Module, `rules` not a sequence of `Rule`, `batches`
        not an iterable, `forward` not callable, a flag not a bool, a method option of the
        wrong type.
      ValueError: a bad `method`, `activations` or method option, empty `batches`, no linear
        to quantize (the message lists what became of each layer), two paths of one layer
        matching disagreeing rules, a kernel holding NaN or inf, a layer that saw no input
        (GPTQ or W4A4) or whose W4A4 input amax is 0 or not finite.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{_OP}: model must be a flax.nnx.Module, got {type(model).__name__}")
    options = dict(
        mse_grid=mse_grid,
        four_over_six=four_over_six,
        four_over_six_e4m3_max=four_over_six_e4m3_max,
        gptq_damp=gptq_damp,
        gptq_act_order=gptq_act_order,
        jit=jit,
    )
    settings = _settings(method, activations, rules, forward, block_2d, fused_groups, options)
    batches = _check_batches(batches)
    frozen = nnx.clone(model)
    found = layer_paths(frozen)
    decided = _decide(frozen, found, settings)
    selected = [p for p, (action, _) in decided.items() if action == "nvfp4"]
    stats = _calibrate(model, selected, batches, settings.forward, settings.jit)
    unseen = [p for p in selected if stats[p].rows == 0]
    if unseen and (settings.method == "gptq" or settings.activations == "nvfp4"):
        raise ValueError(
            f"{_OP}: {unseen} saw no calibration input (forward never called them); "
            f"{'GPTQ' if settings.method == 'gptq' else 'W4A4'} needs their inputs"
        )
    report = PTQReport(settings.method, settings.activations, settings.block_2d)
    replacements = _freeze(found, selected, stats, settings, report)
    for reason in replace_layers(frozen, replacements):
        if reason:  # (_decide checked that every selected layer can be replaced)
            raise ValueError(f"{_OP}: cannot replace a layer of the copy: {reason}")
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
