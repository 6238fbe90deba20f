"""SRSeed: where stochastic rounding draws its random bits.

Stochastic rounding (docs/NUMERICS.md section 7) gives element n of a tensor (its flat index
in the stored layout) byte `n % 8` of `threefry2x32((k0, k1), counter)` with counter
`n // 8`. A shard of a larger tensor must draw the bits of its elements' *global* positions,
so its counters start at an offset: the global flat index of its first element, over 8.
`SRSeed` carries both, the key words and that counter offset, and is the one seed type of
the package: the reference, the native kernels, the sharding rules and `shard_map` helpers
all take it. Every public op that rounds stochastically takes `key=`: a JAX PRNG key (offset
0) or an `SRSeed`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_U32 = jnp.uint32
_MASK32 = 0xFFFFFFFF


def constant_words(values) -> np.ndarray:
    """Read-only uint32 words, lowered to one constant however many calls take them.

    A `jnp.zeros` or `jnp.array` is an op per call.
    """
    array = np.array(values, np.uint32)
    array.flags.writeable = False
    return array


def _counter_words(element_offset) -> jax.Array:
    """The counter offset `element_offset // 8` as uint32 `(lo, hi)`.

    `element_offset` is a multiple of 16 >= 0: a Python int of any size (64-bit counters), or
    a traced unsigned/signed integer scalar below 2**32.
    """
    if isinstance(element_offset, (bool, np.bool_)):
        raise TypeError(f"SRSeed: element_offset must be an int, got {element_offset!r}")
    if isinstance(element_offset, (int, np.integer)):
        offset = int(element_offset)
        if offset < 0 or offset % 16 or offset // 8 >= 2**64:
            raise ValueError(
                f"SRSeed: element_offset must be a multiple of 16 in [0, 2**67), got {offset}"
            )
        counter = offset // 8
        return jnp.array([counter & _MASK32, counter >> 32], _U32)
    offset = jnp.asarray(element_offset)
    if offset.shape != () or not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(
            f"SRSeed: element_offset must be an integer scalar, got {offset.dtype}{offset.shape}"
        )
    return jnp.stack([offset.astype(_U32) >> 3, _U32(0)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SRSeed:
    """The randomness of stochastic rounding: threefry key words and a counter offset.

    Attributes:
      key_words: uint32 `(2,)`, `(k0, k1) = jax.random.bits(key, (2,), uint32)`.
      counter_offset: uint32 `(2,)`, `(lo, hi)` of the 64-bit counter of element 0: the
        global flat index of the first element (in the stored layout) divided by 8. Zero
        for a whole tensor.

    A pytree (both fields are leaves), so it passes through `jit`, `vmap` and `shard_map`.

    Example:
      >>> seed = SRSeed.from_key(jax.random.key(0), element_offset=64)
      >>> seed.counter_offset.tolist()
      [8, 0]
    """

    key_words: jax.Array
    counter_offset: jax.Array

    @classmethod
    def from_key(cls, key: jax.Array, *, element_offset=0) -> SRSeed:
        """The seed of a PRNG key (typed, or a legacy uint32[2] key) for elements from an offset.

        Args:
          key: a JAX PRNG key.
          element_offset: the global flat index of the first element this seed rounds, a
            multiple of 16 (a Python int, or a traced integer below 2**32).
        """
        words = jax.random.bits(key, (2,), _U32)
        return cls(key_words=words, counter_offset=_counter_words(element_offset))

    @classmethod
    def from_operand(cls, words: jax.Array) -> SRSeed:
        """The inverse of `operand`: a seed from uint32 `(k0, k1, lo, hi)`."""
        return cls(key_words=words[:2], counter_offset=words[2:])

    def operand(self) -> jax.Array:
        """uint32 `(k0, k1, counter lo, counter hi)`: the operand the native kernels take."""
        return jnp.concatenate(
            [jnp.asarray(self.key_words, _U32), jnp.asarray(self.counter_offset, _U32)]
        )

    def advance(self, elements) -> SRSeed:
        """The seed of the elements `elements` further on (a multiple of 16; int or traced).

        The counter offset grows by `elements // 8`, with carry into the high word.
        """
        step = _counter_words(elements)
        low = self.counter_offset[0] + step[0]  # wraps modulo 2**32
        carry = (low < step[0]).astype(_U32)
        high = self.counter_offset[1] + step[1] + carry
        return SRSeed(key_words=self.key_words, counter_offset=jnp.stack([low, high]))


def as_seed(key, op: str) -> SRSeed:
    """`key` as an `SRSeed`: an SRSeed is returned as it is, a PRNG key gets offset 0."""
    if isinstance(key, SRSeed):
        return key
    if key is None:
        raise ValueError(f"{op}: stochastic_rounding=True needs a PRNG key, got key=None")
    try:
        return SRSeed.from_key(key)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{op}: key must be a JAX PRNG key or an nvfp4_jax.SRSeed, got {key!r} ({error})"
        ) from None
