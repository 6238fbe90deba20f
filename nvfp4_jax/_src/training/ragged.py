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

Everything is static-shaped: groups are found with segment ids, per-group amaxes with
segment reductions. The activations and gradients (whose tensor amax differs from group to
group) are quantized on the CPU with the ffi implementation by the native grouped kernel
(`nvfp4_jax.kernels.grouped_quantize`: each group through the ordinary quantize kernel as a
tensor of its own), elsewhere by the reference's block math (`nvfp4_jax.reference`) with a
per-row or per-block encode scale, in jnp; the two give the same bits. The experts' weights
are quantized with the public ops under `vmap` and the RHT is `nvfp4_jax.apply_rht`, both on
`recipe.implementation` (the native kernels where they run). The GEMMs are
`jax.lax.ragged_dot_general` on the block values in `recipe.gemm_dtype` with f32
accumulation, scaled per group by `alpha = D_a * D_b`: the emulated GEMM of section 9, on
every `gemm_backend` (a native grouped block-scaled GEMM is not wired yet).

A GEMM the recipe puts in high precision (`fprop`, `dgrad` or `wgrad` False) is
`jax.lax.ragged_dot` on the unquantized operands with f32 accumulation (the backward ones as
its autodiff computes them), over the same clamped groups; the forward then saves W itself
for a high-precision dgrad and x itself for a high-precision wgrad, as `dot_general` does.

Under `vmap` (a batch of token sets, each with its own group sizes) every element is its own
call, bit for bit: the grouped GEMMs broadcast what is shared (`_ragged_gemm`; JAX batches
`ragged_dot_general` only with every operand batched), the grouped kernel runs per element.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax._src.core import backends, checks, formats, kernels, keys, types
from nvfp4_jax._src.core import ops as nvfp4_ops
from nvfp4_jax._src.core.reference import decode_scale, encode_scale, stochastic_magnitude
from nvfp4_jax._src.core.types import PrimalTypes
from nvfp4_jax._src.training import gemm
from nvfp4_jax._src.training.recipe import NVFP4Recipe

_F32 = jnp.float32
_U32 = jnp.uint32
_I32 = jnp.int32
_BLOCK = formats.BLOCK_SIZE


# --- the groups ------------------------------------------------------------------------------


class _Groups(NamedTuple):
    """Where every row and every padded position belongs (all int32, static shapes).

    `row_group[i]` is the group of row i, G for the rows after the last group; `row_local[i]`
    its index inside its group. `pad_group[p]` and `pad_local[p]` are the same for position
    p of the grouped padded layout (G for the unused positions), `pad_row[p]` the row it holds
    (M for a zero), `padded_sizes[g]` the 16-aligned size of group g there.
    """

    sizes: jax.Array
    row_group: jax.Array
    row_local: jax.Array
    padded_sizes: jax.Array
    pad_group: jax.Array
    pad_local: jax.Array
    pad_row: jax.Array


def padded_rows(m: int, groups: int) -> int:
    """The static size of the grouped padded layout: `M + 15 G` rounded up to 16.

    The groups' 16-aligned sizes sum to at most `M + 15 G` (each pads by 15 at most).
    """
    return -(-(m + (_BLOCK - 1) * groups) // _BLOCK) * _BLOCK


def _groups(group_sizes: jax.Array, m: int) -> _Groups:
    g = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(_I32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)  # a sum above M: the groups stop at row M
    starts = jnp.concatenate([jnp.zeros((1,), _I32), ends[:-1]])
    sizes = ends - starts
    rows = jnp.arange(m, dtype=_I32)
    row_group = jnp.searchsorted(ends, rows, side="right").astype(_I32)
    row_start = jnp.concatenate([starts, ends[-1:]])[row_group]
    padded_sizes = (sizes + (_BLOCK - 1)) // _BLOCK * _BLOCK
    pad_ends = jnp.cumsum(padded_sizes)
    pad_starts = pad_ends - padded_sizes
    positions = jnp.arange(padded_rows(m, g), dtype=_I32)
    pad_group = jnp.searchsorted(pad_ends, positions, side="right").astype(_I32)
    pad_local = positions - jnp.concatenate([pad_starts, pad_ends[-1:]])[pad_group]
    in_group = pad_local < jnp.concatenate([sizes, jnp.zeros((1,), _I32)])[pad_group]
    source = jnp.concatenate([starts, jnp.full((1,), m, _I32)])[pad_group] + pad_local
    pad_row = jnp.where(in_group, source, m)
    return _Groups(sizes, row_group, rows - row_start, padded_sizes, pad_group, pad_local, pad_row)


def _to_padded(a: jax.Array, groups: _Groups) -> jax.Array:
    """Rows (M, C) -> the grouped padded layout (Mp, C): group g's rows at its offset, else 0."""
    padded = jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])
    return padded[groups.pad_row]


def _gather(table: jax.Array, index: jax.Array, fill) -> jax.Array:
    """`table[index]` with index G (no group) giving `fill`."""
    return jnp.concatenate([table, jnp.full((1,), fill, table.dtype)])[index]


# --- per-group tensor amax ------------------------------------------------------------------


def _group_amax(xs: jax.Array, ids: jax.Array, groups: int, axis: int) -> jax.Array:
    """The stored amax of every group of `xs` (f32): `max |x|`, 0 if empty, NaN if non-finite.

    `ids` numbers the slices of `xs` along `axis` (id `groups`: in no group). Finiteness is
    an explicit reduction, as in the reference (XLA's CPU max may drop a NaN). Slices of no
    element (K or N zero) have the max 0, as the reference's empty tensors.
    """
    other = 1 - axis
    slice_max = jnp.max(jnp.abs(xs), axis=other, initial=_F32(0))
    slice_bad = jnp.any(~jnp.isfinite(xs), axis=other)
    amax = jnp.maximum(jax.ops.segment_max(slice_max, ids, num_segments=groups), _F32(0))
    bad = jax.ops.segment_max(slice_bad.astype(_I32), ids, num_segments=groups) > 0
    return jnp.where(bad | (amax == jnp.inf), _F32(jnp.nan), amax)


def group_amax(x: jax.Array, group_sizes: jax.Array | None, num_groups: int) -> jax.Array:
    """Each group's tensor amax (G,) f32: `max |x|` over its rows, 0 if empty, NaN if not finite.

    `x` is (M, K) with rows sorted by group and `group_sizes` (G,) (rows past the groups belong
    to none), or (G, C, K) with `group_sizes` None (a dropping MoE's dispatched tokens). What an
    MoE layer records while calibrating (`Experts.input_amax`), per expert.
    """
    if group_sizes is None:
        flat = x.reshape(num_groups, -1).astype(_F32)
        ids = jnp.arange(num_groups, dtype=_I32)
        return _group_amax(flat, ids, num_groups, axis=0)
    rows = _groups(jnp.asarray(group_sizes), x.shape[0]).row_group
    return _group_amax(x.astype(_F32), rows, num_groups, axis=0)


# --- the block math with a per-row or per-block tensor amax ----------------------------------


class _Blocks(NamedTuple):
    """A quantized stored layout (R, C): unpacked codes uint8 (R, C), scales e4m3 (R, C/16)."""

    codes: jax.Array
    scales: jax.Array


def _quantize_blocks(xs, amax, random) -> _Blocks:
    """The reference's block math (docs/NUMERICS.md sections 2, 7, 8) with many tensor amaxes.

    `xs` is an f32 stored layout (R, C), quantized along C; `amax` the stored amax (NaN for
    a non-finite group) broadcast against the blocks (R, C/16): one per row or one per
    block, each its group's. `random`: the SR bytes uint8 (R, C), or None for nearest.
    """
    bad = ~(amax >= 0) | (amax == jnp.inf)  # a NaN amax: a non-finite group
    s_enc = encode_scale(amax)
    s_dec = _F32(1) / s_enc
    blocks = xs.reshape(*xs.shape[:-1], xs.shape[-1] // _BLOCK, _BLOCK)
    block_max = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = jnp.minimum(block_max * (s_enc * _F32(formats.RCP6)), _F32(formats.E4M3_MAX))
    scales = scaled.astype(jnp.float8_e4m3fn)
    encode = jnp.minimum(_F32(1) / (scales.astype(_F32) * s_dec), _F32(formats.FLT_MAX))
    y = blocks * encode[..., None]
    magnitude = jnp.abs(y)
    if random is not None:
        magnitude = stochastic_magnitude(magnitude, random.reshape(y.shape))
    codes = formats.e2m1_magnitude_code(magnitude) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    bad = jnp.broadcast_to(bad, scales.shape)
    codes = jnp.where(bad[..., None], jnp.uint8(0), codes)
    nan = jax.lax.bitcast_convert_type(
        jnp.full(scales.shape, formats.E4M3_NAN_BYTE, jnp.uint8), jnp.float8_e4m3fn
    )
    scales = jnp.where(bad, nan, scales)
    return _Blocks(codes.reshape(xs.shape), scales)


def _block_values(q: _Blocks, dtype) -> jax.Array:
    """`value(code) * f32(s_b)` (R, C) in `dtype`: an emulated GEMM operand (section 9)."""
    blocks = q.codes.reshape(*q.scales.shape, _BLOCK)
    values = formats.scaled_code_values(blocks, q.scales.astype(_F32)[..., None])
    return values.reshape(q.codes.shape).astype(dtype)


def _pack(q: _Blocks) -> _Blocks:
    return _Blocks(formats.pack_nibbles(q.codes), q.scales)


def _unpack(q: _Blocks) -> _Blocks:
    return _Blocks(formats.unpack_nibbles(q.codes), q.scales)


# --- stochastic rounding: per-group positions (the keys: `keys.group_sr_words`) -------------


def _counter(a, b, c) -> tuple[jax.Array, jax.Array]:
    """The 64-bit counters `a * b + c` of uint32 arrays (broadcast): (high, low) uint32 words.

    Section 7's counters are 64-bit (a group past 2**35 elements has a high word), as the
    kernels' are; JAX has no uint64 without x64, so the product is formed from 16-bit halves.
    """
    half, sixteen = _U32(0xFFFF), _U32(16)
    a_lo, a_hi, b_lo, b_hi = a & half, a >> sixteen, b & half, b >> sixteen
    cross_a, cross_b = a_lo * b_hi, a_hi * b_lo  # each below 2**32
    middle = ((a_lo * b_lo) >> sixteen) + (cross_a & half) + (cross_b & half)
    high = a_hi * b_hi + (cross_a >> sixteen) + (cross_b >> sixteen) + (middle >> sixteen)
    low = a * b + c  # wraps modulo 2**32: the carry goes into the high word
    return high + (low < c).astype(_U32), low


def _random_bytes(words, chunk_group, counter) -> jax.Array:
    """The 8 SR bytes of every 8-element chunk: uint8 `(*chunk_group.shape, 8)`.

    Chunk c draws `threefry2x32((k0, k1), (high[c], low[c]))` with its group's key words
    (`words` (G, 2); group G, no group, draws with zero words: its elements are zero) and its
    64-bit counter (`counter`: `_counter`'s words), and its element e takes byte e of
    `w0 | w1 << 32`, least significant first (section 7).
    """
    table = jnp.concatenate([words, jnp.zeros((1, 2), _U32)])
    k = table[chunk_group]
    hashed = keys.threefry2x32(k[..., 0], k[..., 1], *counter)
    shifts = jnp.arange(0, 32, 8, dtype=_U32)
    parts = [(word[..., None] >> shifts) & _U32(0xFF) for word in hashed]
    return jnp.concatenate(parts, axis=-1).astype(jnp.uint8)


def _row_random(words, groups: _Groups, n: int) -> jax.Array:
    """SR bytes (M, N) of a row-grouped (M, N) tensor quantized along N (dgrad's dy).

    Element (i, c) of group g is element `row_local[i] * N + c` of dy_g.
    """
    chunks = jnp.arange(n // 8, dtype=_U32)
    counter = _counter(groups.row_local.astype(_U32)[:, None], _U32(n // 8), chunks)
    group = jnp.broadcast_to(groups.row_group[:, None], counter[1].shape)
    return _random_bytes(words, group, counter).reshape(group.shape[0], n)


def _padded_random(words, groups: _Groups, n: int) -> jax.Array:
    """SR bytes (N, Mp) of the padded layout stored (N, Mp), quantized along the tokens.

    Element (c, p) of group g is element `c * L_g + pad_local[p]` of group g's own stored
    (N, L_g) tensor, `L_g` its padded size.
    """
    first = groups.pad_group[::8]  # the group of every 8-token chunk
    local = groups.pad_local[::8].astype(_U32) // _U32(8)
    rows = _gather(groups.padded_sizes, first, 0).astype(_U32) // _U32(8)
    counter = _counter(jnp.arange(n, dtype=_U32)[:, None], rows, local)
    group = jnp.broadcast_to(first, counter[1].shape)
    return _random_bytes(words, group, counter).reshape(n, groups.pad_group.shape[0])


# --- the operands ---------------------------------------------------------------------------


def _native_grouped(recipe: NVFP4Recipe) -> bool:
    """Whether the groups are quantized by the native kernel (`nvfp4_grouped_quantize`).

    The backend registry's answer (the ffi implementation on the CPU); it gives the jnp
    block math's bits (tests/training/test_ragged.py).
    """
    return backends.runs_natively("grouped_quantize", recipe.implementation)


def _bounds(sizes: jax.Array) -> jax.Array:
    """(G, 2) int32: each group's (start, size) for sizes laid end to end."""
    ends = jnp.cumsum(sizes)
    return jnp.stack([ends - sizes, sizes], axis=1).astype(_I32)


def _native_blocks(stored, bounds, amax, words, columns: bool) -> _Blocks:
    group_words = jnp.zeros((amax.shape[0], 2), _U32) if words is None else words
    codes, scales = kernels.grouped_quantize(
        stored, bounds, amax, group_words, columns=columns, stochastic_rounding=words is not None
    )
    return _unpack(_Blocks(codes, scales))


def _quantize_rows(a, groups: _Groups, num_groups: int, recipe: NVFP4Recipe, words=None):
    """Rows of `a` (M, C), quantized along C, each with its group's amax: (blocks, amax (G,)).

    `words`: each group's SR key words (G, 2) (`keys.group_sr_words`), or None for nearest.
    """
    valid = groups.row_group < num_groups
    xs = jnp.where(valid[:, None], a.astype(_F32), _F32(0))
    amax = _group_amax(xs, groups.row_group, num_groups, axis=0)
    if _native_grouped(recipe):
        return _native_blocks(a, _bounds(groups.sizes), amax, words, columns=False), amax
    random = None if words is None else _row_random(words, groups, a.shape[1])
    row_amax = _gather(amax, groups.row_group, 0)[:, None]
    return _quantize_blocks(xs, row_amax, random), amax


def _quantize_tokens(a, groups: _Groups, num_groups: int, recipe: NVFP4Recipe, words=None):
    """`a` (M, C) in the padded layout, stored (C, Mp), quantized along the tokens.

    With the RHT if the recipe says so; each block with its group's amax; `words` as for
    `_quantize_rows`. Returns (blocks, amax (G,)).
    """
    stored = _to_padded(a, groups).T  # zero rows in a's dtype, like `pad_tokens`
    if recipe.wgrad_rht:
        stored = nvfp4_ops.apply_rht(stored, implementation=recipe.implementation)
    xs = stored.astype(_F32)
    amax = _group_amax(xs, groups.pad_group, num_groups, axis=1)
    if _native_grouped(recipe):
        bounds = _bounds(groups.padded_sizes)
        return _native_blocks(stored, bounds, amax, words, columns=True), amax
    random = None if words is None else _padded_random(words, groups, a.shape[1])
    block_amax = _gather(amax, groups.pad_group[::_BLOCK], 0)[None, :]
    return _quantize_blocks(xs, block_amax, random), amax


def _quantize_weights(w, recipe: NVFP4Recipe, gemm_name: str):
    """Every expert of W (G, K, N) its own tensor, as `dot_general` quantizes a weight.

    `gemm_name` "fprop": along K, stored (G, N, K); "dgrad": the same with `weight_2d`,
    else along N, stored (G, K, N) (`NVFP4Recipe.spec`).
    """
    spec = recipe.spec("weight", gemm_name)
    implementation = recipe.implementation
    return jax.vmap(
        lambda w_g: nvfp4_ops.quantize_with_spec(w_g, spec, implementation=implementation)
    )(w)


def _weight_values(qw, recipe: NVFP4Recipe):
    values = jax.vmap(
        lambda q: nvfp4_ops.block_values(q, recipe.gemm_dtype, implementation=recipe.implementation)
    )(qw)
    return values, qw.global_scale


# --- the GEMMs --------------------------------------------------------------------------------


def _ragged_gemm(lhs_contract: int, rhs_contract: int, rhs_group: int | None, batch: int = 0):
    """`jax.lax.ragged_dot_general` with the rows (axis 0) of lhs ragged, f32 accumulation.

    One cached function per form and per kind of mesh the operands' types are on: under
    Explicit axes the result's sharding must be stated (JAX infers none for a ragged dot;
    `ragged_dot` gathers the operands there).
    """

    def call(lhs, rhs, group_sizes):
        mesh = types.mesh_of(lhs, rhs, group_sizes)
        explicit = mesh if mesh is not None and mesh.explicit_axes else None
        form = _cached_ragged_gemm(lhs_contract, rhs_contract, rhs_group, batch, explicit)
        return form(lhs, rhs, group_sizes)

    return call


@functools.cache
def _cached_ragged_gemm(
    lhs_contract: int, rhs_contract: int, rhs_group: int | None, batch: int, explicit
):
    """`_ragged_gemm`'s function; `explicit`: the Explicit-axis mesh of the operands, or None.

    With `rhs_group` the rows stay (each group times its slice of rhs along `rhs_group`);
    None contracts them (wgrad's form: the result (G, ...)). The dims are the unbatched
    operands'; `batch` leading dims of all three operands are batch dims, first in the result.

    Under `vmap` JAX's own rule takes only operands that are all batched; this one broadcasts
    the others (a per-sequence MoE's shared experts) and adds the batch as a leading batch dim
    of the dot, whose every element is the unbatched GEMM.
    """
    b = tuple(range(batch))
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((batch + lhs_contract,), (batch + rhs_contract,)), (b, b)),
        lhs_ragged_dimensions=[batch],
        rhs_group_dimensions=[] if rhs_group is None else [batch + rhs_group],
    )

    @custom_vmap
    def gemm(lhs, rhs, group_sizes):
        sharding = {} if explicit is None else {"out_sharding": NamedSharding(explicit, P())}
        out = jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, dims, preferred_element_type=_F32, **sharding
        )
        return jnp.moveaxis(out, 0, batch) if rhs_group is None and batch else out

    @gemm.def_vmap
    def _vmap_rule(axis_size, in_batched, *operands):
        operands = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip(operands, in_batched, strict=True)
        ]
        return _ragged_gemm(lhs_contract, rhs_contract, rhs_group, batch + 1)(*operands), True

    return gemm


def _alpha(d_a, d_b):
    """Each group's `alpha = D_a * D_b` (G,), from the two decode factors as they are.

    The barrier keeps XLA from reassociating the product with the constant inside each
    `D = A * RCP2688`, which it does where a factor is broadcast (under `vmap`): other bits.
    """
    d_a, d_b = jax.lax.optimization_barrier((d_a, d_b))
    return d_a * d_b


def _row_scale(product, alpha, groups: _Groups, num_groups: int):
    """`product * alpha_g` per row, the rows in no group zero."""
    valid = (groups.row_group < num_groups)[:, None]
    return jnp.where(valid, product * _gather(alpha, groups.row_group, 0)[:, None], _F32(0))


def _fprop(x, w, groups: _Groups, recipe: NVFP4Recipe):
    g = w.shape[0]
    qx, amax_x = _quantize_rows(x, groups, g, recipe)
    qw = _quantize_weights(w, recipe, "fprop")  # stored (G, N, K)
    w_values, d_w = _weight_values(qw, recipe)
    product = _ragged_gemm(1, 2, 0)(_block_values(qx, recipe.gemm_dtype), w_values, groups.sizes)
    return _row_scale(product, _alpha(decode_scale(amax_x), d_w), groups, g), qw


# --- the GEMMs a recipe puts in high precision (`fprop`, `dgrad` or `wgrad` False) -------------


def _high_precision(x, w, sizes, out_dtype):
    """`jax.lax.ragged_dot` on the unquantized operands, f32 accumulation, in `out_dtype`.

    `sizes` are the clamped group sizes (`_Groups.sizes`: none negative, summing to at most
    M), so the rows in no group are zero, as in the NVFP4 GEMMs.
    """
    return _ragged_gemm(1, 1, 0)(x, w, sizes).astype(out_dtype)


# The backward ones are the GEMMs JAX's transpose rule of `_high_precision` runs (the
# cotangent in f32, the result cast to the operand's dtype), written out: `vmap` of a
# transpose would bind JAX's ragged_dot_general without `_ragged_gemm`'s batching rule.


def _high_precision_dgrad(dy, w, sizes, x_dtype):
    """The high-precision dx (M, K): row i of group g is `dy[i] @ W[g]^T`, as autodiff has it."""
    return _ragged_gemm(1, 2, 0)(dy.astype(_F32), w, sizes).astype(x_dtype)


def _high_precision_wgrad(x, dy, sizes, w_dtype):
    """The high-precision dW (G, K, N): `x_g^T dy_g` of every group g, as autodiff has it."""
    return _ragged_gemm(0, 0, None)(x, dy.astype(_F32), sizes).astype(w_dtype)


def _forward(x, w, groups: _Groups, recipe: NVFP4Recipe, out_dtype):
    """The forward: y in `out_dtype`, and the fprop's quantized weights (None if high precision)."""
    if not recipe.fprop:
        return _high_precision(x, w, groups.sizes, out_dtype), None
    y, qw = _fprop(x, w, groups, recipe)
    return y.astype(out_dtype), qw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ragged_matmul(x, w, group_sizes, key, recipe, out_dtype):
    groups = _groups(group_sizes, x.shape[0])
    return _forward(x, w, groups, recipe, out_dtype)[0]


def _ragged_matmul_fwd(x, w, group_sizes, key, recipe, out_dtype):
    """The forward and its residuals, chosen as `dot_general` chooses them.

    W itself for a high-precision dgrad, x itself for a high-precision wgrad, else the
    packed operands the NVFP4 GEMMs need.
    """
    groups = _groups(group_sizes, x.shape[0])
    y, qw = _forward(x, w, groups, recipe, out_dtype)
    if not recipe.dgrad:
        qw = w
    elif not recipe.weight_2d:
        qw = _quantize_weights(w, recipe, "dgrad")  # 1x16 along N, stored (G, K, N)
    elif qw is None:
        qw = _quantize_weights(w, recipe, "fprop")  # stored (G, N, K), as in fprop
    if not recipe.wgrad:
        x_res, d_x_tokens = x, None
    else:
        qx_tokens, amax_x = _quantize_tokens(x, groups, w.shape[0], recipe)  # stored (K, Mp)
        x_res, d_x_tokens = _pack(qx_tokens), decode_scale(amax_x)
    residuals = (qw, x_res, d_x_tokens, group_sizes, key, PrimalTypes.of(x, w))
    return y, residuals


def _ragged_matmul_bwd(recipe, out_dtype, residuals, dy):
    qw, qx_tokens, d_x_tokens, group_sizes, key, primal_types = residuals
    x_dtype, w_dtype = (aval.dtype for aval in primal_types.avals)
    m = dy.shape[0]
    g = qw.shape[0] if not recipe.dgrad else qw.global_scale.shape[0]
    groups = _groups(group_sizes, m)
    sr = recipe.stochastic_rounding and (recipe.dgrad or recipe.wgrad)
    dgrad_words = wgrad_words = None
    if sr:
        dgrad_words, wgrad_words = keys.group_sr_words(
            key, dy, groups.row_group, g, recipe.implementation
        )

    # dgrad: dx (M, K) = dy (M, N) @ W[g]^T, both operands quantized along N.
    if not recipe.dgrad:
        dx = _high_precision_dgrad(dy, qw, groups.sizes, x_dtype)
    else:
        q_dy, amax_dy = _quantize_rows(dy, groups, g, recipe, dgrad_words)
        w_values, d_w = _weight_values(qw, recipe)  # 2D: (G, N, K) as in fprop; 1D: (G, K, N)
        w_contract = 1 if recipe.weight_2d else 2
        product = _ragged_gemm(1, w_contract, 0)(
            _block_values(q_dy, recipe.gemm_dtype), w_values, groups.sizes
        )
        dx = _row_scale(product, _alpha(decode_scale(amax_dy), d_w), groups, g)

    # wgrad: dW[g] (K, N) = x_g^T dy_g, both quantized along group g's (padded) tokens.
    if not recipe.wgrad:
        dw = _high_precision_wgrad(qx_tokens, dy, groups.sizes, w_dtype)  # x itself (M, K)
    else:
        q_dy_tokens, amax_dy_tokens = _quantize_tokens(dy, groups, g, recipe, wgrad_words)
        x_values = _block_values(_unpack(qx_tokens), recipe.gemm_dtype).T  # (Mp, K)
        dy_values = _block_values(q_dy_tokens, recipe.gemm_dtype).T  # (Mp, N)
        product = _ragged_gemm(0, 0, None)(x_values, dy_values, groups.padded_sizes)  # (G, K, N)
        dw = product * _alpha(d_x_tokens, decode_scale(amax_dy_tokens))[:, None, None]
    # Each gradient with its primal's type: dW of experts replicated over shard_map's axes
    # is the sum of the shards' wgrads, as for `jax.lax.ragged_dot`.
    dx, dw = primal_types.conform(dx.astype(x_dtype), dw.astype(w_dtype))
    return dx, dw, None, None


_ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)


# --- the public op ---------------------------------------------------------------------------


def _check(lhs, rhs, group_sizes):
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
    if group_sizes.shape != (rhs.shape[0],):
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


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
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

    Args:
      lhs: (M, K) activations, bf16/f16/f32; K a multiple of 16.
      rhs: (G, K, N) weights, bf16/f16/f32; N a multiple of 16.
      group_sizes: (G,) integer sizes of the groups, in row order. Sizes should be
        non-negative and sum to at most M, as `jax.lax.ragged_dot` asks; since they may be
        traced they are not checked: a negative size counts as 0 and the groups stop at row M.
      precision: accepted for signature compatibility and ignored.
      preferred_element_type: the result dtype (default: the promoted input dtype).
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
    lhs, rhs, group_sizes = _check(lhs, rhs, group_sizes)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(
            f"ragged_dot: preferred_element_type must be a float dtype, got {out_dtype}"
        )
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
    recipe = dataclasses.replace(recipe, gemm_backend=backend)
    m, n = lhs.shape[0], rhs.shape[2]
    if rhs.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    # Under Explicit mesh axes the grouped GEMMs run on whole operands (the groups are rows
    # of the whole lhs): gathered here, the result sharded along M as lhs is.
    operands = (types.replicated(a) for a in (lhs, rhs, group_sizes))
    y = _ragged_matmul(*operands, key, recipe, out_dtype)
    return types.leading_axis_like(y, lhs)


__all__ = ["group_amax", "padded_rows", "ragged_dot"]
