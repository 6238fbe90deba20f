"""The NVFP4 format: its constants, the stored layout, the scale factors and the E2M1 codes.

NVFP4 stores each value as a 4-bit E2M1 code (bit 3 the sign, codes 0..7 the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6), one E4M3 scale per block of 16 values and one f32 amax per
tensor. Two codes share a byte: element 2i in the low nibble, element 2i+1 in the high one
(docs/NUMERICS.md section 1).

The argument checks that use these constants live in `checks`, one rank above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_SIZE = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0
# 6 * 448, exact in f32: the largest value a block can decode to, per unit of S_dec.
FP4_E4M3_MAX = FP4_MAX * E4M3_MAX
FLT_MAX = float(np.finfo(np.float32).max)
# f32(1/6), bits 0x3E2AAAAB, and f32(1/2688): every implementation multiplies by these.
RCP6 = np.float32(1.0) / np.float32(6.0)
RCP2688 = np.float32(1.0) / np.float32(FP4_E4M3_MAX)
# The E4M3 NaN byte: every scale of a tensor with non-finite input (section 8).
E4M3_NAN_BYTE = 0x7F

# Four Over Six (docs/NUMERICS.md section 13): the candidate error measures, and the E4M3
# maxima M its global scale may use (S_enc = 6M / A, D = A * f32(1/(6M))); plain NVFP4 is
# M = 448. 256 is the default under 4/6: it leaves room for the map-to-4 expansion (x1.5).
FOUR_OVER_SIX_MODES = ("mae", "mse")
FOUR_OVER_SIX_E4M3_MAXES = (256, 448)
FOUR_OVER_SIX_DEFAULT_E4M3_MAX = 256
# The expansion factor of map-to-4: the block amax goes to 4 instead of 6.
MAP_TO_4 = np.float32(1.5)

# MS-EDEN (docs/NUMERICS.md section 14): the rotation group, the E2M1 value the block amax
# maps to, V = f32(6 / (17/16 * 0.93)) (Quartet II's backward `scale_override`, 0.93 times
# its 17/16), the E4M3 value the tensor amax maps to (256: room for the correction to scale
# a block up), C = 256 * V (exact), and the f32 reciprocals every implementation multiplies by.
MS_EDEN_GROUP = 128
MS_EDEN_VAL_MAX = np.float32(6.0 / (17.0 / 16.0 * 0.93))  # bits 0x40C24EB2
MS_EDEN_E4M3_MAX = 256
MS_EDEN_C = np.float32(MS_EDEN_E4M3_MAX) * MS_EDEN_VAL_MAX  # bits 0x44C24EB2
MS_EDEN_RCP_VAL_MAX = np.float32(1.0) / MS_EDEN_VAL_MAX  # bits 0x3E28A3D7
MS_EDEN_RCP_C = np.float32(1.0) / MS_EDEN_C  # bits 0x3A28A3D7
MS_EDEN_RCP_SQRT_GROUP = np.float32(1.0 / np.sqrt(128.0))  # bits 0x3DB504F3

# Round-to-nearest-even decision edges between consecutive E2M1 magnitudes. An edge that
# is a tie rounds to the even code: ties at 0.25, 1.25, 2.5 and 5 go down (">" below),
# ties at 0.75, 1.75 and 3.5 go up (">=" below).
_EDGES_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_EDGES_TIE_UP = (0.75, 1.75, 3.5)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def stored_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """The shape of the stored layout: `shape` with the quantized `axis` moved last."""
    rest = list(shape)
    last = rest.pop(axis)
    return (*rest, last)


def fp4_e4m3_max(e4m3_max: int = 448) -> np.float32:
    """`6 * M`, exact in f32: 2688 for plain NVFP4 (M = 448), 1536 for 4/6 with M = 256."""
    return np.float32(FP4_MAX * e4m3_max)


def rcp_fp4_e4m3_max(e4m3_max: int = 448) -> np.float32:
    """`f32(1 / (6 * M))`: RCP2688 (bits 0x39C30C31), or for M = 256 bits 0x3A2AAAAB."""
    return np.float32(1.0) / fp4_e4m3_max(e4m3_max)


def decode_scale(amax, e4m3_max: int = 448) -> jax.Array:
    """The tensor decode factor `D = A * f32(1/(6M))`: `A * RCP2688` for plain NVFP4.

    A multiplication (docs/NUMERICS.md section 3); `e4m3_max` is the M of the global scale
    (256 for a Four Over Six tensor quantized with its default, section 13).
    """
    return jnp.asarray(amax).astype(jnp.float32) * rcp_fp4_e4m3_max(e4m3_max)


def ms_eden_decode_scale(amax) -> jax.Array:
    """MS-EDEN's tensor decode factor `D = A * f32(1/C)` (docs/NUMERICS.md section 14)."""
    return jnp.asarray(amax).astype(jnp.float32) * MS_EDEN_RCP_C


def invalid_amax(amax: jax.Array) -> jax.Array:
    """Whether an f32 tensor amax is invalid: NaN, +-inf or negative (-0 is not).

    docs/NUMERICS.md section 8: an invalid amax gives the NaN tensor. Read from the bits, as
    the native kernels do (`AmaxValid`, ffi/include/nvfp4/numerics.h), never by comparing:
    XLA on CPU may flush an f32 subnormal to zero in a comparison, so a negative subnormal
    amax passed `amax >= 0` in some programs and not in others.
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax).astype(jnp.float32), jnp.uint32)
    return (bits >= jnp.uint32(0x7F800000)) & (bits != jnp.uint32(0x80000000))


def e2m1_magnitude_code(magnitude: jax.Array) -> jax.Array:
    """Returns the E2M1 code 0..7 nearest to a non-negative f32 magnitude.

    Rounds to nearest, ties to even, saturating at 6. NaN maps to code 0. Branch-free: the
    code is the number of decision edges the value passes.
    """
    count = jnp.zeros(magnitude.shape, jnp.uint8)
    for edge in _EDGES_TIE_DOWN:
        count = count + (magnitude > edge).astype(jnp.uint8)
    for edge in _EDGES_TIE_UP:
        count = count + (magnitude >= edge).astype(jnp.uint8)
    return count


# Every E2M1 value is m * 2^e with m in {0, 1, 3}. `scaled_code_values` uses this split so
# that its only rounding multiply (factor * 3) never feeds an add directly: XLA contracts a
# multiply followed by an add into one FMA on CPU and GPU (an optimization barrier does not
# stop it), which would skip the rounding of `value * factor` (docs/NUMERICS.md section 3).
# Magnitude code c: 0 -> 0; 1 -> 1 * 2^-1; even c >= 2 -> 1 * 2^(c/2 - 1); odd c >= 3 ->
# 3 * 2^((c - 3)/2 - 1). Computed with integer ops and selects (elementwise, so XLA fuses and
# vectorizes them) rather than by indexing a table, which XLA runs as a gather.


def _code_pow2(codes: jax.Array) -> jax.Array:
    """The signed power of two `+-2^e` of each unpacked code (+-0 for the codes of zero)."""
    magnitude = (codes & 7).astype(jnp.int32)
    odd = magnitude & 1
    exponent = (magnitude >> 1) - 1 - odd  # c >= 2
    exponent = jnp.where(magnitude == 1, -1, exponent)
    sign = (codes.astype(jnp.int32) & 8) << 28
    bits = jnp.where(magnitude == 0, 0, (exponent + 127) << 23) | sign  # +-0 for the zero codes
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def scaled_code_values(codes: jax.Array, factor: jax.Array) -> jax.Array:
    """Returns `f32(value(code)) * factor`, rounded once in f32, for unpacked codes.

    `factor` broadcasts against `codes`. Computed as `(factor * 3 or factor) * 2^e`, where
    the last multiplication is exact, so the result is the correctly rounded product even
    when XLA fuses it into a following addition (outside f32's subnormal range).
    """
    magnitude = codes & 7
    triple = (magnitude >= 3) & ((magnitude & 1) == 1)
    base = jnp.where(triple, factor * jnp.float32(3), factor)
    return base * _code_pow2(codes)


# The shift of each code of a byte's pair: element 2i by 0 bits (low nibble), 2i+1 by 4.
_NIBBLE_SHIFTS = np.array([0, 4], np.uint8)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Packs uint8 codes (..., C) into bytes (..., C/2): element 2i in the low nibble.

    Each pair of codes, shifted into its nibble, is OR-reduced into its byte. (Two strided
    slices, `codes[..., 0::2] | codes[..., 1::2] << 4`, give the same bytes, but XLA's CPU
    code generator takes up to 2 s to compile that kernel at some small shapes, e.g. after
    a transpose of 64 x 128 codes; the reduction compiles in milliseconds at every shape.)
    """
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return jax.lax.reduce(
        pairs << _NIBBLE_SHIFTS, np.uint8(0), jax.lax.bitwise_or, (pairs.ndim - 1,)
    )


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Unpacks bytes (..., C/2) into uint8 codes (..., C); inverse of `pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
