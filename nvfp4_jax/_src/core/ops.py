"""The public NVFP4 ops: argument checks and differentiation rules, once, above the backends.

Each op checks its arguments (the same checks and messages as the reference), moves the
quantized axis last (the stored layout), asks `backends.resolve` which implementation runs,
and calls it through a `jax.custom_jvp` whose rule is written here, in jnp, independent of
the implementation. So every implementation differentiates the same way, forward and
reverse mode, and the native kernels (which JAX cannot differentiate) are never traced for
derivatives:

* `apply_rht`: linear; its derivative is the transform itself (the transpose, for reverse
  mode, is the inverse transform).
* `tensor_amax`: the derivative of `jnp.max(jnp.abs(.))` (of the RHT with `rht`): the
  gradient goes to the elements of largest magnitude, split among ties.
* `fake_quantize`: the straight-through estimator. The derivative is the identity (the RHT
  with `rht`, since the values stay in the rotated basis; times `S_enc` without
  `global_scale`), zero only where a caller-given `amax` clips (`|x| > amax`).
* `dequantize`: differentiable in its float inputs, the scales and the amax (the codes are
  integers).
* `quantize`: a step function with integer codes: its outputs carry no derivative (zero);
  use `fake_quantize` for quantization-aware training.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nvfp4_jax._src.core import backends, checks, formats
from nvfp4_jax._src.core.array import NVFP4Array, bind_dequantize
from nvfp4_jax._src.core.backends import Backend, Implementation
from nvfp4_jax._src.core.interception import opaque
from nvfp4_jax._src.core.reference.hadamard import apply_rht as reference_apply_rht
from nvfp4_jax._src.core.reference.ms_eden import apply_rotation
from nvfp4_jax._src.core.reference.ms_eden import encode_scale as ms_eden_encode_scale
from nvfp4_jax._src.core.reference.quantize import dequantize as reference_dequantize
from nvfp4_jax._src.core.reference.quantize import encode_scale
from nvfp4_jax._src.core.spec import QuantSpec, check_dequantize_call, rotation_words
from nvfp4_jax._src.core.sr_seed import SRSeed

_F32 = jnp.float32


# --- each backend computation as one program ------------------------------------------------
# An eager call of an op runs its backend's computation as one compiled program: the
# reference is a few hundred jnp operations, which eager JAX would otherwise compile and run
# one by one (seconds on the first call of each shape). Under `jit` these inline into the
# caller's program as any nested `jit` does. Same bits either way (the contract is exact).


def _on_backend(backend: Backend, method: str, *arrays, **options):
    """`backend.<method>(*arrays, **options)` as one program; `options` are static."""
    return _on_backend_jit(backend, method, tuple(sorted(options.items())), *arrays)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _on_backend_jit(backend: Backend, method: str, options: tuple, *arrays):
    return getattr(backend, method)(*arrays, **dict(options))


# --- apply_rht ------------------------------------------------------------------------------


@opaque
def apply_rht(
    x: jax.Array, inverse: bool = False, *, implementation: Implementation | None = None
) -> jax.Array:
    """Applies the Random Hadamard Transform in blocks of 16 along the last axis of `x`.

    Args:
      x: bf16, f16 or f32 array of any rank whose last dimension is a multiple of 16.
      inverse: apply `M.T` (the inverse) instead of `M`.
      implementation: None (the native kernel where it runs, else the reference),
        "reference" or "ffi".

    Returns:
      An array of x's shape and dtype. Accumulation is in f32, in a fixed order, so every
      implementation rounds identically (docs/NUMERICS.md section 5).

    Example:
      >>> x = jnp.arange(16, dtype=jnp.float32)
      >>> bool(jnp.allclose(apply_rht(apply_rht(x), inverse=True), x))
      True

    """
    x = checks.check_rht_input(x)
    inverse = checks.check_flag(inverse, "apply_rht", "inverse")
    return _rht(x, inverse, backends.resolve(implementation, "apply_rht"))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _rht(x, inverse: bool, backend: Backend):
    return _on_backend(backend, "rht", x, inverse=inverse)


@_rht.defjvp
@opaque
def _rht_jvp(inverse, backend, primals, tangents):
    (x,), (dx,) = primals, tangents
    return _rht(x, inverse, backend), reference_apply_rht(dx, inverse=inverse)


# --- tensor_amax ----------------------------------------------------------------------------


@opaque
def tensor_amax(
    x: jax.Array,
    *,
    axis: int = -1,
    rht: bool = False,
    implementation: Implementation | None = None,
    rotation_key: jax.Array | None = None,
) -> jax.Array:
    """Returns the f32 tensor amax `max |x|` that `quantize` would use, NaN if x holds NaN/inf.

    With `rht`, the amax of the transformed tensor (the RHT applied along `axis`); with
    `rotation_key`, of MS-EDEN's rotated tensor (`quantize(..., ms_eden=True)` with that
    `rotation_key`; `x.shape[axis]` a multiple of 128). Pass the result (or its maximum over
    devices) as `quantize(..., amax=...)`.

    Example:
      >>> float(tensor_amax(jnp.array([1.0, -3.0] * 8)))
      3.0
    """
    spec = QuantSpec(axis=axis, rht=rht, op="tensor_amax")
    x, spec, _, _, _ = spec.check_call(x, None, None)
    rotation = None
    if rotation_key is not None:
        spec = spec.replace(ms_eden=True).check_shape(x.shape)  # groups of 128, no RHT
        rotation = rotation_words(rotation_key, "tensor_amax")
    backend = backends.resolve(implementation, "tensor_amax")
    return _amax(jnp.moveaxis(x, spec.axis, -1), rotation, spec.rht, backend)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _amax(x, rotation, rht: bool, backend: Backend):
    return _on_backend(backend, "amax", x, rotation, rht=rht)


def _max_abs(x, rotation, rht: bool):
    """`max |x|` (of the RHT or the rotation of x) in jnp: the function `_amax` differentiates."""
    y = reference_apply_rht(x) if rht else x
    if rotation is not None:
        y = apply_rotation(x, rotation)
    return jnp.max(jnp.abs(y.astype(_F32)), initial=_F32(0))


@_amax.defjvp
@opaque
def _amax_jvp(rht, backend, primals, tangents):
    (x, rotation), (dx, _) = primals, tangents
    _, d_amax = jax.jvp(lambda v: _max_abs(v, rotation, rht), (x,), (dx,))
    return _amax(x, rotation, rht, backend), d_amax


# --- quantize -------------------------------------------------------------------------------


@opaque
def quantize(
    x: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | SRSeed | None = None,
    amax: jax.Array | None = None,
    implementation: Implementation | None = None,
    four_over_six: str | None = None,
    four_over_six_e4m3_max: int = formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
    ms_eden: bool = False,
    rotation_key: jax.Array | None = None,
) -> NVFP4Array:
    """Quantizes `x` to NVFP4 in blocks of 16 along `axis`.

    Args:
      x: bf16, f16 or f32 array; `x.shape[axis]` must be a multiple of 16.
      axis: the quantized axis. It is stored last (like TransformerEngine's column-wise copy);
        `dequantize` restores the original layout.
      block_2d: 16x16 blocks (for weights): one scale per tile, stored once per row. The
        second-to-last axis of the stored layout must be a multiple of 16.
      rht: apply the Random Hadamard Transform along `axis` first (`apply_rht`); the tensor
        amax is taken after it, and `dequantize` applies the inverse.
      stochastic_rounding: round the E2M1 codes stochastically (docs/NUMERICS.md section 7).
      key: required with `stochastic_rounding`, ignored otherwise: a JAX PRNG key, or an
        `SRSeed` (a key with the counter offset of a shard of a larger tensor).
      amax: an f32 scalar used instead of `max |x|` (after the RHT); larger values saturate.
        A concrete negative or NaN amax is an error; a traced one gives a NaN result.
      implementation: None (the native kernels where they run, else the reference),
        "reference" or "ffi".
      four_over_six: None (plain NVFP4), "mae" or "mse": Four Over Six (docs/NUMERICS.md
        section 13). Each block is quantized with its amax mapped to 6 and to 4, and keeps
        the candidate whose reconstruction has the smaller total absolute ("mae") or
        squared ("mse") error (16x16 tiles: summed over the tile); ties keep map-to-6. With
        `stochastic_rounding` the choice is made by rounding to nearest, then the block is
        rounded stochastically with the chosen scale; with `rht`, on the rotated values.
      four_over_six_e4m3_max: the E4M3 maximum M of the global scale under 4/6,
        `S_enc = 6M / A`: 256 (the default, TransformerEngine's: room for the x1.5 of
        map-to-4) or 448. Ignored when `four_over_six` is None (plain NVFP4 uses 448).
      ms_eden: MS-EDEN, Quartet II's unbiased quantizer (docs/NUMERICS.md section 14): every
        128 values along `axis` are rotated (a Hadamard transform with random signs), rounded
        to nearest, and each block's E4M3 scale is corrected (EDEN) and rounded
        stochastically, so the quantized tensor is the rotated one in expectation. Needs
        `key` (the scales' rounding) and `rotation_key`, and `x.shape[axis]` a multiple of
        128; excludes `block_2d`, `rht`, `stochastic_rounding` and `four_over_six`.
      rotation_key: with `ms_eden`, the PRNG key of the rotation's 128 signs
        (`reference.rotation_words`); give both operands of a GEMM the same one (their
        product is then the product of the unrotated ones) and their own `key`.

    Returns:
      An `NVFP4Array` with packed codes, E4M3 scales and the f32 tensor amax. Its leaves
      carry no derivative (see the module docstring). Under 4/6 it records `four_over_six`
      and `e4m3_max`, and carries its decode factor `D = A * f32(1/(6M))` as `decode_scale`;
      the stored format is plain NVFP4. Under MS-EDEN it holds the rotated tensor (the
      rotation is not stored: `reference.apply_rotation(..., inverse=True)` undoes it), with
      `D = A * f32(1/C)` as `decode_scale`.

    Example:
      >>> x = jnp.linspace(-3.0, 3.0, 32).reshape(2, 16)
      >>> q = quantize(x)
      >>> q.codes.shape, q.scales.shape, q.shape
      ((2, 8), (2, 1), (2, 16))

    """
    spec = QuantSpec(
        axis=axis,
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=stochastic_rounding,
        four_over_six=four_over_six,
        e4m3_max=four_over_six_e4m3_max,
        ms_eden=ms_eden,
        op="quantize",
    )
    return quantize_with_spec(
        x, spec, key=key, amax=amax, implementation=implementation, rotation=rotation_key
    )


@opaque
def quantize_with_spec(
    x: jax.Array,
    spec: QuantSpec,
    *,
    key: jax.Array | SRSeed | None = None,
    amax: jax.Array | None = None,
    implementation: Implementation | None = None,
    amax_is_data: bool = False,
    rotation: jax.Array | None = None,
) -> NVFP4Array:
    """`quantize` with its options as one `QuantSpec`: what the public `quantize` runs.

    The entry point of internal callers (the GEMM operands, whose specs `NVFP4Recipe.spec`
    makes). With `amax_is_data` (an amax the library computed or stores) a NaN, inf or
    negative `amax` gives the NaN tensor, run eagerly as under `jit`, where `quantize`
    raises for a caller's concrete one. `rotation`: MS-EDEN's `rotation_key`, or its
    uint32 (4,) words.
    """
    x, spec, seed, amax, rotation = spec.check_call(
        x, key, amax, rotation=rotation, amax_is_data=amax_is_data
    )
    backend = backends.resolve(implementation, spec.op)
    # A step function: no derivative flows through it, and the kernels are never traced
    # for one (their tangents are symbolically zero).
    stored = lax.stop_gradient(jnp.moveaxis(x, spec.axis, -1))
    amax = None if amax is None else lax.stop_gradient(amax)
    codes, scales, stored_amax = _on_backend(
        backend, "quantize", stored, amax, seed, rotation, spec=spec.stored()
    )
    return spec.array(codes, scales, stored_amax, x.dtype)


_QUANTIZE = QuantSpec(op="quantize")


@opaque
def quantize_with_data_amax(
    x: jax.Array,
    amax: jax.Array,
    spec: QuantSpec = _QUANTIZE,
    *,
    key: jax.Array | SRSeed | None = None,
    implementation: Implementation | None = None,
    rotation: jax.Array | None = None,
) -> NVFP4Array:
    """`quantize(x, amax=amax, ...)` for an amax the library computed or stores: data.

    The entry point of internal callers (not re-exported): a NaN, inf or negative `amax`
    gives the NaN tensor, run eagerly as under `jit`, where `quantize` raises for a caller's
    concrete one. Every other argument is checked as `quantize` checks it.
    """
    return quantize_with_spec(
        x,
        spec,
        key=key,
        amax=amax,
        implementation=implementation,
        amax_is_data=True,
        rotation=rotation,
    )


# --- fake_quantize --------------------------------------------------------------------------


@opaque
def fake_quantize(
    x: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | SRSeed | None = None,
    amax: jax.Array | None = None,
    global_scale: bool = True,
    dtype=None,
    implementation: Implementation | None = None,
    four_over_six: str | None = None,
    four_over_six_e4m3_max: int = formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
    ms_eden: bool = False,
    rotation_key: jax.Array | None = None,
) -> jax.Array:
    """Quantizes and dequantizes in one step, without materializing packed codes.

    Takes `quantize`'s arguments and returns an array of x's shape. The values are those of
    `dequantize(quantize(x, ...))` except that no inverse RHT is applied (with `rht` the
    result stays in the rotated basis, as a GEMM of two rotated operands wants), and with
    `global_scale=False` the tensor factor `A * RCP2688` (`A * f32(1/(6M))` under Four Over
    Six) is left out: each value is then `value(code) * f32(s_b)`, exact in bf16, ready for
    an emulated block-scaled GEMM.

    Differentiable with the straight-through estimator: the gradient is the identity (see
    the module docstring), so quantization-aware training learns through it.

    Args:
      x: as in `quantize`.
      axis: as in `quantize`.
      block_2d: as in `quantize`.
      rht: as in `quantize`.
      stochastic_rounding: as in `quantize`.
      key: as in `quantize`.
      amax: as in `quantize`; where `|x| > amax` the gradient is zero.
      global_scale: multiply by the tensor decode factor `A * RCP2688` (under Four Over
        Six `A * f32(1/(6M))`).
      dtype: the result dtype (default: x's dtype).
      implementation: as in `quantize`.
      four_over_six: as in `quantize`.
      four_over_six_e4m3_max: as in `quantize`.
      ms_eden: as in `quantize`; the values stay in the rotated basis, and without
        `global_scale` the factor left out is MS-EDEN's `A * f32(1/C)`.
      rotation_key: as in `quantize`.

    Example:
      >>> x = jnp.linspace(-3.0, 3.0, 32).reshape(2, 16)
      >>> jax.grad(lambda v: fake_quantize(v).sum())(x).tolist() == jnp.ones_like(x).tolist()
      True
    """
    spec = QuantSpec(
        axis=axis,
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=stochastic_rounding,
        four_over_six=four_over_six,
        e4m3_max=four_over_six_e4m3_max,
        ms_eden=ms_eden,
        global_scale=global_scale,
        dtype=dtype,
        op="fake_quantize",
    )
    return fake_quantize_with_spec(
        x, spec, key=key, amax=amax, implementation=implementation, rotation=rotation_key
    )


@opaque
def fake_quantize_with_spec(
    x: jax.Array,
    spec: QuantSpec,
    *,
    key: jax.Array | SRSeed | None = None,
    amax: jax.Array | None = None,
    implementation: Implementation | None = None,
    amax_is_data: bool = False,
    rotation: jax.Array | None = None,
) -> jax.Array:
    """`fake_quantize` with its options as one `QuantSpec` (`dtype` None: x's dtype).

    `amax_is_data` and `rotation` as in `quantize_with_spec`.
    """
    x, spec, seed, amax, rotation = spec.check_call(
        x, key, amax, rotation=rotation, amax_is_data=amax_is_data
    )
    spec = spec.with_dtype(x.dtype)
    backend = backends.resolve(implementation, spec.op)
    stored = jnp.moveaxis(x, spec.axis, -1)
    values = _fake_quantize(stored, amax, seed, rotation, spec.stored(), backend)
    return jnp.moveaxis(values, -1, spec.axis)


_FAKE_QUANTIZE = QuantSpec(op="fake_quantize")


@opaque
def fake_quantize_with_data_amax(
    x: jax.Array,
    amax: jax.Array,
    spec: QuantSpec = _FAKE_QUANTIZE,
    *,
    key: jax.Array | SRSeed | None = None,
    dtype=None,
    implementation: Implementation | None = None,
    rotation: jax.Array | None = None,
) -> jax.Array:
    """`fake_quantize(x, amax=amax, ...)` for an amax the library computed or stores.

    As `quantize_with_data_amax`: a NaN, inf or negative `amax` gives a NaN result, run
    eagerly as under `jit`; for the GEMM operands and the W4A4 layers' stored input amax.
    `dtype`, when given, replaces `spec.dtype`.
    """
    if dtype is not None:
        spec = spec.replace(dtype=dtype)
    return fake_quantize_with_spec(
        x,
        spec,
        key=key,
        amax=amax,
        implementation=implementation,
        amax_is_data=True,
        rotation=rotation,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _fake_quantize(x, amax, seed, rotation, spec: QuantSpec, backend: Backend):
    return _on_backend(backend, "fake_quantize", x, amax, seed, rotation, spec=spec)


def _transform(x, rotation, spec: QuantSpec):
    """The basis the values of `spec` are in: the RHT or MS-EDEN's rotation of x, or x."""
    if spec.rht:
        return reference_apply_rht(x)
    if spec.ms_eden:
        return apply_rotation(x, rotation)
    return x


@_fake_quantize.defjvp
@opaque
def _fake_quantize_jvp(spec: QuantSpec, backend: Backend, primals, tangents):
    x, amax, seed, rotation = primals
    dx = tangents[0]
    out = _fake_quantize(x, amax, seed, rotation, spec, backend)
    d_out = _transform(dx, rotation, spec)  # the values are in the rotated basis
    if amax is not None:
        y = _transform(x, rotation, spec)
        d_out = jnp.where(jnp.abs(y.astype(_F32)) <= amax, d_out, jnp.zeros_like(d_out))
    if not spec.global_scale:
        # value(code) * s_b approximates x * S_enc.
        used = amax if amax is not None else backend.amax(x, rht=spec.rht, rotation=rotation)
        if spec.ms_eden:
            s_enc = ms_eden_encode_scale(used)
        else:
            s_enc = encode_scale(used, spec.e4m3_max)
        d_out = d_out.astype(_F32) * s_enc
    return out, d_out.astype(spec.dtype)


# --- dequantize -----------------------------------------------------------------------------


@opaque
def dequantize(
    q: NVFP4Array, dtype=jnp.float32, *, implementation: Implementation | None = None
) -> jax.Array:
    """Returns the tensor `q` encodes, in its logical shape, cast to `dtype`.

    `x_hat = value(code) * (f32(s_b) * D)` in f32, with `D = q.global_scale` (`A * RCP2688`,
    or an imported checkpoint's decode scale), then the inverse RHT if `q` was quantized with
    one, then the cast. A NaN amax gives NaN everywhere. Also `q.dequantize(dtype)`.
    Differentiable in `q.scales` and `q.amax` (or `q.decode_scale`).

    Example:
      >>> x = jnp.full((16,), 1.5, jnp.float32)
      >>> dequantize(quantize(x)).tolist() == x.tolist()
      True

    """
    dtype = check_dequantize_call(q, dtype, "dequantize")
    backend = backends.resolve(implementation, "dequantize")
    # D, in jnp: its derivative in `q.amax` (or `q.decode_scale`) is JAX's own.
    stored = _dequantize_batch(q.codes, q.scales, q.global_scale, backend, q.rht, dtype)
    return jnp.moveaxis(stored, -1, q.axis)


def _dequantize_batch(codes, scales, decode_scale, backend, rht, dtype):
    if decode_scale.ndim:
        # A batch of tensors made by vmap (one amax each), dequantized outside of vmap.
        return jax.vmap(lambda c, s, d: _dequantize_batch(c, s, d, backend, rht, dtype))(
            codes, scales, decode_scale
        )
    return _dequantize(codes, scales, decode_scale, backend, rht, dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _dequantize(codes, scales, decode_scale, backend: Backend, rht: bool, dtype):
    return _on_backend(
        backend, "dequantize", codes, scales, decode_scale, rht=rht, dtype=jnp.dtype(dtype)
    )


@_dequantize.defjvp
@opaque
def _dequantize_jvp(backend, rht, dtype, primals, tangents):
    codes, scales, decode_scale = primals
    _, d_scales, d_decode = tangents

    def decode(s, d):
        q = NVFP4Array(codes, s, d * 2688, dtype, -1, False, rht, decode_scale=d)
        return reference_dequantize(q, dtype)

    _, d_out = jax.jvp(decode, (scales, decode_scale), (d_scales, d_decode))
    return _dequantize(codes, scales, decode_scale, backend, rht, dtype), d_out


@opaque
def block_values(
    q: NVFP4Array, dtype=jnp.bfloat16, *, implementation: Implementation | None = None
) -> jax.Array:
    """`value(code) * f32(s_b)` in the stored layout: the operand of an emulated GEMM.

    `reference.block_values` on the chosen implementation: the dequantize kernel with the
    tensor factor 1 and no inverse RHT. The values are exact in every float dtype (at most
    6 significant bits), so every implementation gives the same bits.
    """
    dtype = check_dequantize_call(q, dtype, "block_values")
    backend = backends.resolve(implementation, "block_values")
    one = jnp.ones_like(q.global_scale)
    return _dequantize_batch(q.codes, q.scales, one, backend, False, dtype)


bind_dequantize(dequantize)
