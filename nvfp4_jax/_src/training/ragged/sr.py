"""The stochastic-rounding bytes of grouped tensors, at each group's own positions.

Every group rounds as a tensor of its own (docs/NUMERICS.md section 12): an element draws
its bits from its group's key words (`keys.group_sr_words`) at its position in that group's
own tensor, with section 7's 64-bit counters, so that each group's bits are those of
`dot_general` on its rows alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import sr_keys
from nvfp4_jax._src.training.ragged.groups import Groups, take_group

_U32 = jnp.uint32


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
    hashed = sr_keys.threefry2x32(k[..., 0], k[..., 1], *counter)
    shifts = jnp.arange(0, 32, 8, dtype=_U32)
    parts = [(word[..., None] >> shifts) & _U32(0xFF) for word in hashed]
    return jnp.concatenate(parts, axis=-1).astype(jnp.uint8)


def row_random(words, groups: Groups, n: int) -> jax.Array:
    """SR bytes (M, N) of a row-grouped (M, N) tensor quantized along N (dgrad's dy).

    Element (i, c) of group g is element `row_local[i] * N + c` of dy_g.
    """
    chunks = jnp.arange(n // 8, dtype=_U32)
    counter = _counter(groups.row_local.astype(_U32)[:, None], _U32(n // 8), chunks)
    group = jnp.broadcast_to(groups.row_group[:, None], counter[1].shape)
    return _random_bytes(words, group, counter).reshape(group.shape[0], n)


def padded_random(words, groups: Groups, n: int) -> jax.Array:
    """SR bytes (N, Mp) of the padded layout stored (N, Mp), quantized along the tokens.

    Element (c, p) of group g is element `c * L_g + pad_local[p]` of group g's own stored
    (N, L_g) tensor, `L_g` its padded size.
    """
    first = groups.pad_group[::8]  # the group of every 8-token chunk
    local = groups.pad_local[::8].astype(_U32) // _U32(8)
    rows = take_group(groups.padded_sizes, first, 0).astype(_U32) // _U32(8)
    counter = _counter(jnp.arange(n, dtype=_U32)[:, None], rows, local)
    group = jnp.broadcast_to(first, counter[1].shape)
    return _random_bytes(words, group, counter).reshape(n, groups.pad_group.shape[0])
