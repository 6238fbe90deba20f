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

With `four_over_six` (section 13) the global scale uses `6M` (M = 256 or 448) instead of
2688, and each block keeps whichever of two candidate scales (its amax mapped to 6, or to 4)
reconstructs it with the smaller error.

Every formula is written as the f32 operations of the contract, in its order; constants are
multiplied, never divided by (XLA turns `a / c`, and `a / broadcast(s)`, into
`a * (1/c)`): the two true divisions of 4/6 divide by an array XLA cannot see as one.
Non-finite input (or an invalid amax) gives a NaN amax, NaN scales (0x7F) and zero codes
(section 8); a zero-size tensor gives empty codes and scales with amax 0.

These functions are free, pure and jit-able; `nvfp4_jax.quantize` and friends run them when
`implementation="reference"` (and compare the native kernels with them bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import formats, primal_types
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.formats import decode_scale
from nvfp4_jax._src.core.reference import hadamard, ms_eden, stochastic
from nvfp4_jax._src.core.spec import QuantSpec, check_dequantize_call, spec_of_call
from nvfp4_jax._src.core.sr_seed import SRSeed

_F32 = jnp.float32


def encode_scale(amax: jax.Array, e4m3_max: int = 448) -> jax.Array:
    """Returns `S_enc = min(6M / A, FLT_MAX)`, or 1 where A == 0 or S_enc == 0.

    `6M` is 2688 for plain NVFP4 (M = `e4m3_max` = 448); Four Over Six may use M = 256.
    """
    amax = jnp.asarray(amax).astype(_F32)
    s_enc = jnp.minimum(formats.fp4_e4m3_max(e4m3_max) / amax, _F32(formats.FLT_MAX))
    return jnp.where((amax == 0) | (s_enc == 0), _F32(1), s_enc)


def _e4m3_nan() -> jax.Array:
    """The E4M3 NaN scale 0x7F, a scalar (`jnp.where` broadcasts it into any sharding)."""
    nan_byte = jnp.asarray(formats.E4M3_NAN_BYTE, jnp.uint8)
    return jax.lax.bitcast_convert_type(nan_byte, jnp.float8_e4m3fn)


def block_amax(blocks: jax.Array, block_2d: bool) -> jax.Array:
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
    bad = nonfinite | formats.invalid_amax(used)
    return xs, used, bad, jnp.where(bad, _F32(jnp.nan), used)


def block_encode(scales: jax.Array, s_dec: jax.Array) -> jax.Array:
    """`enc_b = min(1 / (f32(s_b) * S_dec), FLT_MAX)` per block."""
    return jnp.minimum(_F32(1) / (scales.astype(_F32) * s_dec), _F32(formats.FLT_MAX))


def _divide(numerator: jax.Array, finite: jax.Array, constant) -> jax.Array:
    """`numerator / constant` as one IEEE division (correctly rounded), elementwise.

    XLA rewrites a division by a constant, or by a broadcast scalar, into a multiplication
    by the rounded reciprocal, which rounds differently; the divisor is therefore formed from
    `finite`, an array of numerator's shape whose elements are finite, as `finite * 0 + c`:
    exactly `c`, but an array XLA cannot see as a constant.
    """
    return numerator / (finite * _F32(0) + _F32(constant))


def _error_terms(d: jax.Array, mode: str) -> jax.Array:
    """`|d|` (MAE) or `d * d` (MSE), each rounded once in f32.

    The square goes through its bits (clearing the sign bit, a no-op on a product of equal
    factors): XLA may otherwise fuse `err + d * d` into one FMA, which skips the rounding
    of the square (section 3's implementation note).
    """
    if mode == "mae":
        return jnp.abs(d)
    bits = jax.lax.bitcast_convert_type(d * d, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(bits, _F32)


def _candidate_error(blocks, scales, encode, used, mode: str, e4m3_max: int) -> jax.Array:
    """The error of quantizing every block with one candidate scale (section 13).

    `blocks` (..., B, 16) f32, `scales` (..., B) E4M3 and `encode` (..., B) its factors. Each
    element rounds to nearest, `v = value(e2m1(x * enc))`, is reconstructed as
    `val = ((v * f32(s)) * A) / (6M)` and contributes `|val - x|` or `(val - x)^2`; the 16
    terms are summed in f32 from +0, element 0 first. Returns (..., B).
    """
    y = blocks * encode[..., None]
    codes = formats.e2m1_magnitude_code(jnp.abs(y)) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    product = formats.scaled_code_values(codes, scales.astype(_F32)[..., None])  # exact
    scaled = product * used
    value = _divide(scaled, product, formats.fp4_e4m3_max(e4m3_max))
    terms = _error_terms(value - blocks, mode)
    err = jnp.zeros(terms.shape[:-1], _F32)
    for k in range(formats.BLOCK_SIZE):
        err = err + terms[..., k]
    return err


def _tile_error(err: jax.Array) -> jax.Array:
    """The error of each 16x16 tile from its 16 rows' (..., R, B): a fixed tree over rows.

    Row r of a tile: `a_i = r_i + r_(i+8)`, `b_i = a_i + a_(i+4)`, `c_i = b_i + b_(i+2)`,
    `E = c_0 + c_1`; repeated on each of the tile's rows, as the scales are.
    """
    *lead, rows, cols = err.shape
    t = err.reshape(*lead, rows // formats.BLOCK_SIZE, formats.BLOCK_SIZE, cols)
    for half in (8, 4, 2, 1):
        t = t[..., :half, :] + t[..., half : 2 * half, :]
    return jnp.broadcast_to(t, (*t.shape[:-2], formats.BLOCK_SIZE, cols)).reshape(err.shape)


def _four_over_six_scales(blocks, block_max, used, s_enc, s_dec, spec: QuantSpec):
    """The chosen scales and encode factors of every block (section 13), under `spec`'s 4/6.

    `base = (a_b / 6) * S_enc` (a true division by 6); map-to-6 `s6 = e4m3(min(base, 448))`,
    map-to-4 `s4 = e4m3(min(base * 1.5, 448))`; map-to-4 wins where its error is strictly
    smaller (for 16x16 tiles, the tile sums of the rows' errors), otherwise map-to-6.
    """
    # The divisor from the blocks' first elements: with 16x16 tiles `block_max` is a
    # broadcast, which XLA may push through the arithmetic that forms the divisor.
    base = _divide(block_max, blocks[..., 0], formats.FP4_MAX) * s_enc
    e4m3_max_f = _F32(formats.E4M3_MAX)
    s6 = jnp.minimum(base, e4m3_max_f).astype(jnp.float8_e4m3fn)
    s4 = jnp.minimum(base * formats.MAP_TO_4, e4m3_max_f).astype(jnp.float8_e4m3fn)
    enc6, enc4 = block_encode(s6, s_dec), block_encode(s4, s_dec)
    err6 = _candidate_error(blocks, s6, enc6, used, spec.four_over_six, spec.e4m3_max)
    err4 = _candidate_error(blocks, s4, enc4, used, spec.four_over_six, spec.e4m3_max)
    if spec.block_2d:
        err6, err4 = _tile_error(err6), _tile_error(err4)
    pick4 = err4 < err6  # strict: ties (and NaN) keep map-to-6
    return jnp.where(pick4, s4, s6), jnp.where(pick4, enc4, enc6)


def _quantize_core(xs, used, bad, seed: SRSeed | None, spec: QuantSpec):
    """Quantizes the f32 stored layout `xs` (..., C) with tensor amax `used` under `spec`.

    Returns unpacked codes uint8 (..., C) and scales float8_e4m3fn (..., C/16). Under Four
    Over Six the scales are its choice, with the global scale of E4M3 max `spec.e4m3_max`;
    stochastic rounding (`seed` not None) then rounds with the chosen scale.
    """
    s_enc = encode_scale(used, spec.e4m3_max)
    s_dec = _F32(1) / s_enc
    blocks = xs.reshape(*xs.shape[:-1], xs.shape[-1] // formats.BLOCK_SIZE, formats.BLOCK_SIZE)
    block_max = block_amax(blocks, spec.block_2d)
    if spec.four_over_six is None:
        scaled = jnp.minimum(block_max * (s_enc * _F32(formats.RCP6)), _F32(formats.E4M3_MAX))
        scales = scaled.astype(jnp.float8_e4m3fn)
        encode = block_encode(scales, s_dec)
    else:
        scales, encode = _four_over_six_scales(blocks, block_max, used, s_enc, s_dec, spec)
    y = blocks * encode[..., None]
    magnitude = jnp.abs(y)
    if seed is not None:
        random = stochastic.random_bytes(seed, y.size).reshape(y.shape)
        magnitude = stochastic.stochastic_magnitude(magnitude, random)
    codes = formats.e2m1_magnitude_code(magnitude) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    codes = jnp.where(bad, jnp.uint8(0), codes)
    scales = jnp.where(bad, _e4m3_nan(), scales)
    return codes.reshape(xs.shape), scales


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
    spec = QuantSpec(axis=axis, rht=rht, op="tensor_amax")
    x, spec, _, _, _ = spec.check_call(x, None, None)
    _, _, _, stored_amax = _prepare(jnp.moveaxis(x, spec.axis, -1), spec.rht, None)
    return stored_amax


def quantize(
    x: jax.Array,
    spec: QuantSpec | None = None,
    *,
    key: jax.Array | SRSeed | None = None,
    amax: jax.Array | None = None,
    rotation_key: jax.Array | None = None,
    **options,
) -> NVFP4Array:
    """Quantizes `x` to NVFP4 in blocks of 16 along `axis` (the specification).

    Args:
      x: as in `nvfp4_jax.quantize`.
      spec: the options as one `QuantSpec`; or, instead, `options`.
      key: as in `nvfp4_jax.quantize`.
      amax: as in `nvfp4_jax.quantize`.
      rotation_key: as in `nvfp4_jax.quantize` (MS-EDEN's rotation; or its uint32 (4,)
        words, `rotation_words`).
      **options: the keyword options of `nvfp4_jax.quantize` (`axis`, `block_2d`, `rht`,
        `stochastic_rounding`, `four_over_six`, `four_over_six_e4m3_max`, `ms_eden`), when
        no `spec`.

    Example:
      >>> x = jnp.linspace(-3.0, 3.0, 32).reshape(2, 16)
      >>> q = quantize(x)
      >>> q.codes.shape, q.scales.shape, q.shape
      ((2, 8), (2, 1), (2, 16))
      >>> quantize(x.T, QuantSpec(axis=0)).shape  # the blocks run along axis 0
      (16, 2)

    """
    spec = spec_of_call(spec, options, "quantize").replace(op="quantize")
    x, spec, seed, amax, rotation = spec.check_call(x, key, amax, rotation=rotation_key)
    stored = jnp.moveaxis(x, spec.axis, -1)
    if spec.ms_eden:
        codes, scales, stored_amax = ms_eden.quantize_stored(stored, amax, seed, rotation)
    else:
        codes, scales, stored_amax = quantize_stored(stored, amax, seed, spec.stored())
    return spec.array(codes, scales, stored_amax, x.dtype)


def fake_quantize(
    x: jax.Array,
    spec: QuantSpec | None = None,
    *,
    key: jax.Array | SRSeed | None = None,
    amax: jax.Array | None = None,
    rotation_key: jax.Array | None = None,
    **options,
) -> jax.Array:
    """Quantizes and dequantizes in one step (the specification); see `nvfp4_jax.fake_quantize`.

    The values are `value(code) * (f32(s_b) * D)`, or `value(code) * f32(s_b)` without
    `global_scale`, in x's layout, with no inverse RHT (or rotation), cast to `dtype`
    (default x's). `spec`, `key`, `amax`, `rotation_key` and `options` as in `quantize`
    (`options` also `global_scale` and `dtype`).
    """
    spec = spec_of_call(spec, options, "fake_quantize").replace(op="fake_quantize")
    x, spec, seed, amax, rotation = spec.check_call(x, key, amax, rotation=rotation_key)
    spec = spec.with_dtype(x.dtype)
    stored = jnp.moveaxis(x, spec.axis, -1)
    if spec.ms_eden:
        options = dict(global_scale=spec.global_scale, dtype=spec.dtype)
        values = ms_eden.fake_quantize_stored(stored, amax, seed, rotation, **options)
    else:
        values = fake_quantize_stored(stored, amax, seed, spec.stored())
    return jnp.moveaxis(values, -1, spec.axis)


# The specification on the stored layout (quantized axis last), arguments already checked:
# what the reference backend runs once `nvfp4_jax.ops` has checked a call.


def _whole_blocks(xs, block_2d: bool):
    """The stored layout with whole blocks (1x16 or 16x16) on every shard: `types.whole_blocks`."""
    return primal_types.whole_blocks(xs, (-2, -1) if block_2d else (-1,), formats.BLOCK_SIZE)


def quantize_stored(xs, amax, seed: SRSeed | None, spec: QuantSpec):
    """(packed codes, scales, stored amax) of `xs`, quantized along its last axis by `spec`."""
    xs = _whole_blocks(xs, spec.block_2d)
    xs, used, bad, stored_amax = _prepare(xs, spec.rht, amax)
    codes, scales = _quantize_core(xs, used, bad, seed, spec)
    return formats.pack_nibbles(codes), scales, stored_amax


def fake_quantize_stored(xs, amax, seed: SRSeed | None, spec: QuantSpec):
    """`fake_quantize` of `xs` along its last axis by `spec`, in the stored layout."""
    xs = _whole_blocks(xs, spec.block_2d)
    xs, used, bad, stored_amax = _prepare(xs, spec.rht, amax)
    codes, scales = _quantize_core(xs, used, bad, seed, spec)
    blocks = codes.reshape(*scales.shape, formats.BLOCK_SIZE)
    factor = scales.astype(_F32)
    if spec.global_scale:
        factor = factor * decode_scale(stored_amax, spec.e4m3_max)
    values = formats.scaled_code_values(blocks, factor[..., None]).reshape(xs.shape)
    return values.astype(spec.dtype)


def _code_blocks(q: NVFP4Array) -> tuple[jax.Array, jax.Array]:
    """The codes unpacked (stored layout) and as blocks `(..., C/16, 16)`.

    Under Explicit mesh axes the codes' last dim is first gathered where its shards hold
    fewer than 16 codes (`types.whole_blocks`), as the native kernel's rule gathers it.
    """
    codes = primal_types.whole_blocks(formats.unpack_nibbles(q.codes), (-1,), formats.BLOCK_SIZE)
    return codes, codes.reshape(*q.scales.shape, formats.BLOCK_SIZE)


def _dequantize_stored(q: NVFP4Array, dtype) -> jax.Array:
    if q.amax.ndim:
        # A batch of tensors made by vmap (one amax each), dequantized outside of vmap.
        return jax.vmap(lambda one: _dequantize_stored(one, dtype))(q)
    codes, blocks = _code_blocks(q)
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
    codes, blocks = _code_blocks(q)
    values = formats.scaled_code_values(blocks, q.scales.astype(_F32)[..., None])
    return values.reshape(codes.shape).astype(dtype)
