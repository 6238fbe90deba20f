"""Stochastic rounding to the E2M1 grid (docs/NUMERICS.md section 7), in pure jnp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.random import threefry_2x32

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.sr_seed import SRSeed

_F32 = jnp.float32
# The counters of one call are 32-bit offsets from the seed's: fewer than 2**35 elements.
MAX_ELEMENTS = 2**35


def random_bytes(seed: SRSeed, count: int) -> jax.Array:
    """Returns the `count` random uint8 values of elements 0..count-1 under `seed`.

    Element n uses counter `j = seed.counter_offset + n // 8` (64-bit, carry into the high
    word), hashed as `threefry2x32((k0, k1), (j >> 32, j & 0xFFFFFFFF))`, and takes byte
    `n % 8` of the 64-bit word `w0 | w1 << 32`, least significant byte first.

    Example:
      >>> seed = SRSeed.from_key(jax.random.key(0))
      >>> random_bytes(seed, 20).shape
      (20,)
    """
    if count >= MAX_ELEMENTS:
        raise ValueError(f"stochastic rounding supports fewer than 2**35 elements, got {count}")
    counters = -(-count // 8)
    if counters == 0:
        return jnp.zeros((0,), jnp.uint8)
    local = jnp.arange(counters, dtype=jnp.uint32)
    base = jnp.asarray(seed.counter_offset, jnp.uint32)
    low = local + base[0]  # wraps modulo 2**32; the carry goes into the high word
    high = base[1] + (low < local).astype(jnp.uint32)
    # threefry_2x32 hashes the pairs (count[i], count[i + len/2]): high words first, then low.
    words = jnp.asarray(seed.key_words, jnp.uint32)
    hashed = threefry_2x32((words[0], words[1]), jnp.concatenate([high, low]))
    w0, w1 = hashed[:counters], hashed[counters:]
    shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
    parts = [(w[:, None] >> shifts) & 0xFF for w in (w0, w1)]
    return jnp.concatenate(parts, axis=1).reshape(-1)[:count].astype(jnp.uint8)


def stochastic_magnitude(magnitude: jax.Array, random: jax.Array) -> jax.Array:
    """Rounds |y| to the E2M1 grid with 8 random bits per element.

    `t = |y| + u * step(|y|)` with `u = r / 256`, then `min(floor(t / step(t)) * step(t), 6)`,
    where step(v) is 0.5 below 2, 1 below 4, else 2.
    """

    def step(v):
        return jnp.where(v < 2, _F32(0.5), jnp.where(v < 4, _F32(1), _F32(2)))

    u = random.astype(_F32) * _F32(1 / 256)
    t = magnitude + u * step(magnitude)
    t_step = step(t)
    # t / step(t) is exact (step is a power of two): multiply by the exact reciprocal.
    return jnp.minimum(jnp.floor(t * (_F32(1) / t_step)) * t_step, _F32(formats.FP4_MAX))
