"""MS-EDEN (Quartet II's unbiased backward quantizer), the specification in pure jnp.

Shape letters: the stored layout `xs` is `(..., C)`, C a multiple of G = 128 (the rotation
group); B = 16 (the NVFP4 block), 8 blocks per group. The numbers are docs/NUMERICS.md
section 14's:

    y     = R * FWHT_128(s * x)                 per group, in f32 (the random rotation)
    A     = max |y|                             (or the caller's amax)
    S_enc = min(C / A, FLT_MAX), 1 if A == 0 or S_enc == 0;  S_dec = 1 / S_enc
    s_b   = e4m3(min(a_b * (S_enc * RCPV), 448)), replaced by 1 when it is 0
    y_k   = y * min(1 / (f32(s_b) * S_dec), FLT_MAX);  v_k = e2m1_rn(y_k)
    c_g   = sum_g y_k^2 / sum_g y_k v_k         (per group; 1 if the denominator is 0)
    s'_b  = sr_e4m3(min(f32(s_b) * c_g, 448))   (to a neighbouring E4M3 value, unbiased)
    x_hat = v_k * (f32(s'_b) * D),              D = A * RCPC

with C = 256 * V, V = f32(6 / (17/16 * 0.93)), RCPV = f32(1/V), RCPC = f32(1/C),
R = f32(1/sqrt(128)); the sums over a group run block by block in a fixed order. The random
inputs are the rotation's 128 signs (`rotation`, uint32 (4,)) and one 24-bit uniform per
block from the `SRSeed` (`block_uniforms`).

These functions are free, pure and jit-able; the public ops run them for
`implementation="reference"`, and the native kernels are tested against them bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.random import threefry_2x32

from nvfp4_jax._src.core import formats, primal_types
from nvfp4_jax._src.core.sr_seed import SRSeed

_F32 = jnp.float32
_U32 = jnp.uint32
_GROUP = formats.MS_EDEN_GROUP
_BLOCKS = _GROUP // formats.BLOCK_SIZE


def rotation_words(key: jax.Array) -> jax.Array:
    """The rotation of a PRNG key: uint32 `(4,)`, `jax.random.bits(key, (4,), uint32)`.

    Bit `i % 32` of word `i // 32` set means that sign i of the 128 is -1.

    Example:
      >>> rotation_words(jax.random.key(0)).shape
      (4,)
    """
    return jax.random.bits(key, (4,), _U32)


def _signs(rotation: jax.Array) -> jax.Array:
    """f32 (128,): -1 where sign i of the rotation is -1, else +1.

    Multiplying by them is exact (the sign flip the native kernels do on the bits), and,
    unlike a bit operation, linear: JAX can transpose it for the derivative rules.
    """
    words = jnp.asarray(rotation, _U32)
    index = jnp.arange(_GROUP, dtype=_U32)
    bits = (words[index >> 5] >> (index & 31)) & 1
    return _F32(1) - _F32(2) * bits.astype(_F32)


def _fwht(v: jax.Array) -> jax.Array:
    """The Walsh-Hadamard butterflies of every 128-group of the last axis, h = 1, 2, ..., 64.

    Pair (i, i + h), `i & h == 0`, becomes `(v_i + v_(i+h), v_i - v_(i+h))`, in f32.
    """
    lead = v.shape[:-1]
    h = 1
    while h < _GROUP:
        pairs = v.reshape(*lead, -1, 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, -1)
        h *= 2
    return v


def _flip(v: jax.Array, signs: jax.Array) -> jax.Array:
    """`v` times the group position's sign (+-1, exact)."""
    groups = v.reshape(*v.shape[:-1], -1, _GROUP)
    return (groups * signs).reshape(v.shape)


def apply_rotation(x: jax.Array, rotation: jax.Array, *, inverse: bool = False) -> jax.Array:
    """MS-EDEN's random rotation of every 128-group along the last axis, in f32.

    Forward: `y = R * FWHT(s * x)`; inverse: `x = s * (R * FWHT(y))`, with `s` the signs of
    `rotation` (uint32 (4,), `rotation_words`) and `R = f32(1/sqrt(128))`. The rotation is
    orthogonal, so two operands rotated with the same signs along their contraction axis
    multiply to the product of the unrotated ones (up to f32 rounding).

    Args:
      x: bf16, f16 or f32 with a last axis that is a multiple of 128.
      rotation: uint32 (4,), the 128 sign bits.
      inverse: apply the inverse rotation.

    Returns:
      f32 of x's shape.

    Example:
      >>> x = jnp.arange(128.0)
      >>> r = rotation_words(jax.random.key(1))
      >>> bool(jnp.allclose(apply_rotation(apply_rotation(x, r), r, inverse=True), x, atol=1e-4))
      True
    """
    if x.ndim == 0 or x.shape[-1] % _GROUP:
        raise ValueError(
            f"apply_rotation: the last axis of x must be a multiple of {_GROUP}, got {x.shape}"
        )
    v = x.astype(_F32)
    if v.size == 0:
        return v
    signs = _signs(rotation)
    if not inverse:
        v = _flip(v, signs)
    v = _fwht(v) * _F32(formats.MS_EDEN_RCP_SQRT_GROUP)
    return _flip(v, signs) if inverse else v


def block_uniforms(seed: SRSeed, blocks: int) -> jax.Array:
    """f32 `(blocks,)`: block b's uniform in [0, 1), a multiple of 2^-24.

    Block b (its flat index in the stored layout; its first element is number 16b) hashes
    the counter `j = counter_offset + 2b` (64-bit, carry into the high word) as
    `threefry2x32((k0, k1), (j >> 32, j & 0xFFFFFFFF))` and takes the top 24 bits of the
    first output word: `u = (w0 >> 8) * 2^-24`. These are the four random bytes section 7
    gives element 16b, read as one little-endian word.
    """
    if blocks == 0:
        return jnp.zeros((0,), _F32)
    local = jnp.arange(blocks, dtype=_U32) * _U32(2)
    base = jnp.asarray(seed.counter_offset, _U32)
    low = local + base[0]  # wraps modulo 2**32; the carry goes into the high word
    high = base[1] + (low < local).astype(_U32)
    words = jnp.asarray(seed.key_words, _U32)
    hashed = threefry_2x32((words[0], words[1]), jnp.concatenate([high, low]))
    first = hashed[:blocks]
    return (first >> 8).astype(_F32) * _F32(2.0**-24)


def _square_terms(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a * b` rounded once in f32 for non-negative products (a and b of one sign).

    Through the bits, clearing the sign (a no-op here): XLA may otherwise contract the
    following addition into an FMA, which skips the product's rounding (section 3).
    """
    bits = jax.lax.bitcast_convert_type(a * b, _U32) & _U32(0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(bits, _F32)


def _block_sums(terms: jax.Array) -> jax.Array:
    """(..., B, 16) -> (..., B): each block's 16 terms summed in order from +0."""
    total = jnp.zeros(terms.shape[:-1], _F32)
    for k in range(formats.BLOCK_SIZE):
        total = total + terms[..., k]
    return total


def _group_sums(block_sums: jax.Array) -> jax.Array:
    """(..., G*8) -> (..., G): each group's 8 block sums in order from +0."""
    groups = block_sums.reshape(*block_sums.shape[:-1], block_sums.shape[-1] // _BLOCKS, _BLOCKS)
    total = jnp.zeros(groups.shape[:-1], _F32)
    for j in range(_BLOCKS):
        total = total + groups[..., j]
    return total


def _e4m3_value(byte: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(_F32)


def round_scale(target: jax.Array, uniform: jax.Array) -> jax.Array:
    """Stochastic rounding of f32 `target` in [0, 448] to a neighbouring E4M3 value (bytes).

    `lo` is the largest E4M3 value <= target, `hi` the next one up; the result is `hi` when
    `uniform * (hi - lo) < target - lo` (both sides exact), else `lo`: `hi` with probability
    `(target - lo) / (hi - lo)` to within 2^-24, so E[scale] = target. An E4M3 target is kept.
    """
    nearest = target.astype(jnp.float8_e4m3fn)
    byte = jax.lax.bitcast_convert_type(nearest, jnp.uint8)
    lo = jnp.where(nearest.astype(_F32) > target, byte - jnp.uint8(1), byte)
    lo_value = _e4m3_value(lo)
    step = _e4m3_value(lo + jnp.uint8(1)) - lo_value
    up = uniform * step < target - lo_value
    return jnp.where(up, lo + jnp.uint8(1), lo)


def _rotated(xs: jax.Array, rotation: jax.Array, amax):
    """(f32 rotated layout, the amax used, whether the result is NaN, the amax to store)."""
    ys = apply_rotation(xs, rotation)
    nonfinite = jnp.any(~jnp.isfinite(ys))
    max_abs = jnp.max(jnp.abs(ys), initial=_F32(0))
    used = max_abs if amax is None else jnp.asarray(amax).astype(_F32)
    bad = nonfinite | formats.invalid_amax(used)
    return ys, used, bad, jnp.where(bad, _F32(jnp.nan), used)


def encode_scale(amax: jax.Array) -> jax.Array:
    """MS-EDEN's `S_enc = min(C / A, FLT_MAX)`, 1 where A == 0 or S_enc == 0."""
    amax = jnp.asarray(amax).astype(_F32)
    s_enc = jnp.minimum(_F32(formats.MS_EDEN_C) / amax, _F32(formats.FLT_MAX))
    return jnp.where((amax == 0) | (s_enc == 0), _F32(1), s_enc)


def decode_scale(amax: jax.Array) -> jax.Array:
    """MS-EDEN's tensor decode factor `D = A * RCPC` (a multiplication, as section 3's)."""
    return jnp.asarray(amax).astype(_F32) * _F32(formats.MS_EDEN_RCP_C)


def _codes_and_scales(ys, used, bad, seed: SRSeed):
    """Unpacked codes uint8 (..., C) and E4M3 scales (..., C/16) of the rotated `ys`."""
    s_enc = encode_scale(used)
    s_dec = _F32(1) / s_enc
    blocks = ys.reshape(*ys.shape[:-1], ys.shape[-1] // formats.BLOCK_SIZE, formats.BLOCK_SIZE)
    block_max = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = jnp.minimum(block_max * (s_enc * _F32(formats.MS_EDEN_RCP_VAL_MAX)), _F32(448))
    scales = scaled.astype(jnp.float8_e4m3fn).astype(_F32)
    scales = jnp.where(scales == 0, _F32(1), scales)
    encode = jnp.minimum(_F32(1) / (scales * s_dec), _F32(formats.FLT_MAX))
    y = blocks * encode[..., None]
    codes = formats.e2m1_magnitude_code(jnp.abs(y)) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    values = formats.scaled_code_values(codes, _F32(1))
    num = _group_sums(_block_sums(_square_terms(y, y)))
    den = _group_sums(_block_sums(_square_terms(y, values)))
    correction = jnp.where(den == 0, _F32(1), num / jnp.where(den == 0, _F32(1), den))
    # Each group's correction on its 8 blocks: a broadcast and a merge, which keep a sharding
    # of the groups in the type (`jnp.repeat` needs its result's sharding spelled out).
    per_block = jnp.broadcast_to(correction[..., None], (*correction.shape, _BLOCKS))
    per_block = per_block.reshape(scales.shape)
    target = jnp.minimum(scales * per_block, _F32(448))
    uniform = block_uniforms(seed, target.size).reshape(target.shape)
    chosen = jax.lax.bitcast_convert_type(round_scale(target, uniform), jnp.float8_e4m3fn)
    codes = jnp.where(bad, jnp.uint8(0), codes)
    nan = jax.lax.bitcast_convert_type(jnp.uint8(formats.E4M3_NAN_BYTE), jnp.float8_e4m3fn)
    chosen = jnp.where(bad, nan, chosen)
    return codes.reshape(ys.shape), chosen


def _whole_groups(xs):
    """The stored layout with whole 128-groups on every shard (`types.whole_blocks`)."""
    return primal_types.whole_blocks(xs, (-1,), _GROUP)


def quantize_stored(xs, amax, seed: SRSeed, rotation: jax.Array):
    """(packed codes, scales, stored amax) of `xs` (..., C), MS-EDEN along its last axis."""
    ys, used, bad, stored_amax = _rotated(_whole_groups(xs), rotation, amax)
    codes, scales = _codes_and_scales(ys, used, bad, seed)
    return formats.pack_nibbles(codes), scales, stored_amax


def fake_quantize_stored(xs, amax, seed: SRSeed, rotation: jax.Array, *, global_scale, dtype):
    """The values `v * (f32(s'_b) * D)` (or `v * f32(s'_b)`) of `xs` (..., C), rotated."""
    ys, used, bad, stored_amax = _rotated(_whole_groups(xs), rotation, amax)
    codes, scales = _codes_and_scales(ys, used, bad, seed)
    blocks = codes.reshape(*scales.shape, formats.BLOCK_SIZE)
    factor = scales.astype(_F32)
    if global_scale:
        factor = factor * decode_scale(stored_amax)
    values = formats.scaled_code_values(blocks, factor[..., None]).reshape(ys.shape)
    return values.astype(dtype)


def tensor_amax_stored(xs, rotation: jax.Array) -> jax.Array:
    """`max |y|` of the rotated `xs` (..., C), NaN if any rotated value is not finite."""
    _, _, _, stored_amax = _rotated(_whole_groups(xs), rotation, None)
    return stored_amax
