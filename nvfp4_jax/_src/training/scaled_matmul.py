"""The operands of `jax.nn.scaled_matmul`: an `NVFP4Array` as float4 data and E4M3 scales.

cuDNN's block-scaled GEMM takes `float4_e2m1fn` data and `float8_e4m3fn` scales in the plain
row-major layout (XLA swizzles them itself) and knows nothing of the tensor scale, which is
applied outside. `to_scaled_matmul_operands` gives an `NVFP4Array` in that form (a bitcast,
exact) and `from_scaled_matmul_operands` packs it back.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import checks, formats
from nvfp4_jax._src.core.array import NVFP4Array


class ScaledMatmulOperands(NamedTuple):
    """One operand of `jax.nn.scaled_matmul`, in the stored layout `(..., K)`.

    Attributes:
      data: float4_e2m1fn `(..., K)`, one E2M1 value per element.
      scales: float8_e4m3fn `(..., K / 16)`, row-major (not swizzled).
      global_scale: f32 scalar `D = amax * RCP2688`, to multiply the GEMM result by.
    """

    data: jax.Array
    scales: jax.Array
    global_scale: jax.Array


def to_scaled_matmul_operands(q: NVFP4Array) -> ScaledMatmulOperands:
    """Returns `q`'s codes as float4_e2m1fn, its scales and its global decode factor.

    The packed byte `b` at `(..., i)` holds element `2i` in its low nibble and `2i + 1` in its
    high nibble; XLA's bitcast of uint8 to float4_e2m1fn uses the same order, so this is a
    bitcast, exact. With `q.rht` the values are in the rotated basis (a GEMM of two operands
    rotated along K needs no inverse).

    Example:
      >>> import jax.numpy as jnp, nvfp4_jax
      >>> ops = nvfp4_jax.to_scaled_matmul_operands(nvfp4_jax.quantize(jnp.ones((4, 32))))
      >>> ops.data.dtype, ops.data.shape, ops.scales.shape
      (dtype(float4_e2m1fn), (4, 32), (4, 2))

    """
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"to_scaled_matmul_operands: expected an NVFP4Array, got {type(q)}")
    data = jax.lax.bitcast_convert_type(q.codes, jnp.float4_e2m1fn)  # (..., K/2, 2)
    data = data.reshape(*q.codes.shape[:-1], 2 * q.codes.shape[-1])
    return ScaledMatmulOperands(data, q.scales, q.global_scale)


def from_scaled_matmul_operands(
    data: jax.Array,
    scales: jax.Array,
    amax: jax.Array,
    *,
    dtype=jnp.bfloat16,
    axis: int = -1,
    block_2d: bool = False,
    rht: bool = False,
) -> NVFP4Array:
    """Packs float4_e2m1fn values, E4M3 scales and the tensor amax into an `NVFP4Array`.

    Inverse of `to_scaled_matmul_operands` (the amax is passed, not the decode factor: `A`
    cannot be recovered exactly from `A * RCP2688`). `data` is in the stored layout; `dtype`,
    `axis`, `block_2d`, `rht` are the metadata of the array it came from.
    """
    op = "from_scaled_matmul_operands"
    data, scales = jnp.asarray(data), jnp.asarray(scales)
    if data.dtype != jnp.float4_e2m1fn or scales.dtype != jnp.float8_e4m3fn:
        raise TypeError(
            f"{op}: data must be float4_e2m1fn and scales float8_e4m3fn, "
            f"got {data.dtype} and {scales.dtype}"
        )
    if (
        data.ndim < 1
        or data.shape[-1] % formats.BLOCK_SIZE
        or scales.shape != (*data.shape[:-1], data.shape[-1] // formats.BLOCK_SIZE)
    ):
        raise ValueError(
            f"{op}: data {data.shape} needs a last axis that is a multiple of "
            f"{formats.BLOCK_SIZE} and scales of shape (..., K/16), got scales {scales.shape}"
        )
    axis = checks.normalize_axis(axis, data.shape, op)
    pairs = data.reshape(*data.shape[:-1], data.shape[-1] // 2, 2)
    codes = jax.lax.bitcast_convert_type(pairs, jnp.uint8)
    return NVFP4Array(
        codes=codes,
        scales=scales,
        amax=jnp.asarray(amax, jnp.float32),
        dtype=checks.check_dtype(dtype, op),
        axis=axis,
        block_2d=checks.check_flag(block_2d, op, "block_2d"),
        rht=checks.check_flag(rht, op, "rht"),
    )
