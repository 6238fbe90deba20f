"""Quantize and dequantize under JAX's transformations, on every implementation (the `impl`
fixture): under `jit`, `vmap` (over slices and over keys) and `lax.scan`, the same bits as
the eager calls, slice by slice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_same_bits,
    assert_same_q,
    heavy_tailed,
)

import nvfp4_jax

# ----------------------------------------------------------------------------- transforms


TRANSFORM_KW = {
    "1d": dict(),
    "ax0": dict(axis=0),
    "2d": dict(block_2d=True),
    "rht": dict(rht=True),
    "sr": dict(stochastic_rounding=True, key=jax.random.key(3)),
}


def eager_quantize(impl, x, **kw):
    return nvfp4_jax.quantize(x, implementation=impl.implementation, **kw)


def eager_dequantize(impl, q):
    return nvfp4_jax.dequantize(q, implementation=impl.implementation)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["1d", "2d", "rht", "sr"])
def test_jit_matches_eager(impl, mode):
    x = jax.device_put(jnp.asarray(heavy_tailed((32, 64), "bf16", seed=31)), impl.device)
    kw = TRANSFORM_KW[mode]
    eager = eager_quantize(impl, x, **kw)
    jitted = impl.quantize(x, **kw)
    assert_same_q(jitted, eager)
    deq_eager = np.asarray(eager_dequantize(impl, eager))
    assert_same_bits(np.asarray(impl.dequantize(jitted)), deq_eager, "dequantized")
    round_trip = jax.jit(lambda v: eager_dequantize(impl, eager_quantize(impl, v, **kw)))(x)
    assert_same_bits(np.asarray(round_trip), deq_eager, "jit round trip")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["1d", "ax0", "2d", "rht"])
def test_vmap_matches_per_slice(impl, mode):
    xs = jax.device_put(jnp.asarray(heavy_tailed((3, 32, 64), "f32", seed=33)), impl.device)
    kw = TRANSFORM_KW[mode]
    batched = jax.jit(jax.vmap(functools.partial(eager_quantize, impl, **kw)))(xs)
    deq = np.asarray(jax.jit(jax.vmap(functools.partial(eager_dequantize, impl)))(batched))
    # Dequantizing the whole batch outside of vmap gives the same values.
    assert_same_bits(np.asarray(jax.jit(functools.partial(eager_dequantize, impl))(batched)), deq)
    for i in range(xs.shape[0]):
        single = impl.quantize(xs[i], **kw)
        assert_same_q(jax.tree.map(lambda a, i=i: a[i], batched), single, f"slice {i}")
        assert_same_bits(deq[i], np.asarray(impl.dequantize(single)), "dequantized")


def test_vmap_over_keys_matches_per_key(impl):
    x = jax.device_put(jnp.asarray(heavy_tailed((32, 64), "f32", seed=35)), impl.device)
    keys = jax.random.split(jax.random.key(0), 3)
    quantize_each = jax.vmap(lambda k: eager_quantize(impl, x, stochastic_rounding=True, key=k))
    batched = jax.jit(quantize_each)(keys)
    for i in range(3):
        single = impl.quantize(x, stochastic_rounding=True, key=keys[i])
        assert_same_bits(batched.codes[i], single.codes, f"key {i}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["1d", "2d", "rht", "sr"])
def test_scan_matches_per_slice(impl, mode):
    xs = jax.device_put(jnp.asarray(heavy_tailed((4, 32, 64), "bf16", seed=37)), impl.device)
    kw = TRANSFORM_KW[mode]

    def body(carry, x):
        q = eager_quantize(impl, x, **kw)
        return carry, (q, eager_dequantize(impl, q))

    _, (qs, deqs) = jax.lax.scan(body, 0, xs)
    for i in range(xs.shape[0]):
        single = impl.quantize(xs[i], **kw)
        assert_same_q(jax.tree.map(lambda a, i=i: a[i], qs), single, f"slice {i}")
        assert_same_bits(np.asarray(deqs[i]), np.asarray(impl.dequantize(single)), "dequantized")
