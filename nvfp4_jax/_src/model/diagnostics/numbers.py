"""The numbers of one layer: how its three GEMMs' operands and products fare in NVFP4.

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

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import formats, ops
from nvfp4_jax._src.core.reference.ms_eden import apply_rotation
from nvfp4_jax._src.core.reference.ms_eden import encode_scale as ms_eden_encode_scale
from nvfp4_jax._src.core.reference.quantize import encode_scale
from nvfp4_jax._src.core.spec import QuantSpec, rotation_words, spec_of_call
from nvfp4_jax._src.core.sr_keys import ms_eden_randomness, sr_seeds
from nvfp4_jax._src.flax.layer_info import weight_problem
from nvfp4_jax._src.model.convert.rules import recipe_from_dict, recipe_to_dict
from nvfp4_jax._src.training.dot_general import dot_general, pad_tokens
from nvfp4_jax._src.training.ms_eden import pad_contraction
from nvfp4_jax._src.training.recipe import NVFP4Recipe

_F32 = jnp.float32
_DENSE = (((1,), (0,)), ((), ()))
OPERANDS = ("x", "w", "dy", "x_wgrad", "dy_wgrad")


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


def as_key(key) -> jax.Array:
    """`key` as a PRNG key: a key as it is, an int seed or None (seed 0) made into one."""
    return jax.random.key(0 if key is None else key) if _is_seed(key) else key


def operand_stats(
    x: jax.Array,
    spec: QuantSpec | None = None,
    *,
    key: jax.Array | None = None,
    implementation=None,
    rotation: jax.Array | None = None,
    **options,
) -> dict[str, jax.Array]:
    """The `OperandStats` numbers (as f32 scalars) of `x` quantized by `spec`.

    See the module docstring for the definitions.

    Args:
      x: the operand.
      spec: how it is quantized (a `QuantSpec`, e.g. `NVFP4Recipe.spec`'s).
      key: the stochastic rounding's key, when the spec rounds stochastically.
      implementation: as in `nvfp4_jax.quantize`.
      rotation: MS-EDEN's `rotation_key` (or its words), when `spec.ms_eden`: the error is
        then measured against the rotated x, the tensor MS-EDEN quantizes.
      **options: `nvfp4_jax.quantize`'s options as keywords instead of `spec` (deprecated).

    Example:
      >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)
      >>> sorted(operand_stats(x, QuantSpec(axis=-1)))
      ['amax', 'rel_error', 'saturated', 'underflow']
    """
    spec = spec_of_call(spec, options, "operand_stats", deprecated=True)
    q = ops.quantize_with_spec(
        x, spec, key=key, implementation=implementation, rotation=rotation
    )  # fmt: skip
    stored = jnp.moveaxis(x, q.axis, -1)
    if spec.rht:
        stored = ops.apply_rht(stored, implementation=implementation)
    if spec.ms_eden:  # MS-EDEN's values are those of the rotated x
        stored = apply_rotation(stored, rotation_words(rotation, "operand_stats"))
    exact = jnp.moveaxis(stored, -1, q.axis) if spec.ms_eden else x
    rel_error = _relative(ops.dequantize(q, _F32, implementation=implementation), exact)
    blocks = jnp.abs(stored.astype(_F32)).reshape(*q.scales.shape, formats.BLOCK_SIZE)
    scales = q.scales.astype(_F32)
    underflow = (scales == 0) & (jnp.max(blocks, axis=-1) > 0)
    if spec.ms_eden:
        s_dec = _F32(1) / ms_eden_encode_scale(q.amax)
    else:
        s_dec = _F32(1) / encode_scale(q.amax, q.e4m3_max)
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
    if recipe.backward == "ms_eden":
        return _ms_eden_operands(x, w, dy, key, recipe)
    sr, impl = recipe.stochastic_rounding, recipe.implementation
    # The keys `nvfp4_jax.dot_general` gives dgrad's and wgrad's dy (from core/sr_keys.py).
    dgrad_key, wgrad_key = sr_seeds(key, impl) if sr else (None, None)
    # The specs of `nvfp4_jax.dot_general`'s operands; the wgrad ones on x and dy (not dy^T).
    spec = recipe.spec
    return {
        "x": operand_stats(x, spec("activation", "fprop"), implementation=impl),
        "w": operand_stats(w, spec("weight", "fprop"), implementation=impl),
        "dy": operand_stats(dy, spec("gradient", "dgrad"), key=dgrad_key, implementation=impl),
        "x_wgrad": operand_stats(pad_tokens(x), spec("activation", "wgrad"), implementation=impl),
        "dy_wgrad": operand_stats(
            pad_tokens(dy), spec("gradient", "wgrad").replace(axis=0), key=wgrad_key,
            implementation=impl,
        ),
    }  # fmt: skip


def _ms_eden_operands(x, w, dy, key, recipe: NVFP4Recipe) -> dict[str, dict[str, jax.Array]]:
    """The operand stats under `backward="ms_eden"`.

    dy (dgrad, along N) and x and dy (wgrad, along the tokens) with MS-EDEN, each padded to
    its groups of 128 as the backward pads them, with the randomness `dot_general` gives
    them (x as given, not re-quantized as the backward does).
    """
    impl = recipe.implementation
    dgrad, wgrad = ms_eden_randomness(key, impl)
    spec = QuantSpec(ms_eden=True)
    return {
        "x": operand_stats(x, recipe.spec("activation", "fprop"), implementation=impl),
        "w": operand_stats(w, recipe.spec("weight", "fprop"), implementation=impl),
        "dy": operand_stats(
            pad_contraction(dy), spec, key=dgrad.gradient, rotation=dgrad.rotation,
            implementation=impl,
        ),
        "x_wgrad": operand_stats(
            pad_contraction(x.T), spec, key=wgrad.other, rotation=wgrad.rotation,
            implementation=impl,
        ),
        "dy_wgrad": operand_stats(
            pad_contraction(dy.T), spec, key=wgrad.gradient, rotation=wgrad.rotation,
            implementation=impl,
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
    key = as_key(key)
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
