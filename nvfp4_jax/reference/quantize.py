"""NVFP4 quantize, dequantize and fake-quantize: the specification in pure jnp.

Shape letters: the input `x` has logical shape `S`; its *stored layout* is `x` with the
quantized axis moved last, `(..., R, C)` with C a multiple of 16 (R, the second-to-last
stored axis, a multiple of 16 for 16x16 blocks). The numbers are docs/NUMERICS.md's:

    A     = max |x|                                   (or the caller's amax)
    S_enc = min(2688 / A, FLT_MAX), 1 if A == 0 or S_enc == 0;   S_dec = 1 / S_enc
    s_b   = e4m3(min(amax_b * (S_enc * RCP6), 448))   per block (1x16, or 16x16 tile)
    enc_b = min(1 / (f32(s_b) * S_dec), FLT_MAX)
    code  = e2m1(x * enc_b)                           nearest-even, or stochastic
    x_hat = value(code) * (f32(s_b) * (A * RCP2688))

Every formula is written as the f32 operations of the contract, in its order; constants are
multiplied, never divided by (XLA turns `a / c` into `a * (1/c)`). Non-finite input (or an
invalid amax) gives a NaN amax, NaN scales (0x7F) and zero codes (section 8); a zero-size
tensor gives empty codes and scales with amax 0.

These functions are free, pure and jit-able; `nvfp4_jax.quantize` and friends run them when
`implementation="reference"` (and compare the native kernels with them bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax import formats
from nvfp4_jax.array import NVFP4Array
from nvfp4_jax.formats import decode_scale
from nvfp4_jax.reference import hadamard, stochastic
from nvfp4_jax.seed import SRSeed, as_seed

_F32 = jnp.float32


def encode_scale(amax: jax.Array) -> jax.Array:
    """Returns `S_enc = min(2688 / A, FLT_MAX)`, or 1 where A == 0 or S_enc == 0."""
    amax = jnp.asarray(amax).astype(_F32)
    s_enc = jnp.minimum(_F32(formats.FP4_E4M3_MAX) / amax, _F32(formats.FLT_MAX))
    return jnp.where((amax == 0) | (s_enc == 0), _F32(1), s_enc)


def _e4m3_nan(shape) -> jax.Array:
    nan_byte = jnp.full(shape, formats.E4M3_NAN_BYTE, jnp.uint8)
    return jax.lax.bitcast_convert_type(nan_byte, jnp.float8_e4m3fn)


def _block_amax(blocks: jax.Array, block_2d: bool) -> jax.Array:
    """Max |x| per block: (..., R, C/16, 16) -> (..., R, C/16), tiles repeated per row if 2D."""
    block_max = jnp.max(jnp.abs(blocks), axis=-1)
    if not block_2d:
        return block_max
    *lead, rows, cols = block_max.shape
    tiles = block_max.reshape(*lead, rows // formats.BLOCK_SIZE, formats.BLOCK_SIZE, cols)
    tile_max = jnp.max(tiles, axis=-2, keepdims=True)
    return jnp.broadcast_to(tile_max, tiles.shape).reshape(block_max.shape)


def _prepare(stored: jax.Array, rht: bool, amax: jax.Array | None):
    """(f32 layout, the amax used, whether the result is NaN, the amax to store).

    The input's finiteness is an explicit reduction: XLA's CPU max drops NaN from tensors of
    4096 elements or more, so `max |x|` alone would hide it (section 8).
    """
    if rht:
        stored = hadamard.apply_rht(stored)
    xs = stored.astype(_F32)
    nonfinite = jnp.any(~jnp.isfinite(xs))
    max_abs = jnp.max(jnp.abs(xs), initial=_F32(0))
    used = max_abs if amax is None else jnp.asarray(amax).astype(_F32)
    # NaN, inf or a negative amax (a traced caller amax can be any of them) is a NaN tensor.
    bad = nonfinite | ~(used >= 0) | (used == jnp.inf)
    return xs, used, bad, jnp.where(bad, _F32(jnp.nan), used)


def _quantize_core(xs, used, bad, seed: SRSeed | None, block_2d: bool):
    """Quantizes the f32 stored layout `xs` (..., C) with tensor amax `used`.

    Returns unpacked codes uint8 (..., C) and scales float8_e4m3fn (..., C/16).
    """
    s_enc = encode_scale(used)
    s_dec = _F32(1) / s_enc
    blocks = xs.reshape(*xs.shape[:-1], xs.shape[-1] // formats.BLOCK_SIZE, formats.BLOCK_SIZE)
    block_max = _block_amax(blocks, block_2d)
    scaled = jnp.minimum(block_max * (s_enc * _F32(formats.RCP6)), _F32(formats.E4M3_MAX))
    scales = scaled.astype(jnp.float8_e4m3fn)
    encode = jnp.minimum(_F32(1) / (scales.astype(_F32) * s_dec), _F32(formats.FLT_MAX))
    y = blocks * encode[..., None]
    magnitude = jnp.abs(y)
    if seed is not None:
        random = stochastic.random_bytes(seed, y.size).reshape(y.shape)
        magnitude = stochastic.stochastic_magnitude(magnitude, random)
    codes = formats.e2m1_magnitude_code(magnitude) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    codes = jnp.where(bad, jnp.uint8(0), codes)
    scales = jnp.where(bad, _e4m3_nan(scales.shape), scales)
    return codes.reshape(xs.shape), scales


def _amax_data(amax, op: str) -> jax.Array:
    """A computed amax as an f32 scalar, NaN, inf or negative included (a NaN tensor)."""
    amax = jnp.asarray(amax)
    if amax.shape != () or not jnp.issubdtype(amax.dtype, jnp.floating):
        raise TypeError(f"{op}: amax must be a float scalar, got {amax.dtype} {amax.shape}")
    return amax.astype(_F32)


def check_quantize_call(
    x, axis, block_2d, rht, stochastic_rounding, key, amax, op, *, amax_is_data=False
):
    """Validated (x, negative axis, SR seed or None, f32 amax or None).

    The argument checks of every quantizing op, for every implementation (`nvfp4_jax.ops`
    calls it too), so they raise the same errors. A caller's concrete amax that is negative,
    NaN or inf is an error; with `amax_is_data` (an amax the library computed or stores, e.g.
    a GEMM operand's `tensor_amax`) only its type is checked: such an amax is NaN exactly when
    the data is, and gives the NaN tensor eagerly as under `jit`.
    """
    x = formats.as_float_array(x, op)
    axis = formats.check_quantize_args(
        x,
        axis=axis,
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=stochastic_rounding,
        key=key,
        op=op,
    )
    seed = as_seed(key, op) if stochastic_rounding else None
    if amax is not None and amax_is_data:
        return x, axis, seed, _amax_data(amax, op)
    return x, axis, seed, formats.check_amax(amax, op)


def tensor_amax(x: jax.Array, *, axis: int = -1, rht: bool = False) -> jax.Array:
    """Returns the f32 tensor amax `max |x|` that `quantize` would use, NaN if x holds NaN/inf.

    Args:
      x: bf16, f16 or f32; `x.shape[axis]` a multiple of 16.
      axis: the quantized axis (only matters with `rht`).
      rht: the amax of the RHT of x along `axis`, rounded to x's dtype.

    Returns:
      An f32 scalar; 0 for a zero-size x.

    Example:
      >>> float(tensor_amax(jnp.array([1.0, -3.0] * 8)))
      3.0
    """
    x, axis, _, _ = check_quantize_call(x, axis, False, rht, False, None, None, "tensor_amax")
    _, _, _, stored_amax = _prepare(jnp.moveaxis(x, axis, -1), rht, None)
    return stored_amax


def quantize(
    x: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | SRSeed | None = None,
    amax: jax.Array | None = None,
) -> NVFP4Array:
    """Quantizes `x` to NVFP4 in blocks of 16 along `axis` (the specification).

    Takes the arguments of `nvfp4_jax.quantize` except `implementation`.

    Example:
      >>> x = jnp.linspace(-3.0, 3.0, 32).reshape(2, 16)
      >>> q = quantize(x)
      >>> q.codes.shape, q.scales.shape, q.shape
      ((2, 8), (2, 1), (2, 16))

    """
    x, axis, seed, amax = check_quantize_call(
        x, axis, block_2d, rht, stochastic_rounding, key, amax, "quantize"
    )
    codes, scales, stored_amax = quantize_stored(
        jnp.moveaxis(x, axis, -1), amax, seed, block_2d=block_2d, rht=rht
    )
    return NVFP4Array(
        codes=codes,
        scales=scales,
        amax=stored_amax,
        dtype=jnp.dtype(x.dtype),
        axis=axis,
        block_2d=bool(block_2d),
        rht=bool(rht),
    )


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
) -> jax.Array:
    """Quantizes and dequantizes in one step (the specification); see `nvfp4_jax.fake_quantize`.

    The values are `value(code) * (f32(s_b) * D)`, or `value(code) * f32(s_b)` without
    `global_scale`, in x's layout, with no inverse RHT, cast to `dtype` (default x's).
    """
    op = "fake_quantize"
    x, axis, seed, amax = check_quantize_call(
        x, axis, block_2d, rht, stochastic_rounding, key, amax, op
    )
    global_scale = formats.check_flag(global_scale, op, "global_scale")
    dtype = formats.check_dtype(x.dtype if dtype is None else dtype, op)
    values = fake_quantize_stored(
        jnp.moveaxis(x, axis, -1),
        amax,
        seed,
        block_2d=block_2d,
        rht=rht,
        global_scale=global_scale,
        dtype=dtype,
    )
    return jnp.moveaxis(values, -1, axis)


# The specification on the stored layout (quantized axis last), arguments already checked:
# what the reference backend runs once `nvfp4_jax.ops` has checked a call.


def quantize_stored(xs, amax, seed: SRSeed | None, *, block_2d: bool, rht: bool):
    """(packed codes, scales, stored amax) of `xs`, quantized along its last axis."""
    xs, used, bad, stored_amax = _prepare(xs, rht, amax)
    codes, scales = _quantize_core(xs, used, bad, seed, block_2d)
    return formats.pack_nibbles(codes), scales, stored_amax


def fake_quantize_stored(
    xs, amax, seed: SRSeed | None, *, block_2d: bool, rht: bool, global_scale: bool, dtype
):
    """`fake_quantize` of `xs` along its last axis, in the stored layout."""
    xs, used, bad, stored_amax = _prepare(xs, rht, amax)
    codes, scales = _quantize_core(xs, used, bad, seed, block_2d)
    blocks = codes.reshape(*scales.shape, formats.BLOCK_SIZE)
    factor = scales.astype(_F32)
    if global_scale:
        factor = factor * decode_scale(stored_amax)
    values = formats.scaled_code_values(blocks, factor[..., None]).reshape(xs.shape)
    return values.astype(dtype)


def check_dequantize_call(q, dtype, op: str) -> jnp.dtype:
    """Checks the arguments of an op that decodes `q`; returns `dtype` as a jnp dtype.

    For every implementation (`nvfp4_jax.ops` calls it too), so they raise the same errors.
    """
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"{op}: q must be an NVFP4Array, got {type(q).__name__}")
    return formats.check_dtype(dtype, op)


def _dequantize_stored(q: NVFP4Array, dtype) -> jax.Array:
    if q.amax.ndim:
        # A batch of tensors made by vmap (one amax each), dequantized outside of vmap.
        return jax.vmap(lambda one: _dequantize_stored(one, dtype))(q)
    codes = formats.unpack_nibbles(q.codes)
    blocks = codes.reshape(*q.scales.shape, formats.BLOCK_SIZE)
    factor = q.scales.astype(_F32) * q.global_scale
    x_hat = formats.scaled_code_values(blocks, factor[..., None]).reshape(codes.shape)
    if q.rht:
        x_hat = hadamard.apply_rht(x_hat, inverse=True)
    return x_hat.astype(dtype)


def dequantize(q: NVFP4Array, dtype=jnp.float32) -> jax.Array:
    """Returns the tensor `q` encodes, in its logical shape, cast to `dtype`.

    `x_hat = value(code) * (f32(s_b) * D)` in f32 with `D = q.global_scale` (`A * RCP2688`,
    or the decode scale an imported checkpoint carries), then the inverse RHT (in f32) if `q`
    was quantized with one, then the cast. A NaN amax gives NaN everywhere.

    Example:
      >>> x = jnp.full((16,), 1.5, jnp.float32)
      >>> dequantize(quantize(x)).tolist() == x.tolist()
      True

    """
    dtype = check_dequantize_call(q, dtype, "dequantize")
    return jnp.moveaxis(_dequantize_stored(q, dtype), -1, q.axis)


def block_values(q: NVFP4Array, dtype=jnp.bfloat16) -> jax.Array:
    """Returns `value(code) * f32(s_b)` in the stored layout, without the tensor factor.

    These values have at most 6 significant bits, so they are exact in bf16: the operands of
    an emulated block-scaled GEMM, whose result is then multiplied by `A * RCP2688` of each
    operand (section 9). No inverse RHT is applied.
    """
    dtype = check_dequantize_call(q, dtype, "block_values")
    codes = formats.unpack_nibbles(q.codes)
    blocks = codes.reshape(*q.scales.shape, formats.BLOCK_SIZE)
    values = formats.scaled_code_values(blocks, q.scales.astype(_F32)[..., None])
    return values.reshape(codes.shape).astype(dtype)
