"""NVFP4Array as a pytree, and quantize under jit, vmap, scan and tree utilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax
from nvfp4_jax import quantize


def _data(shape, seed=0, dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.key(seed))
    rows = jax.random.normal(k2, shape[:-1] + (1,))
    return (jax.random.normal(k1, shape) * jnp.exp(rows)).astype(dtype)


def _assert_same_bits(a, b):
    for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(
            np.atleast_1d(np.asarray(leaf_a)).view(np.uint8),
            np.atleast_1d(np.asarray(leaf_b)).view(np.uint8),
        )


@pytest.mark.parametrize("axis", [-1, 0, 1], ids=lambda a: f"axis{a}")
def test_logical_shape_and_layout(axis):
    x = _data((32, 48, 64))
    q = quantize(x, axis=axis, implementation="reference")
    stored = np.moveaxis(np.zeros(x.shape), axis, -1).shape
    assert q.shape == x.shape
    assert q.codes.shape == stored[:-1] + (stored[-1] // 2,)
    assert q.scales.shape == stored[:-1] + (stored[-1] // 16,)
    assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.float8_e4m3fn
    assert q.amax.shape == () and q.amax.dtype == jnp.float32
    assert q.dequantize().shape == x.shape
    assert q.size == x.size and q.ndim == x.ndim


def test_axis_matches_transposed_quantization():
    x = _data((48, 64))
    by_axis = quantize(x, axis=0, implementation="reference")
    transposed = quantize(x.T, implementation="reference")
    _assert_same_bits((by_axis.codes, by_axis.scales), (transposed.codes, transposed.scales))
    np.testing.assert_array_equal(by_axis.dequantize(), transposed.dequantize().T)


def test_pytree_roundtrip_keeps_metadata():
    q = quantize(_data((16, 32)), axis=0, block_2d=True, rht=True, implementation="reference")
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 3
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert (rebuilt.axis, rebuilt.block_2d, rebuilt.rht, rebuilt.dtype) == (-2, True, True, q.dtype)
    assert nvfp4_jax.is_nvfp4_array(rebuilt) and not nvfp4_jax.is_nvfp4_array(leaves[0])
    assert "shape=(16, 32)" in repr(q)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"block_2d": True}, {"rht": True}, {"stochastic_rounding": True}],
    ids=["rn", "2d", "rht", "sr"],
)
def test_jit_matches_eager(kwargs):
    x, key = _data((32, 64)), jax.random.key(3)
    eager = quantize(x, key=key, implementation="reference", **kwargs)
    jitted = jax.jit(lambda x, k: quantize(x, key=k, implementation="reference", **kwargs))(x, key)
    _assert_same_bits(eager, jitted)
    np.testing.assert_array_equal(eager.dequantize(), jax.jit(lambda q: q.dequantize())(jitted))


def test_vmap_quantizes_each_slice_separately():
    x = _data((3, 32, 64))
    batched = jax.vmap(lambda v: quantize(v, axis=0, implementation="reference"))(x)
    assert batched.codes.shape == (3, 64, 16) and batched.amax.shape == (3,)
    for i in range(3):
        single = quantize(x[i], axis=0, implementation="reference")
        _assert_same_bits(
            (single.codes, single.scales, single.amax),
            (batched.codes[i], batched.scales[i], batched.amax[i]),
        )
    # Both inside vmap and on the batched result, dequantize knows the logical layout.
    inside = jax.vmap(lambda q: q.dequantize())(batched)
    outside = batched.dequantize()
    assert inside.shape == outside.shape == x.shape
    np.testing.assert_array_equal(inside, outside)


def test_scan_carries_quantized_tensors():
    xs = _data((4, 16, 32))

    def body(carry, x):
        q = quantize(x, stochastic_rounding=True, key=carry, implementation="reference")
        return jax.random.fold_in(carry, 1), q

    _, stacked = jax.lax.scan(body, jax.random.key(0), xs)
    key = jax.random.key(0)
    for i in range(xs.shape[0]):
        single = quantize(xs[i], stochastic_rounding=True, key=key, implementation="reference")
        np.testing.assert_array_equal(stacked.codes[i], single.codes)
        key = jax.random.fold_in(key, 1)


@pytest.mark.parametrize(
    "kwargs", [{}, {"block_2d": True, "rht": True, "stochastic_rounding": True}], ids=["rn", "all"]
)
def test_reference_is_one_program_without_block_loops(kwargs):
    """The jaxpr does not grow with the tensor: no Python loop over blocks or rows."""

    def count(shape):
        fn = lambda x, k: quantize(x, key=k, implementation="reference", **kwargs)  # noqa: E731
        jaxpr = jax.make_jaxpr(fn)(jnp.zeros(shape, jnp.bfloat16), jax.random.key(0))
        return len(jaxpr.eqns)

    assert count((16, 16)) == count((256, 1024))
