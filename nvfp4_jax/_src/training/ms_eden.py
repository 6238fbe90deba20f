"""Quartet II's backward GEMMs: MS-EDEN on dy and the forward's quantized operands.

What `NVFP4Recipe(backward="ms_eden")` runs for dgrad and wgrad (docs/NUMERICS.md section 14;
Quartet II's `Quartet_II_fn.backward`). Shape letters as in `dot_general`: x (M, K),
W (K, N), dy (M, N); `x_q` and `W_q` are the forward's quantized x (1x16 along K) and W
(16x16, or 1x16 along K), as their block values `value(code) * s_b` times their decode
factor `D`:

    dgrad  dx = E(dy; along N) @ E(W_q; along N)^T              (rotation r_dgrad)
    wgrad  dW = E(x_q^T; along M) @ E(dy^T; along M)^T          (rotation r_wgrad)

`E` is MS-EDEN along the contraction axis, zero-padded to a multiple of 128 (zeros add
nothing to a product, rotated or not); the two operands of a GEMM share its rotation and
draw their scales' rounding from their own seeds (`keys.ms_eden_randomness`). A re-quantized
operand is the block values of the packed residual, quantized, with the residual's `D`
multiplied into the operand's decode factor: MS-EDEN of `D * v` and of `v` differ only in
the tensor scale, and the exact block values keep one rounding out of the operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import formats, ops
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.sr_keys import GemmRandomness
from nvfp4_jax._src.training import gemm
from nvfp4_jax._src.training.recipe import NVFP4Recipe


def pad_contraction(v: jax.Array) -> jax.Array:
    """`v` with its last axis zero-padded to a multiple of 128 (MS-EDEN's groups)."""
    pad = -v.shape[-1] % formats.MS_EDEN_GROUP
    if not pad:
        return v
    return jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])


def _operand(v, seed, rotation, recipe: NVFP4Recipe, decode=None) -> gemm.Operand:
    """`v` (rows, C) MS-EDEN-quantized along C (padded) into a GEMM operand.

    `decode`: the decode factor `v` stands for (a residual's `D`), multiplied into the
    operand's.
    """
    operand = gemm.quantize_operand(
        pad_contraction(v),
        recipe.ms_eden_spec(),
        key=seed,
        rotation=rotation,
        backend=recipe.gemm_backend,
        dtype=recipe.gemm_dtype,
        implementation=recipe.implementation,
    )
    if decode is None:
        return operand
    return gemm.Operand(operand.data, operand.decode * decode)


def _values(q: NVFP4Array, recipe: NVFP4Recipe) -> jax.Array:
    """The block values of a packed residual in its stored layout, in the GEMM dtype (exact)."""
    return ops.block_values(q, recipe.gemm_dtype, implementation=recipe.implementation)


def dgrad_of_values(dy, w_kn, w_decode, randomness: GemmRandomness, recipe: NVFP4Recipe):
    """The dgrad `dx (M, K) = E(dy) @ E(W_q)^T` in f32, both along N.

    `w_kn` (K, N): the forward's W as block values, whose decode factor is `w_decode`.
    """
    a = _operand(dy, randomness.gradient, randomness.rotation, recipe)
    b = _operand(w_kn, randomness.other, randomness.rotation, recipe, w_decode)
    return gemm.matmul(a, b)


def wgrad_of_values(dy, x_mk, x_decode, randomness: GemmRandomness, recipe: NVFP4Recipe):
    """The wgrad `dW (K, N) = E(x_q^T) @ E(dy^T)^T` in f32, both along M.

    `x_mk` (M, K): the forward's x as block values, whose decode factor is `x_decode`.
    """
    a = _operand(x_mk.T, randomness.other, randomness.rotation, recipe, x_decode)
    b = _operand(dy.T, randomness.gradient, randomness.rotation, recipe)
    return gemm.matmul(a, b)


def dgrad(dy, qw: NVFP4Array, randomness: GemmRandomness, recipe: NVFP4Recipe) -> jax.Array:
    """`dgrad_of_values` of the forward's packed W, stored (N, K)."""
    return dgrad_of_values(dy, _values(qw, recipe).T, qw.global_scale, randomness, recipe)


def wgrad(dy, qx: NVFP4Array, randomness: GemmRandomness, recipe: NVFP4Recipe) -> jax.Array:
    """`wgrad_of_values` of the forward's packed x, stored (M, K)."""
    return wgrad_of_values(dy, _values(qx, recipe), qx.global_scale, randomness, recipe)
