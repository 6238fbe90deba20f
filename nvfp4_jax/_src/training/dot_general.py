"""A `jax.lax.dot_general` whose forward and backward GEMMs run in NVFP4.

Shape letters: x is the input (M tokens, K features), W the weight (K, N), dy the output
gradient (M, N). The three GEMMs follow `NVFP4Recipe` and docs/NUMERICS.md section 9: each operand
is quantized, handed to the GEMM as `value(code) * s_b` (exact in bf16), multiplied with f32
accumulation, and the product scaled by `alpha = D_a * D_b`, the operands' tensor decode
factors. This is what Blackwell's block-scaled tensor cores compute, up to summation order.

    fprop  y  = q(x; 1x16 along K) @ q(W; 16x16)
    dgrad  dx = q(dy; 1x16 along N, SR) @ q(W; 16x16)^T       (the forward's quantized W)
    wgrad  dW = q(x; RHT along M)^T @ q(dy; RHT along M, SR)   (the rotations cancel)

The forward saves only quantized residuals: W as used by dgrad and x quantized along the
tokens (with the RHT), both as packed `NVFP4Array`s; never the high-precision inputs. A GEMM
the recipe puts in high precision (`fprop`, `dgrad` or `wgrad` False) runs
`jax.lax.dot_general` on the unquantized operands with f32 accumulation (the backward ones as
its autodiff computes them); then the forward saves W itself for a high-precision dgrad, x
itself for a high-precision wgrad, and only the packed residuals the NVFP4 GEMMs still need.

Batch dimensions (B, e.g. MoE experts) run as `jax.vmap` of this custom_vjp: B independent
GEMMs, each operand of each element its own tensor (amax, padding, SR key `fold_in(key, b)`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from nvfp4_jax._src.core import checks, formats, primal_types
from nvfp4_jax._src.core.interception import opaque
from nvfp4_jax._src.core.ops import quantize_with_spec
from nvfp4_jax._src.core.primal_types import PrimalTypes
from nvfp4_jax._src.core.spec import QuantSpec
from nvfp4_jax._src.core.sr_keys import element_keys, gradient_key, ms_eden_randomness, sr_seeds
from nvfp4_jax._src.training import gemm, ms_eden
from nvfp4_jax._src.training.recipe import NVFP4Recipe, forward_flag

_F32 = jnp.float32


def pad_tokens(x):
    """Zero-pads the token axis (0) to a multiple of 16; zero rows add nothing to x^T dy."""
    pad = -x.shape[0] % formats.BLOCK_SIZE
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _operand(x, recipe: NVFP4Recipe, spec: QuantSpec, key=None) -> gemm.Operand:
    return gemm.quantize_operand(
        x,
        spec,
        key=key,
        backend=recipe.gemm_backend,
        dtype=recipe.gemm_dtype,
        implementation=recipe.implementation,
    )


def _array_operand(q, recipe: NVFP4Recipe) -> gemm.Operand:
    return gemm.array_operand(
        q,
        backend=recipe.gemm_backend,
        dtype=recipe.gemm_dtype,
        implementation=recipe.implementation,
    )


def _quantize_weight(w, recipe: NVFP4Recipe, gemm_name: str = "fprop"):
    """W (K, N) quantized along K, stored (N, K): the fprop operand, packed for reuse.

    For "dgrad" the same, except without `weight_2d`: along N (1x16), stored (K, N).
    """
    spec = recipe.spec("weight", gemm_name)
    return quantize_with_spec(w, spec, implementation=recipe.implementation)


def _quantize_activation(x, recipe: NVFP4Recipe):
    """The packed x (M, K), quantized along K as the fprop does: MS-EDEN's wgrad residual."""
    spec = recipe.spec("activation", "fprop")
    return quantize_with_spec(x, spec, implementation=recipe.implementation)


def _fprop_operands(x, w, recipe: NVFP4Recipe):
    """The fprop's operands (x along K, W packed for reuse), the packed W and x.

    The packed x only under `backward="ms_eden"` (its wgrad re-quantizes it; else None):
    then the fprop multiplies the packed tensor's block values, the same bits as the
    operand `gemm.quantize_operand` makes.
    """
    qw = _quantize_weight(w, recipe)
    if recipe.backward == "ms_eden":
        qx = _quantize_activation(x, recipe)
        return _array_operand(qx, recipe), _array_operand(qw, recipe), qw, qx
    x_operand = _operand(x, recipe, recipe.spec("activation", "fprop"))  # stored (M, K)
    return x_operand, _array_operand(qw, recipe), qw, None


# --- the GEMMs a recipe puts in high precision (`fprop`, `dgrad` or `wgrad` False) -------------

_MATMUL_DIMS = (((1,), (0,)), ((), ()))


def _high_precision(x, w, out_dtype):
    """The high-precision fprop: y = x W (M, N), f32 accumulation, in `out_dtype`."""
    y = jax.lax.dot_general(x, w, _MATMUL_DIMS, preferred_element_type=_F32)
    return y.astype(out_dtype)


def _high_precision_dgrad(dy, w, x_aval, out_dtype):
    """The high-precision dgrad: dx = dy W^T as `_high_precision`'s autodiff (needs W).

    `x_aval` is x's type (`jax.typeof`: shape, dtype, sharding, varying axes).
    """
    (dx,) = jax.linear_transpose(lambda x: _high_precision(x, w, out_dtype), x_aval)(dy)
    return dx


def _high_precision_wgrad(dy, x, w_aval, out_dtype):
    """The high-precision wgrad: dW = x^T dy as `_high_precision`'s autodiff (needs x)."""
    (dw,) = jax.linear_transpose(lambda w: _high_precision(x, w, out_dtype), w_aval)(dy)
    return dw


def _forward(x, w, recipe: NVFP4Recipe, out_dtype, high_precision=None):
    """The forward: y in `out_dtype`, and the fprop's quantized W and x (None where not made).

    `high_precision` (`recipe.forward_flag`; None: NVFP4): a bool scalar choosing at run time
    between the NVFP4 GEMM and the high-precision one. The operands are quantized either way
    (the packed W serves dgrad, as with `fprop=False`), and only the GEMM sits in the
    `jax.lax.cond`: what XLA fuses into the quantize and the cast stays as without the flag,
    so each branch gives the bits of its recipe's own program.
    """
    if not recipe.fprop:
        return _high_precision(x, w, out_dtype), None, None
    x_operand, w_operand, qw, qx = _fprop_operands(x, w, recipe)
    if high_precision is None:
        y = gemm.matmul(x_operand, w_operand)
    else:
        y = jax.lax.cond(
            high_precision,
            lambda: _high_precision(x, w, _F32),
            lambda: gemm.matmul(x_operand, w_operand),
        )
    return y.astype(out_dtype), qw, qx


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _nvfp4_matmul(x, w, key, high_precision, recipe, out_dtype):
    return _forward(x, w, recipe, out_dtype, high_precision)[0]


def _ms_eden_residuals(x, w, qw, qx, recipe: NVFP4Recipe):
    """MS-EDEN's residuals (W's, x's) for the backward GEMMs the recipe runs.

    The forward's packed W and x (quantized here when the forward ran in high precision),
    or W and x themselves for a high-precision dgrad and wgrad.
    """
    w_res = x_res = None
    if not recipe.dgrad:
        w_res = w
    else:
        w_res = _quantize_weight(w, recipe) if qw is None else qw  # stored (N, K)
    if not recipe.wgrad:
        x_res = x
    else:
        x_res = _quantize_activation(x, recipe) if qx is None else qx  # stored (M, K)
    return w_res, x_res


def _nvfp4_matmul_fwd(x, w, key, high_precision, recipe, out_dtype):
    """The forward and the residuals, each only where a backward GEMM needs it.

    For an NVFP4 dgrad the packed W it multiplies (the fprop's when 2D), for a
    high-precision one W itself; for an NVFP4 wgrad the packed x along the tokens, for a
    high-precision one x itself. Under `backward="ms_eden"` the fprop's packed W and x
    (along K), which the backward re-quantizes.
    """
    y, qw, qx = _forward(x, w, recipe, out_dtype, high_precision)
    if recipe.backward == "ms_eden":
        w_res, x_res = _ms_eden_residuals(x, w, qw, qx, recipe)
        return y, (w_res, x_res, key, PrimalTypes.of(x, w))
    w_res = x_res = None
    if not recipe.dgrad:
        w_res = w
    elif not recipe.weight_2d:
        # 1x16 blocks along K cannot serve dgrad, which contracts over N: quantize along N.
        w_res = _quantize_weight(w, recipe, "dgrad")  # stored (K, N)
    else:
        w_res = _quantize_weight(w, recipe) if qw is None else qw  # stored (N, K)
    if not recipe.wgrad:
        x_res = x
    else:
        spec = recipe.spec("activation", "wgrad")
        x_res = quantize_with_spec(pad_tokens(x), spec, implementation=recipe.implementation)
        # stored (K, M)
    return y, (w_res, x_res, key, PrimalTypes.of(x, w))


def _ms_eden_backward(recipe, out_dtype, residuals, dy):
    """The gradients (dx, dW) of `backward="ms_eden"` (training/ms_eden.py) or high precision."""
    qw, qx, key, types = residuals
    x_aval, w_aval = types.avals
    if recipe.dgrad or recipe.wgrad:
        key = gradient_key(dy, recipe.implementation) if key is None else key
        dgrad_random, wgrad_random = ms_eden_randomness(key, recipe.implementation)
    if recipe.dgrad:
        dx = ms_eden.dgrad(dy, qw, dgrad_random, recipe)
    else:
        dx = _high_precision_dgrad(dy, qw, x_aval, out_dtype)
    if recipe.wgrad:
        dw = ms_eden.wgrad(dy, qx, wgrad_random, recipe)
    else:
        dw = _high_precision_wgrad(dy, qx, w_aval, out_dtype)
    dx, dw = types.conform(dx.astype(x_aval.dtype), dw.astype(w_aval.dtype))
    return dx, dw, None, None


def _nvfp4_matmul_bwd(recipe, out_dtype, residuals, dy):
    if recipe.backward == "ms_eden":
        return _ms_eden_backward(recipe, out_dtype, residuals, dy)
    qw, qx_tokens, key, types = residuals
    x_aval, w_aval = types.avals
    sr = recipe.stochastic_rounding and (recipe.dgrad or recipe.wgrad)
    if key is None and sr:
        key = gradient_key(dy, recipe.implementation)
    dgrad_key, wgrad_key = sr_seeds(key, recipe.implementation) if sr else (None, None)
    backend = recipe.gemm_backend

    # dgrad: dx (M, K) = dy (M, N) @ W^T, both operands quantized along N.
    if not recipe.dgrad:
        dx = _high_precision_dgrad(dy, qw, x_aval, out_dtype)
    else:
        dy_n = _operand(dy, recipe, recipe.spec("gradient", "dgrad"), dgrad_key)
        if recipe.weight_2d and backend == "scaled_matmul":
            qw = gemm.transpose_2d_blocks(qw)  # stored (K, N)
        w_n = _array_operand(qw, recipe)
        if recipe.weight_2d and backend != "scaled_matmul":
            # The tile values are the same either way round: contract the (N, K) values over N.
            w_n = gemm.Operand(w_n.data.T, w_n.decode)
        dx = gemm.matmul(dy_n, w_n)

    # wgrad: dW (K, N) = x^T dy, both operands quantized along the tokens M (with the RHT).
    if not recipe.wgrad:
        dw = _high_precision_wgrad(dy, qx_tokens, w_aval, out_dtype)
    else:
        # stored (N, M): one transpose for both the amax and the quantize
        dy_m = _operand(pad_tokens(dy).T, recipe, recipe.spec("gradient", "wgrad"), wgrad_key)
        x_m = _array_operand(qx_tokens, recipe)  # stored (K, M)
        dw = gemm.matmul(x_m, dy_m)
    # Each gradient with its primal's type: dW of a weight replicated over shard_map's axes
    # is the sum of the shards' wgrads, as for `jax.lax.dot_general`.
    dx, dw = types.conform(dx.astype(x_aval.dtype), dw.astype(w_aval.dtype))
    return dx, dw, None, None


# The backward is traced when JAX differentiates, maybe inside another library's interceptor.
_nvfp4_matmul.defvjp(_nvfp4_matmul_fwd, opaque(_nvfp4_matmul_bwd))
# Called as one program: eagerly, the forward and the backward each compile once instead of
# operation by operation (under `jit` it inlines, as any nested `jit` does).
_matmul = jax.jit(_nvfp4_matmul, static_argnums=(4, 5))


def _dims(dims, operand, name: str, kind: str) -> tuple[int, ...]:
    """The contracting or batch dims of one side, checked as `jax.lax.dot_general` checks them."""
    dims = tuple(dims)
    if any(
        isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < operand.ndim
        for d in dims
    ):
        raise TypeError(
            f"dot_general: {name} {kind} dimensions must be non-negative ints below the "
            f"rank of {name} {operand.shape}, got {dims}"
        )
    if len(set(dims)) != len(dims):
        raise TypeError(f"dot_general: {name} {kind} dimensions must be distinct, got {dims}")
    return tuple(int(d) for d in dims)


def _contracting(dims, operand, name: str) -> tuple[int, ...]:
    """The contracting dims of one side, checked as `jax.lax.dot_general` checks them."""
    return _dims(dims, operand, name, "contracting")


def _normalize_dims(dimension_numbers, lhs, rhs):
    """Checks the dimension numbers; returns (lhs, rhs contracting, lhs, rhs batch) dims."""
    try:
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        lhs_contract, rhs_contract = tuple(lhs_contract), tuple(rhs_contract)
        lhs_batch, rhs_batch = tuple(lhs_batch), tuple(rhs_batch)
    except (TypeError, ValueError):
        raise TypeError(
            "dot_general: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None
    lhs_contract = _contracting(lhs_contract, lhs, "lhs")
    rhs_contract = _contracting(rhs_contract, rhs, "rhs")
    lhs_batch = _dims(lhs_batch, lhs, "lhs", "batch")
    rhs_batch = _dims(rhs_batch, rhs, "rhs", "batch")
    for name, batch, contract, operand in (
        ("lhs", lhs_batch, lhs_contract, lhs),
        ("rhs", rhs_batch, rhs_contract, rhs),
    ):
        if set(batch) & set(contract):
            raise TypeError(
                f"dot_general: {name} batch dimensions {batch} and contracting dimensions "
                f"{contract} of {name} {operand.shape} must be disjoint"
            )
    batch_sizes = ([lhs.shape[d] for d in lhs_batch], [rhs.shape[d] for d in rhs_batch])
    if batch_sizes[0] != batch_sizes[1]:
        raise TypeError(
            f"dot_general: batch dimensions {lhs_batch} of lhs {lhs.shape} and {rhs_batch} of "
            f"rhs {rhs.shape} must be as many and of equal sizes"
        )
    sizes = ([lhs.shape[d] for d in lhs_contract], [rhs.shape[d] for d in rhs_contract])
    if not lhs_contract or sizes[0] != sizes[1]:
        raise TypeError(
            f"dot_general: contracting dimensions {lhs_contract} of lhs {lhs.shape} and "
            f"{rhs_contract} of rhs {rhs.shape} must be non-empty and of equal sizes"
        )
    # K is flattened in lhs's dimension order, whatever order the pairs are listed in
    # (`jnp.einsum` lists "btnh,nhd->btd" as ((3, 2), (1, 0))), so that every entry point
    # (einsum, the drop-in, NVFP4Einsum, the layers) quantizes the same 16-blocks of K.
    pairs = sorted(zip(lhs_contract, rhs_contract, strict=True))
    lhs_contract = tuple(d for d, _ in pairs)
    rhs_contract = tuple(d for _, d in pairs)
    return lhs_contract, rhs_contract, lhs_batch, rhs_batch


def _check_operands(lhs, rhs, k, n):
    for name, size in (("contracting (K)", k), ("rhs free (N)", n)):
        if size % formats.BLOCK_SIZE:
            raise ValueError(
                f"dot_general: the {name} size must be a multiple of {formats.BLOCK_SIZE} for "
                f"NVFP4 blocks, got {size} for lhs {lhs.shape} and rhs {rhs.shape}"
            )


@opaque
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

    `lhs` is the activation and `rhs` the weight. Any contraction is supported (Flax `Dense`,
    `DenseGeneral`, `nnx.Linear`, `nnx.Einsum`-style weights): the contracting axes of both
    sides are flattened to K (in lhs's dimension order, whatever order `dimension_numbers`
    lists them in, so `jnp.einsum` and `NVFP4Einsum` quantize the same blocks), the free
    axes of lhs to M (tokens) and of rhs to N. K and N must be multiples of 16; M is padded
    for the wgrad GEMM.

    Batch dimensions (any number, at any positions, as in `jax.lax.dot_general`; e.g. the
    experts of a dropping MoE, `(E, C, K) x (E, K, N)` with `(((2,), (1,)), ((0,), (0,)))`)
    are flattened into one batch axis of size B, in row-major order of the lhs batch dims,
    and every batch element is its own GEMM: its own tensor amax for every operand of the
    fprop, dgrad and wgrad GEMMs (an expert's weight is its own tensor), its own token
    padding: `jax.vmap` of the unbatched call, so each element's quantized operands are
    bit for bit those of the unbatched call on it (the f32 sums of the GEMMs may run in
    another order where XLA picks another kernel for a batched GEMM).

    Args:
      lhs: activations, bf16/f16/f32.
      rhs: weights, bf16/f16/f32.
      dimension_numbers: as in `jax.lax.dot_general`.
      precision: accepted for signature compatibility and ignored: the GEMM runs on the
        quantized operands in `recipe.gemm_dtype` with f32 accumulation.
      preferred_element_type: the result dtype (default: the promoted input dtype).
      recipe: the `NVFP4Recipe`.
      key: PRNG key for stochastic rounding of the gradients. If None, the key is derived
        from the bits of the incoming gradient, which changes from step to step. With batch
        dimensions, batch element b (the flat index over the batch dims, row-major) rounds
        with `jax.random.fold_in(key, b)`, so that no two elements share SR noise; with
        None, each element's key is derived from its own slice of the gradient.

    Returns:
      The batch dims, then `lhs`'s free dims, then `rhs`'s free dims, as
      `jax.lax.dot_general` orders them.
    """
    del precision
    lhs = checks.as_float_array(lhs, "dot_general", "lhs")
    rhs = checks.as_float_array(rhs, "dot_general", "rhs")
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = _normalize_dims(dimension_numbers, lhs, rhs)
    lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch]
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    n = math.prod(rhs.shape[d] for d in rhs_free)
    _check_operands(lhs, rhs, k, n)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(
            f"dot_general: preferred_element_type must be a float dtype, got {out_dtype}"
        )
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"dot_general: recipe must be an NVFP4Recipe, got {recipe!r}")
    backend = gemm.resolve_gemm_backend(recipe.gemm_backend, "dot_general")
    recipe = dataclasses.replace(recipe, gemm_backend=backend)
    m = math.prod(lhs.shape[d] for d in lhs_free)
    out_shape = [lhs.shape[d] for d in lhs_free] + [rhs.shape[d] for d in rhs_free]
    if not lhs_batch:
        x = jnp.transpose(lhs, lhs_free + list(lhs_contract)).reshape(m, k)
        w = jnp.transpose(rhs, list(rhs_contract) + rhs_free).reshape(k, n)
        flag = forward_flag(recipe)
        return _matmul(x, w, key, flag, recipe, out_dtype).reshape(out_shape)
    batch_shape = [lhs.shape[d] for d in lhs_batch]
    b = math.prod(batch_shape)
    x = jnp.transpose(lhs, [*lhs_batch, *lhs_free, *lhs_contract]).reshape(b, m, k)
    w = jnp.transpose(rhs, [*rhs_batch, *rhs_contract, *rhs_free]).reshape(b, k, n)
    y = batched_matmul(x, w, key, recipe, out_dtype)
    return y.reshape(batch_shape + out_shape)


@opaque
def batched_matmul(x, w, key, recipe: NVFP4Recipe, out_dtype) -> jax.Array:
    """`x (B, M, K) @ w (B, K, N)`: B independent NVFP4 matmuls (differentiable), `(B, M, N)`.

    `jax.vmap` of the unbatched custom_vjp: every element has its own tensor amaxes, token
    padding and SR key (`fold_in(key, b)` for element b, or derived from its own dy when
    `key` is None). `recipe.gemm_backend` must be resolved ("emulated" or "scaled_matmul").
    """
    return _batched_matmul(x, w, key, forward_flag(recipe), recipe, out_dtype)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _batched_matmul(x, w, key, flag, recipe: NVFP4Recipe, out_dtype) -> jax.Array:
    keys = None if key is None else element_keys(key, x.shape[0])

    def one(x_b, w_b, key_b):
        return _nvfp4_matmul(x_b, w_b, key_b, flag, recipe, out_dtype)

    def run(x, w, keys):
        return jax.vmap(one, in_axes=(0, 0, None if keys is None else 0))(x, w, keys)

    sharding = primal_types.explicit_spec(jax.typeof(x))
    batch = None if sharding is None else primal_types.spec_entries(x)[0]
    if batch is None:
        return run(x, w, keys)
    # B sharded over Explicit mesh axes (e.g. expert parallelism): each device runs its own
    # elements, w and the keys sharded along B as x is; the other axes keep their types.
    w = primal_types.leading_axis_like(w, x)
    operands = (x, w) if keys is None else (x, w, primal_types.leading_axis_like(keys, x))
    mapped = jax.shard_map(
        lambda x, w, *keys: run(x, w, keys[0] if keys else None),
        mesh=sharding.mesh,
        in_specs=(P(batch),) * len(operands),
        out_specs=P(batch),
        axis_names=set(primal_types.axis_names(batch)),
    )
    return mapped(*operands)


def nvfp4_dot_general(recipe: NVFP4Recipe = NVFP4Recipe(), key: jax.Array | None = None):
    """Returns a drop-in for `jax.lax.dot_general` that computes in NVFP4.

    Pass it as `flax.nnx.Linear(..., dot_general=nvfp4_dot_general())` or
    `flax.linen.Dense(..., dot_general=nvfp4_dot_general())`. Stochastic rounding draws its
    bits from `key` if given (then the same every call: give a fresh key per step), else from
    a key derived from the gradient's bits, which differ from step to step. The NVFP4 layers
    (`nvfp4_jax.nnx.Linear`, `nvfp4_jax.linen.Dense`) draw a fresh key from a Flax rng stream.

    Batch dimensions pass through (see `dot_general`): for experts as a leading axis,
    `nnx.Einsum("eck,ekn->ecn", (E, K, N), einsum_op=functools.partial(jnp.einsum,
    _dot_general=nvfp4_dot_general()), ...)` (`nnx.Einsum` takes an `einsum_op`, and
    `jnp.einsum` hands its batch dims to `_dot_general`; check that the einsum keeps the
    activation as lhs: `jnp.einsum` may swap the operands).

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

    nvfp4_dot.nvfp4_recipe = recipe  # what it computes with (read by `rules`)
    return nvfp4_dot


def constrain_output(y: jax.Array, out_sharding) -> jax.Array:
    """Applies the `out_sharding` Flax layers pass to `dot_general`, if any."""
    if out_sharding is None:
        return y
    return jax.lax.with_sharding_constraint(y, out_sharding)
