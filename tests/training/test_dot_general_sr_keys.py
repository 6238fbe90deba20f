"""The stochastic-rounding keys of `dot_general`'s backward (nvfp4_jax/_src/core/sr_keys.py, as
the training GEMMs use it): the same key gives the same gradients, without a key the rounding
follows dy, `sr_seeds` are the split keys' seeds and `fold_in` is `jax.random.fold_in`, bit for
bit on every implementation, and the native hash leaves no threefry loop in the program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dot_general_oracle import IMPLEMENTATIONS, vjp
from helpers import DENSE, assert_same_bits, bits, normal

from nvfp4_jax import NVFP4Recipe, dot_general
from nvfp4_jax._src.core.sr_keys import fold_in, sr_seeds
from nvfp4_jax._src.core.sr_seed import SRSeed, as_seed

# --- stochastic rounding keys --------------------------------------------------------------


def grads(x, w, dy, key):
    return vjp(x, w, dy, NVFP4Recipe(), key)[1:]


def test_same_key_gives_same_gradients_and_different_keys_differ():
    x, w, dy = normal((32, 64), 17), normal((64, 32), 18), normal((32, 32), 19)
    a = grads(x, w, dy, jax.random.key(1))
    b = grads(x, w, dy, jax.random.key(1))
    c = grads(x, w, dy, jax.random.key(2))
    for ga, gb, gc in zip(a, b, c, strict=True):
        assert_same_bits(ga, gb)
        assert not np.array_equal(bits(ga), bits(gc))


def test_without_key_the_rounding_follows_dy():
    # Scaling dy by 2 scales every quantization exactly (amax and scales are powers of two
    # apart), so with a fixed key the gradients double bit for bit; with key=None the key is
    # derived from dy's bits, and 2*dy gets different rounding.
    x, w, dy = normal((32, 64), 20), normal((64, 32), 21), normal((32, 32), 22)
    fixed = jax.random.key(5)
    for g1, g2 in zip(grads(x, w, dy, fixed), grads(x, w, 2 * dy, fixed), strict=True):
        assert_same_bits(2 * g1, g2)

    first, again, doubled = (grads(x, w, d, None) for d in (dy, dy, 2 * dy))
    for g1, g1_again, g2 in zip(first, again, doubled, strict=True):
        assert_same_bits(g1, g1_again)
        assert not np.array_equal(bits(2 * g1), bits(g2))


@pytest.mark.parametrize(
    "make_key, partitionable",
    [
        (lambda: jax.random.key(7), True),
        (lambda: jax.random.PRNGKey(7), True),  # a raw uint32[2] key
        (lambda: jax.random.key(7), False),
        (lambda: jax.random.key(7, impl="rbg"), True),
        (lambda: jax.random.key(7, impl="unsafe_rbg"), True),
    ],
    ids=["threefry", "raw", "threefry_original", "rbg", "unsafe_rbg"],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sr_seeds_are_the_split_keys_seeds(make_key, partitionable, implementation):
    # The backward hashes both SR seeds together where it can (`keys.sr_seeds`; with "ffi" on the
    # CPU by the native hash): they must be `SRSeed.from_key` of the two halves of
    # `jax.random.split(key)`, eagerly, under jit and under vmap, for every kind of key.
    seeds = functools.partial(sr_seeds, implementation=implementation)
    with jax.threefry_partitionable(partitionable):
        key = make_key()
        want = [SRSeed.from_key(k) for k in jax.random.split(key)]
        for got in (seeds(key), jax.jit(seeds)(key)):
            for seed, ref in zip(got, want, strict=True):
                seed = as_seed(seed, "test")
                assert_same_bits(seed.key_words, ref.key_words)
                assert_same_bits(seed.counter_offset, ref.counter_offset)
        # Under vmap too (a batched dot_general's backward).
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(3, dtype=jnp.uint32))
        got = jax.vmap(lambda k: [as_seed(s, "test").key_words for s in seeds(k)])(keys)
        want = jax.vmap(lambda k: [SRSeed.from_key(s).key_words for s in jax.random.split(k)])(keys)
        for words, ref in zip(got, want, strict=True):
            assert_same_bits(words, ref)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "make_key",
    [lambda: jax.random.key(11), lambda: jax.random.key(11, impl="rbg"), jax.random.PRNGKey],
    ids=["threefry", "rbg", "raw"],
)
def test_fold_in_is_jax_random_fold_in(make_key, implementation):
    # The layers' key of the step (`fold_in`; with "ffi" on the CPU by the native hash) is
    # `jax.random.fold_in` bit for bit: eagerly, under jit, under vmap, data up to 2**32 - 1.
    key = make_key(11) if make_key is jax.random.PRNGKey else make_key()
    data = np.array([0, 1, 7, 2**31, 2**32 - 1], np.uint32)

    def ours(k, d):
        return jax.random.key_data(fold_in(k, d, implementation))

    def want(k, d):
        return jax.random.key_data(jax.random.fold_in(k, d))

    for d in data:
        assert_same_bits(ours(key, d), want(key, d))
        assert_same_bits(jax.jit(ours)(key, d), want(key, d))
    batched = jax.vmap(ours, in_axes=(None, 0))(key, jnp.asarray(data))
    assert_same_bits(batched, jax.vmap(want, in_axes=(None, 0))(key, jnp.asarray(data)))


@pytest.mark.skipif("ffi" not in IMPLEMENTATIONS, reason="the native CPU library is not built")
def test_native_sr_keys_leave_no_threefry_loop_in_the_program():
    # What the native hash is for: the backward's SR keys (and a layer's fold_in) compile as
    # custom calls, not as XLA's rolled threefry loops; the reference keeps JAX's hash.
    x, w = jnp.ones((32, 32)), jnp.ones((32, 16))

    def grad_text(implementation):
        recipe = NVFP4Recipe(implementation=implementation)

        def f(x, w, key):
            key = fold_in(key, jnp.uint32(3), implementation)
            return jnp.sum(dot_general(x, w, DENSE, recipe=recipe, key=key))

        lowered = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w, jax.random.key(0))
        return lowered.as_text()

    native, reference = grad_text("ffi"), grad_text("reference")
    assert native.count("nvfp4_threefry2x32") == 3  # fold_in, split, bits
    assert "threefry2x32" not in native.replace("nvfp4_threefry2x32", "")
    assert "nvfp4_threefry2x32" not in reference and "threefry2x32" in reference
    # With key=None (a drop-in dot_general): the key derived from dy's bits, likewise.
    recipe = NVFP4Recipe(implementation="ffi")
    no_key = jax.jit(jax.grad(lambda x, w: jnp.sum(dot_general(x, w, DENSE, recipe=recipe))))
    text = no_key.lower(x, w).as_text()
    assert text.count("nvfp4_threefry2x32") == 3  # the gradient key's fold_in, split, bits
    assert "threefry2x32" not in text.replace("nvfp4_threefry2x32", "")
