"""The operands of `ragged_dot`'s GEMMs: every group, and every expert, its own tensor.

The activations and gradients (whose tensor amax differs from group to group) are quantized
on the CPU with the ffi implementation by the native grouped kernel
(`kernels.grouped_quantize`: each group through the ordinary quantize kernel as a tensor of
its own), elsewhere by `blocks`' jnp block math with a per-row or per-block amax; the
two give the same bits. The experts' weights are quantized with the public ops under `vmap`
and the RHT is `apply_rht`, both on `recipe.implementation`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import backends, formats
from nvfp4_jax._src.core import ops as nvfp4_ops
from nvfp4_jax._src.core.kernels._grouped import grouped_quantize as native_grouped_quantize
from nvfp4_jax._src.training.ragged.blocks import Blocks, quantize_blocks, unpack
from nvfp4_jax._src.training.ragged.groups import Groups, segment_amax, take_group, to_padded
from nvfp4_jax._src.training.ragged.sr import padded_random, row_random
from nvfp4_jax._src.training.recipe import NVFP4Recipe

_F32 = jnp.float32
_U32 = jnp.uint32
_I32 = jnp.int32
_BLOCK = formats.BLOCK_SIZE


def _native_grouped(recipe: NVFP4Recipe) -> bool:
    """Whether the groups are quantized by the native kernel (`nvfp4_grouped_quantize`).

    The backend registry's answer (the ffi implementation on the CPU); it gives the jnp
    block math's bits (tests/training/test_ragged_operands.py).
    """
    return backends.runs_natively("grouped_quantize", recipe.implementation)


def _bounds(sizes: jax.Array) -> jax.Array:
    """(G, 2) int32: each group's (start, size) for sizes laid end to end."""
    ends = jnp.cumsum(sizes)
    return jnp.stack([ends - sizes, sizes], axis=1).astype(_I32)


def _native_blocks(stored, bounds, amax, words, columns: bool) -> Blocks:
    group_words = jnp.zeros((amax.shape[0], 2), _U32) if words is None else words
    codes, scales = native_grouped_quantize(
        stored, bounds, amax, group_words, columns=columns, stochastic_rounding=words is not None
    )
    return unpack(Blocks(codes, scales))


def quantize_rows(a, groups: Groups, num_groups: int, recipe: NVFP4Recipe, words=None):
    """Rows of `a` (M, C), quantized along C, each with its group's amax: (blocks, amax (G,)).

    `words`: each group's SR key words (G, 2) (`keys.group_sr_words`), or None for nearest.
    """
    valid = groups.row_group < num_groups
    xs = jnp.where(valid[:, None], a.astype(_F32), _F32(0))
    amax = segment_amax(xs, groups.row_group, num_groups, axis=0)
    if _native_grouped(recipe):
        return _native_blocks(a, _bounds(groups.sizes), amax, words, columns=False), amax
    random = None if words is None else row_random(words, groups, a.shape[1])
    row_amax = take_group(amax, groups.row_group, 0)[:, None]
    return quantize_blocks(xs, row_amax, random), amax


def quantize_tokens(a, groups: Groups, num_groups: int, recipe: NVFP4Recipe, words=None):
    """`a` (M, C) in the padded layout, stored (C, Mp), quantized along the tokens.

    With the RHT if the recipe says so; each block with its group's amax; `words` as for
    `quantize_rows`. Returns (blocks, amax (G,)).
    """
    stored = to_padded(a, groups).T  # zero rows in a's dtype, like `pad_tokens`
    if recipe.wgrad_rht:
        stored = nvfp4_ops.apply_rht(stored, implementation=recipe.implementation)
    xs = stored.astype(_F32)
    amax = segment_amax(xs, groups.pad_group, num_groups, axis=1)
    if _native_grouped(recipe):
        bounds = _bounds(groups.padded_sizes)
        return _native_blocks(stored, bounds, amax, words, columns=True), amax
    random = None if words is None else padded_random(words, groups, a.shape[1])
    block_amax = take_group(amax, groups.pad_group[::_BLOCK], 0)[None, :]
    return quantize_blocks(xs, block_amax, random), amax


def quantize_weights(w, recipe: NVFP4Recipe, gemm_name: str):
    """Every expert of W (G, K, N) its own tensor, as `dot_general` quantizes a weight.

    `gemm_name` "fprop": along K, stored (G, N, K); "dgrad": the same with `weight_2d`,
    else along N, stored (G, K, N) (`NVFP4Recipe.spec`).
    """
    spec = recipe.spec("weight", gemm_name)
    implementation = recipe.implementation
    return jax.vmap(
        lambda w_g: nvfp4_ops.quantize_with_spec(w_g, spec, implementation=implementation)
    )(w)


def weight_values(qw, recipe: NVFP4Recipe):
    values = jax.vmap(
        lambda q: nvfp4_ops.block_values(q, recipe.gemm_dtype, implementation=recipe.implementation)
    )(qw)
    return values, qw.global_scale
