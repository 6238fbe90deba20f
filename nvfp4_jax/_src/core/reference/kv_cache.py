"""The NVFP4 KV cache in pure jnp: quantize tokens, write and read pages, decode attention.

Shape letters: B sequences, T new tokens, G key/value heads, H query heads (a multiple of
G), E the head dimension, P pages of `page_size` tokens, L = P * page_size slots, W the
bytes of one side of a page (`KVCacheConfig.page_bytes`). The numbers are docs/NUMERICS.md
section 15's, for each 16-block x_b of one token's head (f32) and the side's decode scale s:

    S_enc = 1 / s                                   (a true division)
    sf_c  = e4m3(min(S_enc * (amax_b * r_c), 448))  r_6 = RCP6; r_4 = 0.25 (4/6 only)
    enc_c = 0 if sf_c == 0 else 1 / (f32(sf_c) * s)
    code  = e2m1(x * enc_c)                         nearest-even, saturating at 6
    x_hat = value(code) * (f32(sf) * s)

Plain NVFP4 uses c = 6; `four_over_six` keeps c = 4 where its squared error
`sum_i (d_2i^2 + d_2i+1^2)`, `d = value(e2m1(x * enc_c)) * (f32(sf_c) * s) - x`, is strictly
smaller. A block holding NaN or inf, or an invalid s (not finite and positive), stores the
E4M3 NaN scale 0x7F and codes 0.

The functions take the cache's arrays and its `KVCacheConfig`; `nvfp4_jax.kv_cache` runs
them when `implementation="reference"` and holds the native kernels to their bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from nvfp4_jax._src.core import formats, primal_types
from nvfp4_jax._src.core.kv_spec import KVCacheConfig

_F32 = jnp.float32
_BLOCK = formats.BLOCK_SIZE


def _e4m3_nan() -> jax.Array:
    nan_byte = jnp.asarray(formats.E4M3_NAN_BYTE, jnp.uint8)
    return jax.lax.bitcast_convert_type(nan_byte, jnp.float8_e4m3fn)


def _codes(y: jax.Array) -> jax.Array:
    """E2M1 codes (nearest-even, saturating; bit 3 the sign of y) of f32 `y`."""
    return formats.e2m1_magnitude_code(jnp.abs(y)) | (jnp.signbit(y).astype(jnp.uint8) << 3)


def _candidate(blocks, block_max, s_enc, s, factor: float):
    """(scale, encode factor) of every block for its amax mapped to 6 (RCP6) or to 4 (0.25).

    The factor is an array formed from the data (`amax * 0 + r`, exactly r for a finite
    amax): under `jit` XLA reassociates `S_enc * (amax * constant)` into
    `(S_enc * constant) * amax`, which rounds differently.
    """
    rcp = block_max * _F32(0) + _F32(factor)
    scaled = jnp.minimum(s_enc * (block_max * rcp), _F32(formats.E4M3_MAX))
    scales = scaled.astype(jnp.float8_e4m3fn)
    sf = scales.astype(_F32)
    safe = jnp.where(sf == 0, _F32(1), sf * s)
    encode = jnp.where(sf == 0, _F32(0), _F32(1) / safe)
    return scales, encode


def _squared_error(blocks, scales, encode, s) -> jax.Array:
    """`sum_i (d_2i^2 + d_2i+1^2)` per block, in vLLM's pair order, each square rounded once.

    The squares go through their bits (clearing the sign bit, a no-op on a square): XLA may
    otherwise contract `a + d * d` into one FMA, which skips the square's rounding.
    """
    codes = _codes(blocks * encode[..., None])
    factor = (scales.astype(_F32) * s)[..., None]
    d = formats.scaled_code_values(codes, factor) - blocks
    bits = jax.lax.bitcast_convert_type(d * d, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    squares = jax.lax.bitcast_convert_type(bits, _F32)
    err = jnp.zeros(squares.shape[:-1], _F32)
    for i in range(_BLOCK // 2):
        err = err + (squares[..., 2 * i] + squares[..., 2 * i + 1])
    return err


def quantize_heads(x: jax.Array, scale, *, four_over_six: bool = False):
    """Quantizes each head vector of `x` (..., E) with the side's decode scale `scale`.

    Args:
      x: bf16, f16 or f32 (..., E), E a multiple of 16 (checked by the caller).
      scale: the f32 decode scale s of the side (a scalar).
      four_over_six: choose map-to-4 or map-to-6 per block (vLLM's `nvfp4_4over6`).

    Returns:
      (codes uint8 (..., E/2), element 2i in the low nibble; scales float8_e4m3fn (..., E/16)).
    """
    s = jnp.asarray(scale, _F32)
    xs = x.astype(_F32)
    blocks = xs.reshape(*xs.shape[:-1], xs.shape[-1] // _BLOCK, _BLOCK)
    block_max = jnp.max(jnp.abs(blocks), axis=-1)
    bad = jnp.any(~jnp.isfinite(blocks), axis=-1) | ~((s > 0) & (s < jnp.inf))
    s_enc = _F32(1) / s
    scales, encode = _candidate(blocks, block_max, s_enc, s, formats.RCP6)
    if four_over_six:
        scales4, encode4 = _candidate(blocks, block_max, s_enc, s, 0.25)
        err6 = _squared_error(blocks, scales, encode, s)
        err4 = _squared_error(blocks, scales4, encode4, s)
        pick4 = err4 < err6  # strict: ties (and NaN) keep map-to-6
        scales = jnp.where(pick4, scales4, scales)
        encode = jnp.where(pick4, encode4, encode)
    codes = _codes(blocks * encode[..., None])
    codes = jnp.where(bad[..., None], jnp.uint8(0), codes)
    scales = jnp.where(bad, _e4m3_nan(), scales)
    return formats.pack_nibbles(codes.reshape(xs.shape)), scales


def dequantize_heads(codes: jax.Array, scales: jax.Array, scale, dtype=_F32) -> jax.Array:
    """`value(code) * (f32(sf) * s)` of packed codes (..., E/2) and scales (..., E/16)."""
    unpacked = formats.unpack_nibbles(codes)
    blocks = unpacked.reshape(*scales.shape, _BLOCK)
    factor = scales.astype(_F32) * jnp.asarray(scale, _F32)
    values = formats.scaled_code_values(blocks, factor[..., None])
    return values.reshape(unpacked.shape).astype(dtype)


# --- the page layout -------------------------------------------------------------------------


def _write_sequence(config: KVCacheConfig, pages, codes, scales, position):
    """One sequence's pages (P, 2, W) with its T tokens' codes and scale bytes written.

    `codes` (2, T, G, E/2), `scales` (2, T, G, E/16) uint8, side by side; token t goes to
    slot `position + t`; slots outside the cache are dropped (an out-of-range page index).
    """
    tokens = codes.shape[1]
    slots = position + jnp.arange(tokens, dtype=jnp.int32)
    inside = (slots >= 0) & (slots < pages.shape[0] * config.page_size)
    page = jnp.where(inside, slots // config.page_size, pages.shape[0])[:, None, None]
    offset = jnp.where(inside, slots % config.page_size, 0)[:, None, None]
    heads = jnp.arange(config.kv_heads)[None, :, None]
    data_at = config.data_offset(offset, heads, jnp.arange(config.data_dim))  # (T, G, E/2)
    for side in range(2):
        scale_at = config.scale_offset(side, offset, heads, jnp.arange(config.scale_dim))
        pages = pages.at[page, side, data_at].set(codes[side], mode="drop")
        pages = pages.at[page, side, scale_at].set(scales[side], mode="drop")
    return pages


def write(config: KVCacheConfig, pages, k_scale, v_scale, k, v, positions) -> jax.Array:
    """The pages with T new tokens of every sequence written at `positions` (B,) onwards.

    `pages` uint8 (B, P, 2, W); `k`, `v` (B, T, G, E). Token t of sequence b goes to slot
    `positions[b] + t`; slots outside [0, L) are not written (vLLM's negative slot). The
    sequences are written one by one (`vmap`): their pages, tokens and positions share the
    batch axis, whatever its sharding.
    """
    codes, scales = [], []
    for x, scale in ((k, k_scale), (v, v_scale)):
        c, s = quantize_heads(x, scale, four_over_six=config.four_over_six)
        codes.append(c)
        scales.append(jax.lax.bitcast_convert_type(s, jnp.uint8))
    codes, scales = jnp.stack(codes, axis=1), jnp.stack(scales, axis=1)  # (B, 2, T, G, .)
    positions = jnp.asarray(positions, jnp.int32)
    codes, scales, positions = (_batch_like(x, pages) for x in (codes, scales, positions))
    one = functools.partial(_write_sequence, config)
    return jax.vmap(one)(pages, codes, scales, positions)


def _batch_like(x: jax.Array, pages: jax.Array) -> jax.Array:
    """`x` with its batch axis sharded as the pages' under Explicit mesh axes (else `x`).

    `vmap` over the sequences needs the axis sharded alike on every operand.
    """
    sharding = primal_types.explicit_spec(jax.typeof(pages))
    if sharding is None:
        return x
    entry = primal_types.spec_entries(pages)[0]
    return jax.sharding.reshard(x, P(entry, *([None] * (x.ndim - 1))))


def read_side(config: KVCacheConfig, pages: jax.Array, side: int):
    """(codes uint8 (B, L, G, E/2), scales float8_e4m3fn (B, L, G, E/16)) of one side."""
    b, p = pages.shape[:2]
    flat = pages[:, :, side, :]
    data = jnp.take(flat, jnp.asarray(config.data_offsets().reshape(-1)), axis=-1)
    scales = jnp.take(flat, jnp.asarray(config.scale_offsets(side).reshape(-1)), axis=-1)
    # Split the page's bytes, then merge the pages' slots: two reshapes, each of which a
    # batch axis sharded over Explicit mesh axes allows.
    page, g = config.page_size, config.kv_heads
    codes = data.reshape(b, p, page, g, config.data_dim).reshape(b, p * page, g, -1)
    scales = scales.reshape(b, p, page, g, config.scale_dim).reshape(b, p * page, g, -1)
    return codes, jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)


def read(config: KVCacheConfig, pages, k_scale, v_scale, dtype=_F32):
    """The dequantized keys and values, each (B, L, G, E) in `dtype`."""
    out = []
    for side, scale in enumerate((k_scale, v_scale)):
        codes, scales = read_side(config, pages, side)
        out.append(dequantize_heads(codes, scales, scale, dtype))
    return tuple(out)


def visible(lengths, tokens: int, capacity: int) -> jax.Array:
    """Which slots each query sees: bool (B, T, L); query t sees j < lengths - (T - 1 - t)."""
    last = jnp.asarray(lengths, jnp.int32)[:, None] - (tokens - 1) + jnp.arange(tokens)
    return jnp.arange(capacity)[None, None, :] < last[..., None]


def attention(config: KVCacheConfig, q, pages, k_scale, v_scale, lengths, softmax_scale):
    """Decode attention over the cache: the cache dequantized in f32, then XLA's dots.

    `q` (B, T, H, E), H a multiple of G (query head h reads key/value head h // (H/G));
    `lengths` (B,): the slots the last query of each sequence sees. Returns f32 (B, T, H, E);
    a query that sees no slot gets zeros.
    """
    k, v = read(config, pages, k_scale, v_scale)
    b, t, h, e = q.shape
    g = config.kv_heads
    qg = q.astype(_F32).reshape(b, t, g, h // g, e)
    scores = jnp.einsum("btgre,blge->bgrtl", qg, k, precision=jax.lax.Precision.HIGHEST)
    scores = scores * jnp.asarray(softmax_scale, _F32)
    mask = visible(lengths, t, k.shape[1])[:, None, None]  # (B, 1, 1, T, L)
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, _F32(0))
    weights = jnp.where(mask, jnp.exp(scores - top), _F32(0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, _F32(1))
    # Slots no query sees hold anything (a NaN block too): zeros, so 0 * v stays 0.
    seen = jnp.any(mask, axis=(1, 2, 3))[..., None, None]  # (B, L, 1, 1)
    v = jnp.where(seen, v, _F32(0))
    out = jnp.einsum("bgrtl,blge->btgre", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, t, h, e)


def empty_pages(config: KVCacheConfig, batch: int, length: int) -> np.ndarray:
    """The zero pages of `batch` sequences of `length` slots (whole pages): (B, P, 2, W)."""
    return np.zeros((batch, config.pages_for(length), 2, config.page_bytes), np.uint8)
