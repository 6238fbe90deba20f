"""NVFP4 format constants, the E2M1 code table and nibble packing.

NVFP4 stores each value as a 4-bit E2M1 code (bit 3 the sign, codes 0..7 the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6), one E4M3 scale per block of 16 values and one f32 amax per
tensor. Two codes share a byte: element 2i in the low nibble, element 2i+1 in the high one.
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

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# Value of every 4-bit code, sign included (0x8 is -0).
E2M1_CODE_VALUES = np.concatenate([E2M1_VALUES, -E2M1_VALUES])

# Round-to-nearest-even decision edges between consecutive E2M1 magnitudes. An edge that
# is a tie rounds to the even code: ties at 0.25, 1.25, 2.5 and 5 go down (">" below),
# ties at 0.75, 1.75 and 3.5 go up (">=" below).
_EDGES_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_EDGES_TIE_UP = (0.75, 1.75, 3.5)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def as_float_array(x, op: str, name: str = "x") -> jax.Array:
    """Returns `x` as a jax array, raising unless its dtype is bf16, f16 or f32.

    The dtype is checked before conversion: `jnp.asarray` would silently turn a NumPy
    float64 array into float32 when x64 is off.
    """
    dtype = getattr(x, "dtype", None)
    array = jnp.asarray(x)
    dtype = jnp.dtype(dtype if dtype is not None else array.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: {name} must be bfloat16, float16 or float32, got dtype {dtype} "
            f"(shape {jnp.shape(x)})"
        )
    return array


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


def code_values(codes: jax.Array) -> jax.Array:
    """Decodes unpacked 4-bit codes (uint8 0..15) to their f32 values."""
    return jnp.asarray(E2M1_CODE_VALUES)[codes.astype(jnp.int32)]


# Every E2M1 value is m * 2^e with m in {0, 1, 3}. `scaled_code_values` uses this split so
# that its only rounding multiply (factor * 3) never feeds an add directly: XLA contracts a
# multiply followed by an add into one FMA on CPU and GPU (an optimization barrier does not
# stop it), which would skip the rounding of `value * factor` that NUMERICS.md prescribes.
_CODE_POW2 = np.array([0.0, 0.5, 1.0, 0.5, 2.0, 1.0, 4.0, 2.0], dtype=np.float32)
_CODE_POW2 = np.concatenate([_CODE_POW2, -_CODE_POW2])
_CODE_IS_TRIPLE = np.array([0, 0, 0, 1, 0, 1, 0, 1] * 2, dtype=bool)


def scaled_code_values(codes: jax.Array, factor: jax.Array) -> jax.Array:
    """Returns `f32(value(code)) * factor`, rounded once in f32, for unpacked codes.

    `factor` broadcasts against `codes`. Computed as `(factor * 3 or factor) * 2^e`, where
    the last multiplication is exact, so the result is the correctly rounded product even
    when XLA fuses it into a following addition (outside f32's subnormal range).
    """
    index = codes.astype(jnp.int32)
    base = jnp.where(jnp.asarray(_CODE_IS_TRIPLE)[index], factor * jnp.float32(3), factor)
    return base * jnp.asarray(_CODE_POW2)[index]


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Packs uint8 codes (..., C) into bytes (..., C/2): element 2i in the low nibble."""
    low = codes[..., 0::2]
    high = codes[..., 1::2]
    return (low | (high << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Unpacks bytes (..., C/2) into uint8 codes (..., C); inverse of `pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
