"""NVFP4 format constants, the E2M1 code table, nibble packing and argument checks.

NVFP4 stores each value as a 4-bit E2M1 code (bit 3 the sign, codes 0..7 the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6), one E4M3 scale per block of 16 values and one f32 amax per
tensor. Two codes share a byte: element 2i in the low nibble, element 2i+1 in the high one
(docs/NUMERICS.md section 1).

The argument checks live here, at the bottom of the package, so that the reference, the
public ops and everything above them reject bad input with the same message.
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

# Round-to-nearest-even decision edges between consecutive E2M1 magnitudes. An edge that
# is a tie rounds to the even code: ties at 0.25, 1.25, 2.5 and 5 go down (">" below),
# ties at 0.75, 1.75 and 3.5 go up (">=" below).
_EDGES_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_EDGES_TIE_UP = (0.75, 1.75, 3.5)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_DTYPE_NAMES = "bfloat16, float16 or float32"


# --- argument checks ---------------------------------------------------------------------


def as_float_array(x, op: str, name: str = "x") -> jax.Array:
    """Returns `x` as a jax array, raising unless its dtype is bf16, f16 or f32.

    The dtype is checked before conversion: `jnp.asarray` would silently turn a NumPy
    float64 array into float32 when x64 is off.
    """
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
    dtype = getattr(x, "dtype", None)
    array = jnp.asarray(x)
    dtype = jnp.dtype(dtype if dtype is not None else array.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: {name} must be {_DTYPE_NAMES}, got dtype {dtype} (shape {np.shape(array)})"
        )
    return array


def check_dtype(dtype, op: str, name: str = "dtype") -> jnp.dtype:
    """Returns `dtype` as a `jnp.dtype`, raising unless it is bf16, f16 or f32."""
    if dtype is None:
        raise TypeError(f"{op}: {name} must be {_DTYPE_NAMES}, got None")
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{op}: {name} must be {_DTYPE_NAMES}, got {dtype!r}") from None
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} must be {_DTYPE_NAMES}, got {dtype}")
    return dtype


def check_flag(value, op: str, name: str) -> bool:
    """Returns `value` if it is a Python or NumPy bool, else raises a TypeError naming it."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a bool, got {value!r}")
    return bool(value)


def normalize_axis(axis, shape: tuple[int, ...], op: str, name: str = "axis") -> int:
    """Returns `axis` as a negative index into `shape`, raising if it is not an int in range.

    `bool` is rejected although it is an `int` subclass: `axis=True` is a mistake, not 1.
    """
    ndim = len(shape)
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {axis!r} for shape {tuple(shape)}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: {name}={axis} is out of range for shape {tuple(shape)}")
    return int(axis) - ndim if axis >= 0 else int(axis)


def stored_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """The shape of the stored layout: `shape` with the quantized `axis` moved last."""
    rest = list(shape)
    last = rest.pop(axis)
    return (*rest, last)


def check_blocks(shape: tuple[int, ...], axis: int, block_2d: bool, op: str) -> None:
    """Raises unless `shape` splits into 1x16 blocks along `axis` (16x16 with `block_2d`).

    A quantized axis of length 0 is a multiple of 16: zero-size tensors are valid.
    """
    if shape[axis] % BLOCK_SIZE:
        raise ValueError(
            f"{op}: the quantized axis (axis={axis}) of x with shape {tuple(shape)} has size "
            f"{shape[axis]}, which is not a multiple of {BLOCK_SIZE}"
        )
    if block_2d:
        stored = stored_shape(shape, axis)
        if len(stored) < 2 or stored[-2] % BLOCK_SIZE:
            raise ValueError(
                f"{op}: block_2d=True needs 16x16 tiles, but x of shape {tuple(shape)} "
                f"quantized along axis={axis} is stored as {stored}, whose rows "
                f"(second-to-last axis) are not a multiple of {BLOCK_SIZE}"
            )


def _concrete_float(value) -> float | None:
    """The value of a concrete scalar, or None for a tracer (known only at run time)."""
    if isinstance(value, jax.core.Tracer):
        return None
    return float(np.asarray(value, np.float32))


def check_amax(amax, op: str) -> jax.Array | None:
    """Returns a caller-given amax as an f32 scalar (None stays None), raising if invalid.

    A concrete amax must be finite and non-negative (NaN, inf or negative is an error); a
    traced one cannot be checked here and is handled as a NaN amax when invalid
    (docs/NUMERICS.md section 8).
    """
    if amax is None:
        return None
    if isinstance(amax, (bool, np.bool_, str, bytes, list, tuple, dict, set)):
        raise TypeError(f"{op}: amax must be a float scalar, got {amax!r}")
    dtype = jnp.result_type(amax)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{op}: amax must be a float scalar, got dtype {dtype}")
    if jnp.shape(amax) != ():
        raise ValueError(f"{op}: amax must be a scalar, got shape {jnp.shape(amax)}")
    value = _concrete_float(amax)
    if value is not None and not 0 <= value < np.inf:
        raise ValueError(f"{op}: amax must be a finite, non-negative number, got {value}")
    return jnp.asarray(amax).astype(jnp.float32)


def check_four_over_six(
    four_over_six, e4m3_max, op: str, e4m3_name: str = "four_over_six_e4m3_max"
) -> tuple[str | None, int]:
    """Validates the 4/6 arguments; returns (None, 448) when off, else (mode, M).

    `four_over_six` is None, "mae" or "mse"; `e4m3_max` (the argument
    `four_over_six_e4m3_max`) is 256 or 448 and is ignored when 4/6 is off.
    """
    names = ", ".join(repr(m) for m in FOUR_OVER_SIX_MODES)
    if four_over_six is not None and not isinstance(four_over_six, str):
        raise TypeError(f"{op}: four_over_six must be None, {names}, got {four_over_six!r}")
    if four_over_six is not None and four_over_six not in FOUR_OVER_SIX_MODES:
        raise ValueError(f"{op}: four_over_six must be None, {names}, got {four_over_six!r}")
    maxes = " or ".join(str(m) for m in FOUR_OVER_SIX_E4M3_MAXES)
    if isinstance(e4m3_max, (bool, np.bool_)) or not isinstance(e4m3_max, (int, np.integer)):
        raise TypeError(f"{op}: {e4m3_name} must be the int {maxes}, got {e4m3_max!r}")
    if int(e4m3_max) not in FOUR_OVER_SIX_E4M3_MAXES:
        raise ValueError(f"{op}: {e4m3_name} must be {maxes}, got {e4m3_max!r}")
    if four_over_six is None:
        return None, int(E4M3_MAX)
    return four_over_six, int(e4m3_max)


# --- scales ---------------------------------------------------------------------------------


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


# --- codes ---------------------------------------------------------------------------------


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
