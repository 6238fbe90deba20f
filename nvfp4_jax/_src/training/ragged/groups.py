"""The groups of a ragged GEMM: where every row sits, the grouped padded layout, each amax.

`x` (M, K) holds the tokens sorted by group and `group_sizes` (G,) how many rows each group
gets (a traced array: every shape here is static). `find_groups` numbers every row with its
group and its index inside it, and lays the groups out at 16-aligned offsets of a zero
buffer of static size (the *grouped padded layout*, docs/NUMERICS.md section 12), so that
blocks of 16 tokens never straddle two groups. `group_amax` is each group's tensor amax, by
segment reductions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import formats

_F32 = jnp.float32
_I32 = jnp.int32
_BLOCK = formats.BLOCK_SIZE


class Groups(NamedTuple):
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


def find_groups(group_sizes: jax.Array, m: int) -> Groups:
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
    return Groups(sizes, row_group, rows - row_start, padded_sizes, pad_group, pad_local, pad_row)


def to_padded(a: jax.Array, groups: Groups) -> jax.Array:
    """Rows (M, C) -> the grouped padded layout (Mp, C): group g's rows at its offset, else 0."""
    padded = jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])
    return padded[groups.pad_row]


def take_group(table: jax.Array, index: jax.Array, fill) -> jax.Array:
    """`table[index]` with index G (no group) giving `fill`."""
    return jnp.concatenate([table, jnp.full((1,), fill, table.dtype)])[index]


def segment_amax(xs: jax.Array, ids: jax.Array, groups: int, axis: int) -> jax.Array:
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
        return segment_amax(flat, ids, num_groups, axis=0)
    rows = find_groups(jnp.asarray(group_sizes), x.shape[0]).row_group
    return segment_amax(x.astype(_F32), rows, num_groups, axis=0)
