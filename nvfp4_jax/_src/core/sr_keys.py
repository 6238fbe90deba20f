"""The stochastic-rounding keys of the training ops: every derivation, in one place.

docs/NUMERICS.md section 12 defines them; each is a function of JAX's threefry PRNG, and
every function here gives `jax.random`'s bits exactly:

* the NVFP4 layers' key of a step: an nnx rng stream's key folded with its count
  (`step_key`, what `stream()` gives);
* the backward's keys: `jax.random.split(key)` into dgrad's and wgrad's (`sr_seeds`), and
  without a caller's key one derived from the output gradient's bits (`gradient_key`);
  under MS-EDEN each GEMM's rotation and operand seeds from its key (`ms_eden_randomness`);
* a batch element's or a group's key, `fold_in(key, i)` (`element_keys`), and `ragged_dot`'s
  per-group keys and key words (`group_sr_words`), each group's gradient key from its own
  rows of dy (`group_digests`);
* the hash itself: the native kernel `kernels.threefry2x32` (one custom call) where the
  backend registry says it runs (`native_hash`), else JAX's `threefry2x32_p`; and its jnp
  twin `threefry2x32`, written out elementwise for a key per element.

The random *bits* of a tensor under one key are `reference.random_bytes`' (section 7).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.extend.random
import jax.numpy as jnp

from nvfp4_jax._src.core import backends
from nvfp4_jax._src.core.kernels._threefry import (
    bits_words,
    fold_in_words,
    is_threefry_key,
    split_bits_words,
)
from nvfp4_jax._src.core.kernels._threefry import threefry2x32 as native_threefry2x32
from nvfp4_jax._src.core.sr_seed import SRSeed, constant_words

_F32 = jnp.float32
_U32 = jnp.uint32
# The seed of the key derived from dy's bits when the caller gives none (`gradient_key`).
GRADIENT_KEY_SEED = 0x4E564650
# `SRSeed.from_key`'s counter offset (element 0).
_ZERO_OFFSET = constant_words([0, 0])


# --- the hash ---------------------------------------------------------------------------------


def native_hash(implementation) -> bool:
    """True where the SR keys are hashed by `kernels.threefry2x32`, one native custom call.

    The backend registry's answer (`backends.runs_natively("sr_key_hash", ...)`: on the CPU,
    when the native kernels run the GEMMs' quantization). The same bits as JAX's
    threefry2x32, whose CPU lowering XLA compiles as a rolled loop that costs as much as
    dozens of plain ops (a few per layer and step). The reference implementation stays pure
    JAX (its programs hold no custom call). `benchmarks/train_step.py --jax-threefry`
    replaces this function to compile JAX's hash instead.
    """
    return backends.runs_natively("sr_key_hash", implementation)


def _hash(implementation):
    """The threefry2x32 hash of `implementation`'s SR keys: native or JAX's primitive."""
    if native_hash(implementation):
        return native_threefry2x32
    return jax.extend.random.threefry2x32_p.bind


# Threefry-2x32's rotation distances, rounds 0-3 and 4-7 (Salmon et al., "Parallel random
# numbers: as easy as 1, 2, 3", SC 2011), and its key-schedule parity constant.
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


def threefry2x32(k0, k1, x0, x1) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with 20 rounds, elementwise over arrays of keys and counters (uint32).

    Bit for bit `jax.extend.random.threefry_2x32((k0, k1), (x0, x1))` (a test holds them
    equal), written out so that XLA fuses it into one elementwise loop: with a key per
    element, `vmap` of JAX's primitive lowers on the CPU to a rolled loop, 3x slower.
    """
    keys = (k0, k1, k0 ^ k1 ^ _U32(_THREEFRY_PARITY))
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << _U32(r)) | (x1 >> _U32(32 - r))) ^ x0
        x0 = x0 + keys[(i + 1) % 3]
        x1 = x1 + keys[(i + 2) % 3] + _U32(i + 1)
    return x0, x1


# --- one key ----------------------------------------------------------------------------------


def fold_in(key, data, implementation=None):
    """`jax.random.fold_in(key, data)`, bit for bit, for a uint32 scalar `data`.

    Where `native_hash(implementation)`, a threefry key is hashed by the native kernel
    (`kernels.fold_in_words`: `threefry2x32(k, (0, d))`, as JAX's threefry implementation
    has it; a test holds them equal). Otherwise `jax.random.fold_in`.
    """
    if not (is_threefry_key(key) and native_hash(implementation)):
        return jax.random.fold_in(key, data)
    words = jax.random.key_data(key)
    y0, y1 = fold_in_words(words[0], words[1], jnp.asarray(data, _U32).reshape(1))
    return jax.random.wrap_key_data(jnp.concatenate([y0, y1]), impl="threefry2x32")


def step_key(stream_key, count, implementation=None):
    """An NVFP4 layer's key of a step: its rng stream's key folded with the stream's count.

    What `flax.nnx`'s `stream()` gives (the caller advances the count), hashed by `fold_in`:
    one native custom call on the CPU instead of XLA's rolled threefry loop.
    """
    return fold_in(stream_key, count, implementation)


def _numbers(count: int, ids=None) -> jax.Array:
    """(count,) uint32: 0..count-1, or `ids` (an expert-parallel shard's global group numbers)."""
    return jnp.arange(count, dtype=_U32) if ids is None else jnp.asarray(ids).astype(_U32)


def element_keys(key, count: int, ids=None):
    """`fold_in(key, i)` for i in 0..count-1, or in `ids` (count,): a batch element's keys.

    A group's too: an expert-parallel shard's groups keep their global numbers as `ids`.
    """
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(_numbers(count, ids))


def _mix32(h):
    """murmur3's 32-bit finalizer: a bijection of uint32 that scrambles every bit."""
    h = (h ^ (h >> 16)) * _U32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _mixed_bits(dy):
    """`mix32(bits(f32(dy)))`: each element's bits, mixed (uint32, dy's shape)."""
    return _mix32(jax.lax.bitcast_convert_type(dy.astype(_F32), _U32))


def gradient_key(dy, implementation=None):
    """A key that changes whenever dy does: a wrapping sum of dy's mixed bits, into a seed.

    Used for stochastic rounding when the caller passes no key, so that a drop-in
    `dot_general` draws fresh randomness every step. Integer addition is associative, so the
    key is the same on every platform, implementation and sharding. Each element's bits are
    mixed before the sum: a plain sum of bits is blind to scaling dy by 2 (every element
    gains 2**23, and n * 2**23 wraps to 0 for n a multiple of 512), which would repeat the
    rounding of the unscaled gradient.
    """
    digest = jnp.sum(_mixed_bits(dy), dtype=_U32)
    return fold_in(jax.random.key(GRADIENT_KEY_SEED), digest, implementation)


def sr_seeds(key, implementation=None) -> tuple:
    """The SR keys of dgrad and wgrad: the two keys of `jax.random.split(key)`, as `SRSeed`s.

    Each seed's words are `jax.random.bits(k, (2,), uint32)` of its key (`SRSeed.from_key`).
    For threefry keys (JAX's default, with its default `jax_threefry_partitionable`) both
    seeds take two hashes (`kernels.split_bits_words`) where split and two draws take three,
    by the native kernel where `native_hash(implementation)` (one custom call each), else
    by JAX's primitive. Other keys take `jax.random.split`, each seed drawn on its own. Tests
    hold the seeds equal to `SRSeed.from_key` of `jax.random.split(key)`.
    """
    if not is_threefry_key(key):
        keys = jax.random.split(key)
        return keys[0], keys[1]
    data = jax.random.key_data(key)
    words = split_bits_words(data[0], data[1], _hash(implementation))  # key 0, key 1
    return SRSeed(words[:2], _ZERO_OFFSET), SRSeed(words[2:], _ZERO_OFFSET)


class GemmRandomness(NamedTuple):
    """MS-EDEN's randomness of one backward GEMM (docs/NUMERICS.md section 14).

    Attributes:
      rotation: uint32 (4,), the rotation's 128 sign bits, shared by both operands.
      gradient: the `SRSeed` of the scales' rounding of dy (the left operand).
      other: the `SRSeed` of the other operand's (W for dgrad, x for wgrad).
    """

    rotation: jax.Array
    gradient: SRSeed
    other: SRSeed


def ms_eden_randomness(key, implementation=None) -> tuple[GemmRandomness, GemmRandomness]:
    """MS-EDEN's randomness of dgrad and wgrad from the backward's key.

    GEMM g (0 dgrad, 1 wgrad) has the key `k_g` whose data are the words `sr_seeds(key)[g]`
    has (for non-threefry keys, `jax.random.split(key)[g]` itself): its rotation is
    `jax.random.bits(k_g, (4,), uint32)`, and `jax.random.split(k_g)` gives the seeds of the
    gradient operand (key 0) and of the other one (key 1), each `SRSeed.from_key`. Where
    `native_hash(implementation)`, the hashes of both GEMMs run as native custom calls (three
    of eight lanes each, after `sr_seeds`' two); tests hold them equal to `jax.random`'s.
    """
    seeds = sr_seeds(key, implementation)
    if not isinstance(seeds[0], SRSeed):  # not a threefry key: split and draw with JAX
        return tuple(_gemm_randomness_of_key(k) for k in seeds)
    words = jnp.stack([seed.key_words for seed in seeds])  # (2, 2): dgrad's, wgrad's
    both = words_ms_eden_randomness(words, implementation)
    return tuple(jax.tree.map(lambda leaf, g=g: leaf[g], both) for g in range(2))


def words_ms_eden_randomness(words, implementation=None) -> GemmRandomness:
    """MS-EDEN's randomness of GEMMs whose keys are the threefry key words `words` (G, 2).

    Leaves batched over G: the rotations (G, 4) are `jax.random.bits(k, (4,), uint32)` of
    each key k, and the seeds (G, 2) those of `jax.random.split(k)`'s keys 0 (the gradient
    operand) and 1 (the other). `ragged_dot` gives each group's SR words (`group_sr_words`).
    """
    hash_ = _hash(implementation)
    k0, k1 = words[:, 0], words[:, 1]
    rotation = bits_words(k0, k1, 4, hash_)  # (G, 4)
    split = split_bits_words(k0, k1, hash_)  # (G, 4): key 0's words, key 1's
    offset = jnp.zeros((words.shape[0], 2), _U32)
    return GemmRandomness(rotation, SRSeed(split[:, :2], offset), SRSeed(split[:, 2:], offset))


def _gemm_randomness_of_key(key) -> GemmRandomness:
    keys = jax.random.split(key)
    return GemmRandomness(
        jax.random.bits(key, (4,), _U32), SRSeed.from_key(keys[0]), SRSeed.from_key(keys[1])
    )


# --- a key per group (ragged_dot) -------------------------------------------------------------


def group_digests(dy, row_group, num_groups: int) -> jax.Array:
    """(G,) uint32: the wrapping sum of `mix32(bits(f32(dy)))` over each group's rows.

    `row_group[i]` is row i's group (G: none). Group g's gradient key is `gradient_key` of
    its rows alone: `fold_in(key(GRADIENT_KEY_SEED), digest_g)`.
    """
    row_digest = jnp.sum(_mixed_bits(dy), axis=1, dtype=_U32)
    return jax.ops.segment_sum(row_digest, row_group, num_segments=num_groups)


def _group_keys(key, dy, row_group, num_groups: int, group_ids=None) -> jax.Array:
    """Every group's key, (G,) keys: `fold_in(key, id_g)`, or from its rows of dy for None."""
    if key is not None:
        return element_keys(key, num_groups, group_ids)
    base = jax.random.key(GRADIENT_KEY_SEED)
    digest = group_digests(dy, row_group, num_groups)
    return jax.vmap(lambda d: jax.random.fold_in(base, d))(digest)


def _key_words(keys) -> jax.Array:
    """(G, 2) uint32: `(k0, k1) = jax.random.bits(key, (2,), uint32)` of every key."""
    return jax.vmap(lambda k: jax.random.bits(k, (2,), _U32))(keys)


def group_sr_words(key, dy, row_group, num_groups: int, implementation=None, group_ids=None):
    """The SR key words of every group for dgrad and for wgrad, (G, 2) each.

    They are the words (`jax.random.bits(k, (2,), uint32)`) of the two keys of
    `jax.random.split(k_g)`, k_g group g's key: `fold_in(key, id_g)` with `id_g = g` unless
    `group_ids` (G,) numbers the groups otherwise (an expert-parallel shard's experts keep
    their global numbers), or with `key` None its gradient key (`group_digests`). Where
    `native_hash(implementation)` and the keys are threefry ones, the hashes are native
    custom calls (`kernels.fold_in_words`, `split_bits_words`): the same bits, without the
    rolled loops XLA's CPU compiler makes of JAX's hashes.
    """
    base = jax.random.key(GRADIENT_KEY_SEED) if key is None else key
    if not (native_hash(implementation) and is_threefry_key(base)):
        group_keys = _group_keys(key, dy, row_group, num_groups, group_ids)
        keys = jax.vmap(jax.random.split)(group_keys)
        return _key_words(keys[:, 0]), _key_words(keys[:, 1])
    if key is None:
        data = group_digests(dy, row_group, num_groups)
    else:
        data = _numbers(num_groups, group_ids)
    words = jax.random.key_data(base)
    k0, k1 = fold_in_words(words[0], words[1], data)
    split = split_bits_words(k0, k1)  # (G, 4)
    return split[:, :2], split[:, 2:]
