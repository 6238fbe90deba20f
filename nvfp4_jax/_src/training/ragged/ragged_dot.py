"""`jax.lax.ragged_dot` with NVFP4 forward, data-gradient and weight-gradient GEMMs.

The grouped GEMM of a dropless mixture-of-experts layer. Shape letters: x (M, K) the tokens,
sorted by expert; W (G, K, N) the experts' weights; `group_sizes` (G,) the number of
tokens of each expert (a traced array); dy (M, N) the output gradient. Row i of group g is
multiplied by W[g]; the rows after the last group are zero in y (and get a zero dx).

Every group is a dense layer of its own (docs/NUMERICS.md section 12): group g's rows of x,
expert g's weight and group g's rows of dy are three tensors with their own tensor amax, and
the three GEMMs follow `NVFP4Recipe` (section 9) exactly as `nvfp4_jax.dot_general` does for
that group's rows alone:

    fprop  y_g  = q(x_g; 1x16 along K) @ q(W[g]; 16x16)
    dgrad  dx_g = q(dy_g; 1x16 along N, SR) @ q(W[g]; 16x16)^T
    wgrad  dW_g = q(x_g; RHT along tokens)^T @ q(dy_g; RHT along tokens, SR)

The wgrad operands are quantized in blocks of 16 tokens that never straddle two groups: the
op places each group at a 16-aligned offset of a zero buffer of static size (the *grouped
padded layout*). Stochastic rounding draws each group's bits from its own key at the
element's position in that group's own tensor, so every group's results are, bit for bit
(up to the f32 summation order of the GEMM), `dot_general` on its rows with the key
`fold_in(key, g)`.

Everything is static-shaped: the groups and their padded layout are `groups`', the
operands `operands`' (each group's activations and gradients by the native grouped
kernel or `blocks`' jnp block math, their SR bits at `sr`'s positions; the
experts' weights by the public ops under `vmap`), the GEMMs `grouped_gemm`'s:
`jax.lax.ragged_dot_general` on the block values in `recipe.gemm_dtype` with f32
accumulation, scaled per group by `alpha = D_a * D_b`: the emulated GEMM of section 9, on
every `gemm_backend` (a native grouped block-scaled GEMM is not wired yet).

A GEMM the recipe puts in high precision (`fprop`, `dgrad` or `wgrad` False) is
`jax.lax.ragged_dot` on the unquantized operands with f32 accumulation (the backward ones as
its autodiff computes them), over the same clamped groups; the forward then saves W itself
for a high-precision dgrad and x itself for a high-precision wgrad, as `dot_general` does.

Under `vmap` (a batch of token sets, each with its own group sizes) every element is its own
call, bit for bit: the grouped GEMMs broadcast what is shared (`grouped_gemm.ragged_gemm`;
JAX batches `ragged_dot_general` only with every operand batched), the grouped kernel runs
per element.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import checks, formats, primal_types, sr_keys
from nvfp4_jax._src.core.formats import decode_scale
from nvfp4_jax._src.core.interception import opaque
from nvfp4_jax._src.core.primal_types import PrimalTypes
from nvfp4_jax._src.training import gemm, ms_eden
from nvfp4_jax._src.training.ragged.blocks import block_values, pack, unpack
from nvfp4_jax._src.training.ragged.grouped_gemm import (
    group_alpha,
    high_precision,
    high_precision_dgrad,
    high_precision_wgrad,
    ragged_gemm,
)
from nvfp4_jax._src.training.ragged.groups import Groups, find_groups, take_group
from nvfp4_jax._src.training.ragged.operands import (
    quantize_rows,
    quantize_tokens,
    quantize_weights,
    weight_values,
)
from nvfp4_jax._src.training.recipe import NVFP4Recipe, forward_flag

_F32 = jnp.float32
_BLOCK = formats.BLOCK_SIZE


def _row_scale(product, alpha, groups: Groups, num_groups: int):
    """`product * alpha_g` per row, the rows in no group zero."""
    valid = (groups.row_group < num_groups)[:, None]
    return jnp.where(valid, product * take_group(alpha, groups.row_group, 0)[:, None], _F32(0))


def _forward(x, w, groups: Groups, recipe: NVFP4Recipe, out_dtype, flag=None):
    """The forward: y in `out_dtype`, and the fprop's quantized weights (None if high precision).

    `flag` (`recipe.forward_flag`; None: NVFP4): a bool scalar choosing at run time between
    the NVFP4 GEMM and the high-precision one; the operands are quantized either way and only
    the GEMM sits in the `jax.lax.cond`, as in `dot_general`.
    """
    if not recipe.fprop:
        return high_precision(x, w, groups.sizes, out_dtype), None, None
    g = w.shape[0]
    qx, amax_x = quantize_rows(x, groups, g, recipe)
    qw = quantize_weights(w, recipe, "fprop")  # stored (G, N, K)

    def nvfp4():
        w_values, d_w = weight_values(qw, recipe)
        values = block_values(qx, recipe.gemm_dtype)
        product = ragged_gemm(1, 2, 0)(values, w_values, groups.sizes)
        return _row_scale(product, group_alpha(decode_scale(amax_x), d_w), groups, g)

    if flag is None:
        y = nvfp4()
    else:
        y = jax.lax.cond(flag, lambda: high_precision(x, w, groups.sizes, _F32), nvfp4)
    return y.astype(out_dtype), qw, (qx, amax_x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _ragged_matmul(x, w, group_sizes, group_ids, key, flag, recipe, out_dtype):
    """The grouped NVFP4 GEMM, differentiable in x and w.

    `group_ids` (G,) int32: the number each group's SR key is folded with; `flag`: the
    `high_precision_forward` flag (None: none).
    """
    groups = find_groups(group_sizes, x.shape[0])
    return _forward(x, w, groups, recipe, out_dtype, flag)[0]


def _ragged_matmul_fwd(x, w, group_sizes, group_ids, key, flag, recipe, out_dtype):
    """The forward and its residuals, chosen as `dot_general` chooses them.

    W itself for a high-precision dgrad, x itself for a high-precision wgrad, else the
    packed operands the NVFP4 GEMMs need.
    """
    groups = find_groups(group_sizes, x.shape[0])
    y, qw, rows = _forward(x, w, groups, recipe, out_dtype, flag)
    qw = _dgrad_weight(w, qw, recipe)
    if recipe.backward == "ms_eden":  # the fprop's packed rows of x, each group's decode
        if not recipe.wgrad:
            x_res, d_x = x, None
        else:
            qx, amax_x = quantize_rows(x, groups, w.shape[0], recipe) if rows is None else rows
            x_res, d_x = pack(qx), decode_scale(amax_x)
        residuals = (qw, x_res, d_x, group_sizes, group_ids, key, PrimalTypes.of(x, w))
        return y, residuals
    if not recipe.wgrad:
        x_res, d_x_tokens = x, None
    else:
        qx_tokens, amax_x = quantize_tokens(x, groups, w.shape[0], recipe)  # stored (K, Mp)
        x_res, d_x_tokens = pack(qx_tokens), decode_scale(amax_x)
    residuals = (qw, x_res, d_x_tokens, group_sizes, group_ids, key, PrimalTypes.of(x, w))
    return y, residuals


def _dgrad_weight(w, qw, recipe: NVFP4Recipe):
    """The dgrad's W: W itself in high precision, else quantized (the fprop's `qw` if 2D).

    MS-EDEN re-quantizes the fprop's W whatever its blocks.
    """
    if not recipe.dgrad:
        return w
    if not recipe.weight_2d and recipe.backward != "ms_eden":
        return quantize_weights(w, recipe, "dgrad")  # 1x16 along N, stored (G, K, N)
    if qw is None:
        return quantize_weights(w, recipe, "fprop")  # stored (G, N, K), as in fprop
    return qw


def _ragged_matmul_bwd(recipe, out_dtype, residuals, dy):
    if recipe.backward == "ms_eden":
        return _ms_eden_backward(recipe, residuals, dy)
    qw, qx_tokens, d_x_tokens, group_sizes, group_ids, key, primal_types = residuals
    x_dtype, w_dtype = (aval.dtype for aval in primal_types.avals)
    g = qw.shape[0] if not recipe.dgrad else qw.global_scale.shape[0]
    groups = find_groups(group_sizes, dy.shape[0])
    dgrad_words = wgrad_words = None
    if recipe.stochastic_rounding and (recipe.dgrad or recipe.wgrad):
        dgrad_words, wgrad_words = sr_keys.group_sr_words(
            key, dy, groups.row_group, g, recipe.implementation, group_ids
        )
    dx = _dgrad(dy, qw, groups, recipe, dgrad_words, x_dtype)
    dw = _wgrad(qx_tokens, d_x_tokens, dy, groups, g, recipe, wgrad_words, w_dtype)
    # Each gradient with its primal's type: dW of experts replicated over shard_map's axes
    # is the sum of the shards' wgrads, as for `jax.lax.ragged_dot`.
    dx, dw = primal_types.conform(dx.astype(x_dtype), dw.astype(w_dtype))
    return dx, dw, None, None, None, None


def _dgrad(dy, qw, groups: Groups, recipe: NVFP4Recipe, words, x_dtype):
    """The dgrad: dx (M, K) = dy (M, N) @ W[g]^T, both operands quantized along N.

    `qw` is W itself where the recipe puts the dgrad in high precision.
    """
    if not recipe.dgrad:
        return high_precision_dgrad(dy, qw, groups.sizes, x_dtype)
    g = qw.global_scale.shape[0]
    q_dy, amax_dy = quantize_rows(dy, groups, g, recipe, words)
    w_values, d_w = weight_values(qw, recipe)  # 2D: (G, N, K) as in fprop; 1D: (G, K, N)
    w_contract = 1 if recipe.weight_2d else 2
    product = ragged_gemm(1, w_contract, 0)(
        block_values(q_dy, recipe.gemm_dtype), w_values, groups.sizes
    )
    return _row_scale(product, group_alpha(decode_scale(amax_dy), d_w), groups, g)


def _wgrad(qx_tokens, d_x_tokens, dy, groups: Groups, g, recipe: NVFP4Recipe, words, w_dtype):
    """The wgrad: dW[g] (K, N) = x_g^T dy_g, both quantized along group g's (padded) tokens.

    `qx_tokens` is x itself (M, K) where the recipe puts the wgrad in high precision.
    """
    if not recipe.wgrad:
        return high_precision_wgrad(qx_tokens, dy, groups.sizes, w_dtype)
    q_dy_tokens, amax_dy_tokens = quantize_tokens(dy, groups, g, recipe, words)
    x_values = block_values(unpack(qx_tokens), recipe.gemm_dtype).T  # (Mp, K)
    dy_values = block_values(q_dy_tokens, recipe.gemm_dtype).T  # (Mp, N)
    product = ragged_gemm(0, 0, None)(x_values, dy_values, groups.padded_sizes)  # (G, K, N)
    return product * group_alpha(d_x_tokens, decode_scale(amax_dy_tokens))[:, None, None]


# --- Quartet II's backward (`backward="ms_eden"`) ------------------------------------------------


def _ms_eden_backward(recipe: NVFP4Recipe, residuals, dy):
    """The gradients with MS-EDEN, every group its own dense layer (training/ms_eden.py).

    Group g's operands are full-size tensors whose rows outside group g are zero: its rows
    of dy, the fprop's x rows of the group (block values, decoded by its own D), and expert
    g's fprop weight. Each group's GEMMs take its MS-EDEN randomness from its SR key words
    (`keys.group_sr_words`, `keys.words_ms_eden_randomness`); the groups run under `vmap`.
    """
    qw, x_res, d_x, group_sizes, group_ids, key, primal_types = residuals
    x_dtype, w_dtype = (aval.dtype for aval in primal_types.avals)
    g = qw.shape[0] if not recipe.dgrad else qw.global_scale.shape[0]
    groups = find_groups(group_sizes, dy.shape[0])
    dgrad_random = wgrad_random = None
    if recipe.dgrad or recipe.wgrad:
        dgrad_words, wgrad_words = sr_keys.group_sr_words(
            key, dy, groups.row_group, g, recipe.implementation, group_ids
        )
        dgrad_random = sr_keys.words_ms_eden_randomness(dgrad_words, recipe.implementation)
        wgrad_random = sr_keys.words_ms_eden_randomness(wgrad_words, recipe.implementation)
    masks = groups.row_group[None, :] == jnp.arange(g, dtype=groups.row_group.dtype)[:, None]
    if recipe.dgrad:
        w_values, d_w = weight_values(qw, recipe)  # (G, N, K)

        def group_dgrad(mask, w_nk, d, random):
            dy_g = jnp.where(mask[:, None], dy, jnp.zeros_like(dy))
            return ms_eden.dgrad_of_values(dy_g, w_nk.T, d, random, recipe)

        per_group = jax.vmap(group_dgrad)(masks, w_values, d_w, dgrad_random)  # (G, M, K)
        dx = jnp.sum(jnp.where(masks[:, :, None], per_group, _F32(0)), axis=0)
    else:
        dx = high_precision_dgrad(dy, qw, groups.sizes, x_dtype)
    if recipe.wgrad:
        x_values = block_values(unpack(x_res), recipe.gemm_dtype)  # (M, K)

        def group_wgrad(mask, d, random):
            dy_g = jnp.where(mask[:, None], dy, jnp.zeros_like(dy))
            x_g = jnp.where(mask[:, None], x_values, jnp.zeros_like(x_values))
            return ms_eden.wgrad_of_values(dy_g, x_g, d, random, recipe)

        dw = jax.vmap(group_wgrad)(masks, d_x, wgrad_random)  # (G, K, N)
    else:
        dw = high_precision_wgrad(x_res, dy, groups.sizes, w_dtype)
    dx, dw = primal_types.conform(dx.astype(x_dtype), dw.astype(w_dtype))
    return dx, dw, None, None, None, None


# The backward is traced when JAX differentiates, maybe inside another library's interceptor.
_ragged_matmul.defvjp(_ragged_matmul_fwd, opaque(_ragged_matmul_bwd))
# One program per call, as `dot_general`'s matmul: eagerly it compiles once, not op by op.
_ragged = jax.jit(_ragged_matmul, static_argnums=(6, 7))


def _check(lhs, rhs, group_sizes, sharded: bool = False):
    op = "ragged_dot"
    lhs = checks.as_float_array(lhs, op, "lhs")
    rhs = checks.as_float_array(rhs, op, "rhs")
    if group_sizes is None or isinstance(group_sizes, (str, bytes)):
        raise TypeError(f"{op}: group_sizes must be an integer array, got {group_sizes!r}")
    group_sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"{op}: group_sizes must be an integer array, got dtype {group_sizes.dtype}"
        )
    if lhs.ndim != 2:
        raise ValueError(f"{op}: lhs must be 2-D (M, K), got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"{op}: rhs must be 3-D (G, K, N), got shape {rhs.shape}")
    if sharded and (group_sizes.ndim != 1 or group_sizes.shape[0] < rhs.shape[0]):
        raise ValueError(
            f"{op}: with group_offset, group_sizes must have shape (G,) with G >= G_local = "
            f"{rhs.shape[0]} for rhs {rhs.shape}, got shape {group_sizes.shape}"
        )
    if not sharded and group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"{op}: group_sizes must have shape (G,) = ({rhs.shape[0]},) for rhs {rhs.shape}, "
            f"got shape {group_sizes.shape}"
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"{op}: the contracting sizes of lhs {lhs.shape} (axis 1) and rhs {rhs.shape} "
            "(axis 1) must be equal"
        )
    for name, size in (("contracting (K)", lhs.shape[1]), ("rhs free (N)", rhs.shape[2])):
        if size % _BLOCK:
            raise ValueError(
                f"{op}: the {name} size must be a multiple of {_BLOCK} for NVFP4 blocks, "
                f"got {size} for lhs {lhs.shape} and rhs {rhs.shape}"
            )
    return lhs, rhs, group_sizes


def _check_recipe(recipe) -> NVFP4Recipe:
    """The recipe, checked, with its GEMM backend resolved as `dot_general` resolves it."""
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"ragged_dot: recipe must be an NVFP4Recipe, got {recipe!r}")
    for operand in ("activation", "gradient"):
        if getattr(recipe, f"{operand}_four_over_six") is not None:
            raise NotImplementedError(
                f"ragged_dot: recipe.{operand}_four_over_six="
                f"{getattr(recipe, f'{operand}_four_over_six')!r}: Four Over Six on the "
                "grouped GEMMs' activations and gradients (one tensor amax per group) is not "
                "implemented; weight_four_over_six is (each expert's weight is its own tensor)"
            )
    # Validated as `dot_general` validates it; the grouped GEMM is emulated on every backend.
    backend = gemm.resolve_gemm_backend(recipe.gemm_backend, "ragged_dot")
    return dataclasses.replace(recipe, gemm_backend=backend)


@opaque
def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    *,
    recipe: NVFP4Recipe = NVFP4Recipe(),
    key: jax.Array | None = None,
) -> jax.Array:
    """`jax.lax.ragged_dot` with NVFP4 forward, data-gradient and weight-gradient GEMMs.

    The grouped GEMM of a dropless mixture of experts: `lhs` (M, K) holds the tokens sorted
    by expert, `group_sizes` (G,) how many rows each expert gets (a traced array is fine:
    every shape inside is static), `rhs` (G, K, N) the experts' weights. Row i of group g
    of the result is `lhs[i] @ rhs[g]`; the rows after `sum(group_sizes)` are zero. With M,
    K, N or G zero the result and gradients are `jax.lax.ragged_dot`'s zeros (or empty).

    Every group is its own dense layer under `recipe` (docs/NUMERICS.md section 12): group
    g's rows of lhs, expert g's weight and group g's rows of the output gradient each have
    their own tensor amax (a NaN in one group's rows makes only that group's results NaN;
    an empty group gives a zero weight gradient), the weight gradient quantizes each
    group's tokens in 16-blocks of their own (zero-padded, with the RHT), and group g
    rounds stochastically with the key `jax.random.fold_in(key, g)` at the positions of its
    own tensors. Group g's results are `nvfp4_jax.dot_general` on its rows alone with that
    key (with `key=None`, each group's key is derived from its own rows of the gradient,
    as `dot_general` derives it), bit for bit up to the f32 summation order of the GEMMs.

    Which implementation runs: the experts' weights are quantized by the public ops and the
    RHT is `apply_rht`, both on `recipe.implementation`; the activations and gradients, whose
    tensor amax changes from group to group, are quantized by the reference's block math in
    jnp whatever the implementation (the native kernels take one amax per tensor). The
    three GEMMs are `jax.lax.ragged_dot_general` on the block values in `recipe.gemm_dtype`
    with f32 accumulation, times each group's `alpha` (the emulated GEMM, for every
    `gemm_backend`).

    Four Over Six: `recipe.weight_four_over_six` quantizes each expert's weight with it; the
    activations' and gradients' (`activation_four_over_six`, `gradient_four_over_six`) are
    not implemented for the grouped GEMMs and raise NotImplementedError.

    Expert parallelism (`group_offset`): a shard holding experts `o, ..., o + G_local - 1`
    of G passes its `rhs` (G_local, K, N), every group's size (G,) and `group_offset=o`.
    The rows of its experts' groups are computed as above (group o + j with `rhs[j]` and
    the key `fold_in(key, o + j)`, so the shards together give the unsharded call's bits);
    the other rows are zero in the result and get a zero dx.

    Args:
      lhs: (M, K) activations, bf16/f16/f32; K a multiple of 16.
      rhs: (G, K, N) weights, bf16/f16/f32; N a multiple of 16. With `group_offset`,
        (G_local, K, N): the experts from group `group_offset` on.
      group_sizes: (G,) integer sizes of the groups, in row order. Sizes should be
        non-negative and sum to at most M, as `jax.lax.ragged_dot` asks; since they may be
        traced they are not checked: a negative size counts as 0 and the groups stop at row M.
      precision: accepted for signature compatibility and ignored.
      preferred_element_type: the result dtype (default: the promoted input dtype).
      group_offset: None, or an integer scalar or (1,) array (traced is fine): the group
        that `rhs[0]` is. Groups past the last one (`o + j >= G`) are empty.
      recipe: the `NVFP4Recipe`.
      key: PRNG key for stochastic rounding of the gradients; None derives one per group
        from its rows of the incoming gradient.

    Returns:
      (M, N).

    Example:
      >>> x, w = jnp.ones((40, 32)), jnp.ones((3, 32, 16))
      >>> ragged_dot(x, w, jnp.array([8, 0, 24])).shape
      (40, 16)
    """
    del precision
    lhs, rhs, group_sizes = _check(lhs, rhs, group_sizes, group_offset is not None)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(
            f"ragged_dot: preferred_element_type must be a float dtype, got {out_dtype}"
        )
    recipe = _check_recipe(recipe)
    m, n = lhs.shape[0], rhs.shape[2]
    if rhs.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    # Under Explicit mesh axes the grouped GEMMs run on whole operands (the groups are rows
    # of the whole lhs): gathered here, the result sharded along M as lhs is.
    lhs, rhs, group_sizes = (primal_types.replicated(a) for a in (lhs, rhs, group_sizes))
    flag = forward_flag(recipe)
    if group_offset is None:
        group_ids = jnp.arange(rhs.shape[0], dtype=jnp.int32)
        y = _ragged(lhs, rhs, group_sizes, group_ids, key, flag, recipe, out_dtype)
        return primal_types.leading_axis_like(y, lhs)
    offset = _check_offset(group_offset)
    start, local_sizes, group_ids = _local_groups(group_sizes, offset, rhs.shape[0], m)
    # The shard's groups as a call of their own: its rows rolled to the top (the rows after
    # them, in no local group, are zero in y and dx), the result rolled back.
    y = _ragged(
        jnp.roll(lhs, -start, axis=0), rhs, local_sizes, group_ids, key, flag, recipe, out_dtype
    )
    return primal_types.leading_axis_like(jnp.roll(y, start, axis=0), lhs)


def _check_offset(group_offset) -> jax.Array:
    """The group offset as an int32 scalar; TypeError/ValueError naming what is wrong."""
    if isinstance(group_offset, (str, bytes, float)):
        raise TypeError(f"ragged_dot: group_offset must be an integer array, got {group_offset!r}")
    offset = jnp.asarray(group_offset)
    if not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(
            f"ragged_dot: group_offset must be an integer array, got dtype {offset.dtype}"
        )
    if offset.shape not in ((), (1,)):
        raise ValueError(
            "ragged_dot: group_offset must be a scalar or have shape (1,), got shape "
            f"{offset.shape}"
        )
    return offset.reshape(()).astype(jnp.int32)


def _local_groups(group_sizes, offset, num_local: int, m: int):
    """A shard's groups: its first row, its groups' sizes (G_local,) and global numbers.

    The sizes are clamped as `find_groups` clamps them over all G groups (negative as 0,
    none past row M), so every local group has the rows it has in the unsharded call.
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # (G + 1,)
    clamped = ends - starts[:-1]
    g = group_sizes.shape[0]
    ids = offset + jnp.arange(num_local, dtype=jnp.int32)
    local = jnp.where(ids < g, clamped[jnp.clip(ids, 0, g - 1)], 0)
    local = jnp.where(ids >= 0, local, 0)
    start = starts[jnp.clip(offset, 0, g)]
    return start, local, ids


__all__ = ["ragged_dot"]
