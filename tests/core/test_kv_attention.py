"""Decode attention over the NVFP4 KV cache (`nvfp4_jax.kv_cache.attention`).

The native CPU kernel's results are, bit for bit, the NumPy model of its order
(`kv_cache_oracle.attention`: docs/NUMERICS.md section 15), on every ISA; the reference
(the cache dequantized, then XLA's dots) agrees with both within f32 summation error.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import kv_cache_oracle as oracle
import numpy as np
import pytest
from helpers import make_impl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax import kernels
from nvfp4_jax import kv_cache as kc


def _native_cpu() -> None:
    """Skips unless the native CPU kernels run here (the KV cache has no CUDA kernels)."""
    make_impl("cpu")
    if kernels.current_platform() != "cpu":
        pytest.skip("the native KV cache kernels run on the CPU only")


@pytest.fixture(params=["reference", "cpu"])
def impl(request):
    """The reference and the native CPU kernels (the KV cache has no CUDA kernels)."""
    chosen = make_impl(request.param)
    if chosen.implementation == "ffi" and kernels.current_platform() != "cpu":
        pytest.skip("the native KV cache kernels run on the CPU only")
    return chosen


SHAPES = {
    # name: (q heads, kv heads, head dim, new tokens T, lengths, capacity)
    "gqa_decode": (8, 4, 128, 1, (300, 7), 320),
    "mqa_decode": (4, 1, 64, 1, (513, 0), 520),
    "mha_t3": (2, 2, 64, 3, (40, 2), 48),
    "gqa_long": (4, 2, 64, 1, (1000, 999), 1024),
}


def _setup(name: str, seed: int = 0, dtype=jnp.bfloat16):
    h, g, e, t, lengths, capacity = SHAPES[name]
    config = kc.KVCacheConfig(kv_heads=g, head_dim=e, page_size=16)
    b = len(lengths)
    cache = kc.init_cache(config, b, capacity, k_scale=0.02, v_scale=0.05)
    keys = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(keys[0], (b, capacity, g, e), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[1], (b, capacity, g, e), jnp.float32).astype(dtype)
    cache = kc.append(cache, k, v, 0)
    q = (2 * jax.random.normal(keys[2], (b, t, h, e), jnp.float32)).astype(dtype)
    return q, cache, jnp.asarray(lengths, jnp.int32)


def _model(q, cache, lengths, scale=None):
    k, v = kc.read(cache, implementation="reference")
    e = q.shape[-1]
    softmax_scale = np.float32(1 / np.sqrt(e)) if scale is None else np.float32(scale)
    return oracle.attention(
        np.asarray(q, np.float32), np.asarray(k), np.asarray(v), np.asarray(lengths), softmax_scale
    )


@pytest.mark.parametrize("name", list(SHAPES))
def test_native_is_the_model_of_its_order_bit_for_bit(name):
    """The native kernel computes section 15's order: the model's bits, GQA/MQA/MHA, T > 1,
    lengths across chunks, a sequence that sees nothing."""
    _native_cpu()
    q, cache, lengths = _setup(name)
    got = kc.attention(q.astype(jnp.float32), cache, lengths, implementation="ffi")
    np.testing.assert_array_equal(np.asarray(got), _model(q, cache, lengths))


def test_every_isa_gives_the_same_bits(cpu_isa):
    del cpu_isa
    _native_cpu()
    q, cache, lengths = _setup("gqa_decode", seed=1)
    got = kc.attention(q.astype(jnp.float32), cache, lengths, implementation="ffi")
    np.testing.assert_array_equal(np.asarray(got), _model(q, cache, lengths))


@pytest.mark.parametrize("name", list(SHAPES))
def test_reference_and_native_agree(impl, name):
    """Both implementations: the model's numbers within f32 summation error, in q's dtype."""
    q, cache, lengths = _setup(name, seed=2)
    got = kc.attention(q, cache, lengths, implementation=impl.implementation)
    assert got.dtype == q.dtype and got.shape == q.shape
    want = _model(q, cache, lengths)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
    got32 = kc.attention(q.astype(jnp.float32), cache, lengths, implementation=impl.implementation)
    np.testing.assert_allclose(np.asarray(got32), want, rtol=2e-5, atol=2e-6)


def test_masked_slots_are_ignored_whatever_they_hold(impl):
    """Slots past the lengths (here NaN blocks) change nothing."""
    q, cache, lengths = _setup("gqa_decode", seed=3)
    g, e = cache.config.kv_heads, cache.config.head_dim
    poison = jnp.full((2, 4, g, e), jnp.nan, jnp.bfloat16)
    poisoned = kc.append(cache, poison, poison, lengths, implementation=impl.implementation)
    a = kc.attention(q, cache, lengths, implementation=impl.implementation)
    b = kc.attention(q, poisoned, lengths, implementation=impl.implementation)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.isnan(np.asarray(b, np.float32)).any()


def test_attention_is_softmax_attention_of_the_read_cache(impl):
    """Against jax.nn.dot_product_attention over the dequantized cache (f32)."""
    q, cache, lengths = _setup("mha_t3", seed=4)
    k, v = kc.read(cache)
    q32 = q.astype(jnp.float32)
    t = q.shape[1]
    for b in range(2):
        n = int(lengths[b])
        mask = jnp.arange(k.shape[1])[None, :] < (n - t + 1 + jnp.arange(t))[:, None]
        want = jax.nn.dot_product_attention(
            q32[b : b + 1], k[b : b + 1], v[b : b + 1], mask=mask[None, None]
        )
        got = kc.attention(q32, cache, lengths, implementation=impl.implementation)[b : b + 1]
        seen = np.asarray(mask.any(-1))
        np.testing.assert_allclose(
            np.asarray(got)[0][seen], np.asarray(want)[0][seen], rtol=1e-5, atol=1e-6
        )


def test_jit_vmap_and_custom_call(impl):
    """Under jit and vmap (over stacked layers) the loop's results; the native program holds
    the custom call."""
    q, cache, lengths = _setup("mqa_decode", seed=5)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), cache)
    fn = jax.jit(
        jax.vmap(lambda c: kc.attention(q, c, lengths, implementation=impl.implementation))
    )
    got = fn(stacked)
    want = kc.attention(q, cache, lengths, implementation=impl.implementation)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want))
    text = jax.jit(lambda c: kc.attention(q, c, lengths, implementation=impl.implementation))
    present = "nvfp4_kv_attention" in text.lower(cache).as_text()
    assert present == (impl.implementation == "ffi")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_sequences_sharded_give_the_unsharded_result(impl, mode):
    q, cache, lengths = _setup("mha_t3", seed=6)
    cache = jax.tree.map(lambda a: jnp.concatenate([a, a]) if a.ndim else a, cache)
    q, lengths = jnp.concatenate([q, q]), jnp.concatenate([lengths, lengths])
    kind = jax.sharding.AxisType.Auto if mode == "auto" else jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    name = impl.implementation
    want = jax.jit(lambda q, c, n: kc.attention(q, c, n, implementation=name))(q, cache, lengths)

    def put(a):
        return jax.device_put(a, NamedSharding(mesh, P("data") if a.ndim else P()))

    with jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext():
        fn = jax.jit(lambda q, c, n: kc.attention(q, c, n, implementation=name))
        got = fn(put(q), jax.tree.map(put, cache), put(lengths))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_lengths_and_scale_are_named():
    q, cache, _ = _setup("mha_t3")
    with pytest.raises(ValueError, match=r"lengths must be a scalar or \(2,\)"):
        kc.attention(q, cache, jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="lengths must be integers"):
        kc.attention(q, cache, 1.5)
    with pytest.raises(TypeError, match="scale must be a float"):
        kc.attention(q, cache, 1, scale="x")
