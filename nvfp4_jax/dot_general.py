"""A `jax.lax.dot_general` whose forward and backward GEMMs run in NVFP4.

Shape letters: x is the input (M tokens, K features), W the weight (K, N), dy the output
gradient (M, N). The three GEMMs follow `NVFP4Recipe` and NUMERICS section 9: each operand
is quantized, handed to the GEMM as `value(code) * s_b` (exact in bf16), multiplied with f32
accumulation, and the product scaled by `alpha = D_a * D_b`, the operands' tensor decode
factors. This is what Blackwell's block-scaled tensor cores compute, up to summation order.

    fprop  y  = q(x; 1x16 along K) @ q(W; 16x16)
    dgrad  dx = q(dy; 1x16 along N, SR) @ q(W; 16x16)^T       (the forward's quantized W)
    wgrad  dW = q(x; RHT along M)^T @ q(dy; RHT along M, SR)   (the rotations cancel)

The forward saves only quantized residuals: W as used by dgrad and x quantized along the
tokens (with the RHT), both as packed `NVFP4Array`s; never the high-precision inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from nvfp4_jax import formats, interop
from nvfp4_jax.array import NVFP4Array
from nvfp4_jax.quantize import (
    block_values,
    fake_quantize,
    global_decode_scale,
    quantize,
    tensor_amax,
)
from nvfp4_jax.recipe import NVFP4Recipe

_F32 = jnp.float32
_CONTRACT_LAST = (((1,), (1,)), ((), ()))
# Seed of the key derived from dy's bits when the caller gives none (see `_gradient_key`).
_GRADIENT_KEY_SEED = 0x4E564650


def _gemm_operand(x, recipe, *, axis, rht=False, sr=False, key=None):
    """Quantizes x along `axis`; returns its GEMM values (logical layout) and decode factor."""
    amax = tensor_amax(x, axis=axis, rht=rht, implementation=recipe.implementation)
    values = fake_quantize(
        x,
        axis=axis,
        rht=rht,
        stochastic_rounding=sr,
        key=key,
        amax=amax,
        global_scale=False,
        dtype=recipe.gemm_dtype,
        implementation=recipe.implementation,
    )
    return values, global_decode_scale(amax)


def _scaled_gemm(a, b, dimension_numbers, alpha):
    """`alpha * dot_general(a, b)` with f32 accumulation."""
    product = jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=_F32)
    return product * alpha


def _pad_tokens(x):
    """Zero-pads the token axis (0) to a multiple of 16; zero rows add nothing to x^T dy."""
    pad = -x.shape[0] % formats.BLOCK_SIZE
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _mix32(h):
    """murmur3's 32-bit finalizer: a bijection of uint32 that scrambles every bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _gradient_key(dy):
    """A key that changes whenever dy does: a wrapping sum of dy's mixed bits, into a seed.

    Used for stochastic rounding when the caller passes no key, so that a drop-in
    `dot_general` draws fresh randomness every step. Integer addition is associative, so the
    key is the same on every platform, implementation and sharding. Each element's bits are
    mixed before the sum: a plain sum of bits is blind to scaling dy by 2 (every element
    gains 2**23, and n * 2**23 wraps to 0 for n a multiple of 512), which would repeat the
    rounding of the unscaled gradient.
    """
    bits = jax.lax.bitcast_convert_type(dy.astype(_F32), jnp.uint32)
    digest = jnp.sum(_mix32(bits), dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.key(_GRADIENT_KEY_SEED), digest)


def _fprop(x, w, recipe):
    qw = quantize(w, axis=0, block_2d=recipe.weight_2d, implementation=recipe.implementation)
    if recipe.gemm_backend == "scaled_matmul":
        qx = quantize(x, axis=-1, implementation=recipe.implementation)  # stored (M, K)
        return interop.scaled_matmul(qx, qw, backend="scaled_matmul"), qw
    x_values, x_decode = _gemm_operand(x, recipe, axis=-1)
    w_values = block_values(qw, recipe.gemm_dtype)  # (N, K)
    alpha = x_decode * global_decode_scale(qw.amax)
    return _scaled_gemm(x_values, w_values, _CONTRACT_LAST, alpha), qw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _nvfp4_matmul(x, w, key, recipe, out_dtype):
    return _fprop(x, w, recipe)[0].astype(out_dtype)


def _nvfp4_matmul_fwd(x, w, key, recipe, out_dtype):
    y, qw = _fprop(x, w, recipe)
    if not recipe.weight_2d:
        # 1x16 blocks along K cannot serve dgrad, which contracts over N: quantize along N.
        qw = quantize(w, axis=1, implementation=recipe.implementation)  # stored (K, N)
    qx_tokens = quantize(
        _pad_tokens(x), axis=0, rht=recipe.wgrad_rht, implementation=recipe.implementation
    )  # stored (K, M)
    return y.astype(out_dtype), (qw, qx_tokens, key)


def _nvfp4_matmul_bwd(recipe, out_dtype, residuals, dy):
    del out_dtype
    qw, qx_tokens, key = residuals
    sr = recipe.stochastic_rounding
    if key is None and sr:
        key = _gradient_key(dy)
    dgrad_key, wgrad_key = jax.random.split(key) if sr else (None, None)
    if recipe.gemm_backend == "scaled_matmul":
        dx, dw = _backward_scaled_matmul(recipe, qw, qx_tokens, dy, dgrad_key, wgrad_key)
        return dx.astype(qx_tokens.dtype), dw.astype(qw.dtype), None

    dy_values, dy_decode = _gemm_operand(dy, recipe, axis=-1, sr=sr, key=dgrad_key)
    w_values = block_values(qw, recipe.gemm_dtype)  # (N, K) if 2D, else (K, N)
    w_dims = (((1,), (0,)), ((), ())) if recipe.weight_2d else _CONTRACT_LAST
    alpha = dy_decode * global_decode_scale(qw.amax)
    dx = _scaled_gemm(dy_values, w_values, w_dims, alpha)

    dy_tokens, dy_tokens_decode = _gemm_operand(
        _pad_tokens(dy), recipe, axis=0, rht=recipe.wgrad_rht, sr=sr, key=wgrad_key
    )  # (M, N), rotated along M
    x_values = block_values(qx_tokens, recipe.gemm_dtype)  # (K, M), rotated along M
    alpha = global_decode_scale(qx_tokens.amax) * dy_tokens_decode
    dw = _scaled_gemm(x_values, dy_tokens, (((1,), (0,)), ((), ())), alpha)
    return dx.astype(qx_tokens.dtype), dw.astype(qw.dtype), None


_nvfp4_matmul.defvjp(_nvfp4_matmul_fwd, _nvfp4_matmul_bwd)


def _backward_scaled_matmul(recipe, qw, qx_tokens, dy, dgrad_key, wgrad_key):
    """The dgrad and wgrad GEMMs on `jax.nn.scaled_matmul`, from the emulated path's operands."""
    sr, impl = recipe.stochastic_rounding, recipe.implementation
    qdy = quantize(dy, axis=-1, stochastic_rounding=sr, key=dgrad_key, implementation=impl)
    qw_kn = _transpose_2d_blocks(qw) if recipe.weight_2d else qw  # stored (K, N)
    dx = interop.scaled_matmul(qdy, qw_kn, backend="scaled_matmul")
    qdy_tokens = quantize(
        _pad_tokens(dy),
        axis=0,
        rht=recipe.wgrad_rht,
        stochastic_rounding=sr,
        key=wgrad_key,
        implementation=impl,
    )  # stored (N, M)
    dw = interop.scaled_matmul(qx_tokens, qdy_tokens, backend="scaled_matmul")
    return dx, dw


def _transpose_2d_blocks(q: NVFP4Array) -> NVFP4Array:
    """The 16x16-block quantized (N, K) stored as (K, N): the same codes and tile scales."""
    codes = formats.pack_nibbles(formats.unpack_nibbles(q.codes).T)
    tiles = q.scales[:: formats.BLOCK_SIZE].T  # (K/16, N/16): one scale per tile
    scales = jnp.repeat(tiles, formats.BLOCK_SIZE, axis=0)
    return dataclasses.replace(q, codes=codes, scales=scales, axis=-1)


def _normalize_dims(dimension_numbers, lhs, rhs):
    """Checks the dimension numbers; returns (lhs contracting, rhs contracting), non-negative."""
    try:
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(
            "dot_general: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None
    if tuple(lhs_batch) or tuple(rhs_batch):
        raise ValueError(
            "dot_general: batch dimensions are not supported by the NVFP4 dot_general (it "
            f"quantizes one weight matrix), got lhs_batch={lhs_batch}, rhs_batch={rhs_batch} "
            f"for lhs {lhs.shape} and rhs {rhs.shape}"
        )
    lhs_contract = tuple(d % lhs.ndim for d in lhs_contract)
    rhs_contract = tuple(d % rhs.ndim for d in rhs_contract)
    sizes = ([lhs.shape[d] for d in lhs_contract], [rhs.shape[d] for d in rhs_contract])
    if not lhs_contract or sizes[0] != sizes[1]:
        raise ValueError(
            f"dot_general: contracting dimensions {lhs_contract} of lhs {lhs.shape} and "
            f"{rhs_contract} of rhs {rhs.shape} must be non-empty and of equal sizes"
        )
    return lhs_contract, rhs_contract


def _check_operands(lhs, rhs, k, n):
    for name, size in (("contracting (K)", k), ("rhs free (N)", n)):
        if size % formats.BLOCK_SIZE:
            raise ValueError(
                f"dot_general: the {name} size must be a multiple of {formats.BLOCK_SIZE} for "
                f"NVFP4 blocks, got {size} for lhs {lhs.shape} and rhs {rhs.shape}"
            )


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: NVFP4Recipe = NVFP4Recipe(),
    key: jax.Array | None = None,
) -> jax.Array:
    """`jax.lax.dot_general` with NVFP4 forward, data-gradient and weight-gradient GEMMs.

    `lhs` is the activation and `rhs` the weight. Any contraction without batch dimensions
    is supported (Flax `Dense`, `DenseGeneral`, `nnx.Linear`, `nnx.Einsum`-style weights):
    the contracting axes of both sides are flattened to K, the free axes of lhs to M (tokens)
    and of rhs to N. K and N must be multiples of 16; M is padded for the wgrad GEMM.

    Args:
      lhs: activations, bf16/f16/f32.
      rhs: weights, bf16/f16/f32.
      dimension_numbers: as in `jax.lax.dot_general`; batch dimensions must be empty.
      precision: accepted for signature compatibility and ignored: the GEMM runs on the
        quantized operands in `recipe.gemm_dtype` with f32 accumulation.
      preferred_element_type: the result dtype (default: the promoted input dtype).
      recipe: the `NVFP4Recipe`.
      key: PRNG key for stochastic rounding of the gradients. If None, the key is derived
        from the bits of the incoming gradient, which changes from step to step.

    Returns:
      `lhs`'s free dims followed by `rhs`'s free dims, as `jax.lax.dot_general` orders them.
    """
    del precision
    lhs = formats.as_float_array(lhs, "dot_general", "lhs")
    rhs = formats.as_float_array(rhs, "dot_general", "rhs")
    lhs_contract, rhs_contract = _normalize_dims(dimension_numbers, lhs, rhs)
    lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract]
    rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract]
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    n = math.prod(rhs.shape[d] for d in rhs_free)
    _check_operands(lhs, rhs, k, n)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    backend = interop.resolve_gemm_backend(recipe.gemm_backend, "dot_general")
    recipe = dataclasses.replace(recipe, gemm_backend=backend)
    x = jnp.transpose(lhs, lhs_free + list(lhs_contract)).reshape(-1, k)
    w = jnp.transpose(rhs, list(rhs_contract) + rhs_free).reshape(k, n)
    y = _nvfp4_matmul(x, w, key, recipe, out_dtype)
    out_shape = [lhs.shape[d] for d in lhs_free] + [rhs.shape[d] for d in rhs_free]
    return y.reshape(out_shape)


def nvfp4_dot_general(recipe: NVFP4Recipe = NVFP4Recipe(), key: jax.Array | None = None):
    """Returns a drop-in for `jax.lax.dot_general` that computes in NVFP4.

    Pass it as `flax.nnx.Linear(..., dot_general=nvfp4_dot_general())` or
    `flax.linen.Dense(..., dot_general=nvfp4_dot_general())`. Stochastic rounding draws its
    bits from `key` if given (then the same every call: give a fresh key per step), else from
    a key derived from the gradient's bits, which differ from step to step. The NVFP4 layers
    (`nvfp4_jax.nnx.Linear`, `nvfp4_jax.linen.Dense`) draw a fresh key from a Flax rng stream.

    Example:
      >>> import flax.nnx as nnx
      >>> layer = nnx.Linear(32, 16, dot_general=nvfp4_dot_general(), rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((4, 32))).shape
      (4, 16)
    """

    def nvfp4_dot(
        lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
    ):
        y = dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            recipe=recipe,
            key=key,
        )
        return constrain_output(y, out_sharding)

    return nvfp4_dot


def constrain_output(y: jax.Array, out_sharding) -> jax.Array:
    """Applies the `out_sharding` Flax layers pass to `dot_general`, if any."""
    if out_sharding is None:
        return y
    return jax.lax.with_sharding_constraint(y, out_sharding)
