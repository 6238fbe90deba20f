"""The argument checks every entry point shares: dtypes, flags, axes, blocks, amax, 4/6.

They live here, near the bottom of the package (above `formats` only), so that the
reference, the public ops and everything above them reject bad input with the same message.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core.formats import (
    BLOCK_SIZE,
    E4M3_MAX,
    FOUR_OVER_SIX_E4M3_MAXES,
    FOUR_OVER_SIX_MODES,
    SUPPORTED_DTYPES,
    stored_shape,
)

_DTYPE_NAMES = "bfloat16, float16 or float32"


def choices_of(choices) -> tuple:
    """The values a `typing.Literal` type allows (via `typing.get_args`), or a tuple as it is."""
    if typing.get_origin(choices) is typing.Literal:
        return typing.get_args(choices)
    return tuple(choices)


def check_choice(name: str, value, choices, *, allow_none: bool = False):
    """Returns `value`, raising a ValueError unless it is one of `choices`.

    `choices` is a `typing.Literal` type (its values are the choices) or a tuple; with
    `allow_none`, None is a choice too (listed first). `name` says which argument, with its
    owner: "NVFP4Recipe.backward", "runs_natively: op". The message names it, the choices
    and the value given: "NVFP4Recipe.backward must be one of ('nvidia', 'ms_eden'), got 'x'".
    """
    allowed = ((None,) if allow_none else ()) + choices_of(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


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


def check_rht_input(x, op: str = "apply_rht") -> jax.Array:
    """Returns `x` as an array, raising unless it is bf16/f16/f32 with a last axis of 16s."""
    x = as_float_array(x, op)
    if x.ndim == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"{op}: the last axis of x must be a multiple of {BLOCK_SIZE} for the RHT, "
            f"got shape {x.shape}"
        )
    return x


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
