"""`nvfp4_threefry2x32`: JAX's threefry2x32 hash as one custom call (CPU only).

Native twin: `Threefry2x32Impl` in ffi/cpu/threefry.cc, whose rounds are `Threefry2x32` in
ffi/include/nvfp4/numerics.h (the ones the SR kernels draw their bits with). Bit for bit
`jax.extend.random.threefry2x32_p`: `(y0, y1) = threefry2x32((k0, k1), (x0, x1))` for every
element, the four uint32 operands broadcast to one shape.

Why: XLA's CPU lowering of that primitive is a rolled loop of its 20 rounds, which costs as
much compile time as dozens of plain ops, and an NVFP4 train step hashes a few times per layer
(the layer's key of the step, then dgrad's and wgrad's SR keys). As one custom call the hash
leaves the XLA program; the keys, and so every stochastic rounding, stay the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.core.sr_seed import constant_words

_U32 = jnp.uint32


def threefry2x32(k0, k1, x0, x1) -> tuple[jax.Array, jax.Array]:
    """`jax.extend.random.threefry2x32_p.bind(k0, k1, x0, x1)` by the native CPU kernel.

    The operands are uint32 arrays, broadcast to a common shape (a scalar key and counter
    arrays, as `jax.random` binds the primitive); returns `(y0, y1)` of that shape. Under
    `vmap` the operands are broadcast to a common batch (the hash is elementwise).
    """
    _library.require("threefry2x32")
    if _library.current_platform() != "cpu":
        raise ValueError("threefry2x32: the native hash runs on the CPU only")
    names, operands = ("k0", "k1", "x0", "x1"), [jnp.asarray(v) for v in (k0, k1, x0, x1)]
    for name, v in zip(names, operands, strict=True):
        if v.dtype != _U32:
            raise TypeError(f"threefry2x32: {name} must be uint32, got {v.dtype}{v.shape}")
    try:
        operands = jnp.broadcast_arrays(*operands)
    except ValueError:
        shapes = ", ".join(f"{n} {v.shape}" for n, v in zip(names, operands, strict=True))
        raise ValueError(f"threefry2x32: the operands do not broadcast: {shapes}") from None
    out = jax.ShapeDtypeStruct(operands[0].shape, _U32)
    call = jax.ffi.ffi_call("nvfp4_threefry2x32", (out, out), vmap_method="broadcast_all")
    y0, y1 = call(*operands)
    return y0, y1


def is_threefry_key(key) -> bool:
    """True for a typed threefry2x32 key under the default `jax_threefry_partitionable`.

    Such keys' `fold_in`, `split` and `bits` are what the functions below compute.
    """
    return (
        key is not None
        and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        and str(jax.random.key_impl(key)) == "threefry2x32"
        and jax.config.jax_threefry_partitionable
    )


# The 64-bit counters of `split_bits_words`' four lanes: high words (all 0), the low words of
# `jax.random.split` (key 0, 0, 1, 1) and of `jax.random.bits(k, (2,))` (0, 1 per key).
_HIGH, _SPLIT_LOW, _BITS_LOW = map(constant_words, ([0] * 4, [0, 0, 1, 1], [0, 1, 0, 1]))


def fold_in_words(k0, k1, data, hash_=threefry2x32) -> tuple[jax.Array, jax.Array]:
    """The words of `jax.random.fold_in(key, data)` for threefry keys of words (k0, k1).

    That is `threefry2x32((k0, k1), (0, data))`, elementwise over uint32 arrays that broadcast.
    """
    data = jnp.asarray(data, _U32)
    return hash_(k0, k1, jnp.zeros_like(data), data)


def bits_words(k0, k1, count: int, hash_=threefry2x32) -> jax.Array:
    """`jax.random.bits(k, (count,), uint32)` for threefry keys of words (k0, k1) of shape S.

    uint32 `(*S, count)`: word i is `y0 ^ y1` of `threefry2x32(k, (0, i))` (JAX's
    partitionable bits). One hash of `count` lanes per key.
    """
    shape = (*jnp.shape(k0), count)
    k0, k1 = (jnp.broadcast_to(jnp.asarray(k)[..., None], shape) for k in (k0, k1))
    low = jnp.broadcast_to(jnp.arange(count, dtype=_U32), shape)
    y0, y1 = hash_(k0, k1, jnp.zeros(shape, _U32), low)
    return y0 ^ y1


def split_bits_words(k0, k1, hash_=threefry2x32) -> jax.Array:
    """`jax.random.bits(k, (2,), uint32)` of both keys k of `jax.random.split(key)`.

    For threefry keys of words (k0, k1) of shape S: uint32 `(*S, 4)`, key 0's words then
    key 1's. Two hashes of four lanes where split and two draws take three: split's key i is
    `threefry2x32(key, (0, i))`, for lanes i = 0, 0, 1, 1, and bits of shape (2,) are
    `y0 ^ y1` of `threefry2x32(k, (0, 0))` and `(0, 1)`. `hash_`: this module's native hash,
    or `jax.extend.random.threefry2x32_p.bind` (the same bits).
    """
    shape = (*jnp.shape(k0), 4)
    k0, k1 = (jnp.broadcast_to(jnp.asarray(k)[..., None], shape) for k in (k0, k1))
    high, split_low, bits_low = (jnp.broadcast_to(c, shape) for c in (_HIGH, _SPLIT_LOW, _BITS_LOW))
    y0, y1 = hash_(*hash_(k0, k1, high, split_low), high, bits_low)
    return y0 ^ y1
