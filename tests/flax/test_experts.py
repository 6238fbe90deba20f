"""The mixture-of-experts layers: `nvfp4_jax.nnx.Experts` and `nvfp4_jax.linen.Experts`.

Each is checked against the op it wraps (`nvfp4_jax.ragged_dot` for tokens sorted by expert,
the batched `nvfp4_jax.dot_general` for tokens dispatched per expert), bit for bit, on the
reference and the CPU kernels; `recipe=None` against `jax.lax.ragged_dot` / `jnp.einsum`;
calibration against each expert's max |x|; the linen twin against the nnx layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import assert_same_bits

import nvfp4_jax
from nvfp4_jax._src.training.ragged.groups import group_amax

G, K, N = 4, 64, 32
SIZES = np.array([5, 0, 27, 12], np.int32)  # 44 of 48 rows: the last 4 belong to no expert
M = 48
BATCHED = (((2,), (1,)), ((0,), (0,)))


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)) * rng.lognormal(0, 1, (M, 1))
    return jnp.asarray(x, jnp.float32), jnp.asarray(SIZES)


def round_to_nearest(impl) -> nvfp4_jax.NVFP4Recipe:
    return nvfp4_jax.NVFP4Recipe(stochastic_rounding=False, implementation=impl.implementation)


@pytest.mark.slow
def test_nnx_experts_is_ragged_dot_per_expert(impl):
    recipe = round_to_nearest(impl)
    layer = nvfp4_jax.nnx.Experts(G, K, N, recipe=recipe, rngs=nnx.Rngs(0))
    x, sizes = data()

    def loss(layer, x):
        return jnp.sum(layer(x, sizes) ** 2)

    def loss_op(w, x):
        return jnp.sum(nvfp4_jax.ragged_dot(x, w, sizes, recipe=recipe) ** 2)

    y = layer(x, sizes)
    assert_same_bits(y, nvfp4_jax.ragged_dot(x, layer.kernel[...], sizes, recipe=recipe), "y")
    np.testing.assert_array_equal(np.asarray(y[int(SIZES.sum()) :]), 0)
    grads, dx = nnx.grad(loss, argnums=(0, 1))(layer, x)
    dw_op, dx_op = jax.grad(loss_op, argnums=(0, 1))(layer.kernel[...], x)
    assert_same_bits(grads.kernel[...], dw_op, "dW")
    assert_same_bits(dx, dx_op, "dx")


def test_nnx_experts_dispatched_tokens_are_the_batched_dot_general(impl):
    recipe = round_to_nearest(impl)
    layer = nvfp4_jax.nnx.Experts(G, K, N, recipe=recipe, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (G, 16, K))
    want = nvfp4_jax.dot_general(x, layer.kernel[...], BATCHED, recipe=recipe)
    assert_same_bits(layer(x), want, "y")


def test_stochastic_rounding_draws_a_fresh_key_per_call():
    layer = nvfp4_jax.nnx.Experts(G, K, N, rngs=nnx.Rngs(0, quantize=5))
    x, sizes = data()

    def dx(layer):
        return nnx.grad(lambda layer, x: jnp.sum(layer(x, sizes) ** 2), argnums=1)(layer, x)

    first, second = dx(layer), dx(layer)
    assert not np.array_equal(np.asarray(first), np.asarray(second))  # SR of dy, new keys


def test_no_recipe_is_high_precision():
    layer = nvfp4_jax.nnx.Experts(G, K, N, recipe=None, rngs=nnx.Rngs(0))
    x, sizes = data()
    want = jax.lax.ragged_dot(x, layer.kernel[...], sizes)
    assert_same_bits(layer(x, sizes), want, "ragged")
    xb = jax.random.normal(jax.random.key(1), (G, 16, K))
    assert_same_bits(layer(xb), jnp.einsum("gck,gkn->gcn", xb, layer.kernel[...]), "batched")


def test_set_recipe_switches_precision_and_keeps_the_kernel():
    layer = nvfp4_jax.nnx.Experts(G, K, N, recipe=None, rngs=nnx.Rngs(0))
    kernel = np.asarray(layer.kernel[...])
    x, sizes = data()
    layer.set_recipe(nvfp4_jax.NVFP4Recipe(), nnx.Rngs(quantize=3))
    assert layer.quantize_rngs is not None
    y = layer(x, sizes)
    assert_same_bits(layer.kernel[...], kernel, "kernel")
    assert not np.array_equal(np.asarray(y), np.asarray(jax.lax.ragged_dot(x, kernel, sizes)))
    with pytest.raises(ValueError, match="needs rngs"):
        nvfp4_jax.nnx.Experts(G, K, N, recipe=None, rngs=nnx.Rngs(0)).set_recipe(
            nvfp4_jax.NVFP4Recipe()
        )


@pytest.mark.slow
def test_calibration_records_each_experts_max():
    layer = nvfp4_jax.nnx.Experts(G, K, N, rngs=nnx.Rngs(0, quantize=1))
    x, sizes = data()
    assert nvfp4_jax.nnx.calibrate(layer) == 1
    layer(x, sizes)
    layer(0.5 * x, sizes)  # smaller: the running max keeps the first
    starts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    want = [
        np.abs(np.asarray(x)[s : s + n]).max() if n else 0.0
        for s, n in zip(starts, SIZES, strict=True)
    ]
    np.testing.assert_array_equal(np.asarray(layer.input_amax[...]), np.float32(want))
    nvfp4_jax.nnx.calibrate(layer, False)
    layer(4 * x, sizes)
    np.testing.assert_array_equal(np.asarray(layer.input_amax[...]), np.float32(want))


def test_bad_shapes_are_named():
    layer = nvfp4_jax.nnx.Experts(G, K, N, rngs=nnx.Rngs(0))
    match = r"without group_sizes, inputs must be \(4, capacity, 64\)"
    with pytest.raises(ValueError, match=match):
        layer(jnp.ones((M, K)))
    with pytest.raises(ValueError, match=r"with group_sizes, inputs must be \(tokens, 64\)"):
        layer(jnp.ones((M, K + 16)), jnp.asarray(SIZES))
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        nvfp4_jax.nnx.Experts(0, K, N, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="recipe must be an NVFP4Recipe or None"):
        nvfp4_jax.nnx.Experts(G, K, N, recipe="nvfp4", rngs=nnx.Rngs(0))


def test_linen_experts_equal_the_nnx_layer(impl):
    recipe = round_to_nearest(impl)
    nnx_layer = nvfp4_jax.nnx.Experts(G, K, N, recipe=recipe, rngs=nnx.Rngs(0))
    linen_layer = nvfp4_jax.linen.Experts(num_experts=G, features=N, recipe=recipe)
    x, sizes = data()
    params = {"params": {"kernel": nnx_layer.kernel[...]}}
    assert_same_bits(linen_layer.apply(params, x, sizes), nnx_layer(x, sizes), "ragged")
    xb = jax.random.normal(jax.random.key(1), (G, 16, K))
    assert_same_bits(linen_layer.apply(params, xb), nnx_layer(xb), "batched")
    shapes = jax.eval_shape(linen_layer.init, jax.random.key(0), x, sizes)
    assert shapes["params"]["kernel"].shape == (G, K, N)


def test_linen_experts_calibrate_and_high_precision():
    layer = nvfp4_jax.linen.Experts(num_experts=G, features=N, calibrate=True)
    x, sizes = data()
    variables = layer.init(jax.random.key(0), x, sizes)
    _, state = layer.apply(variables, x, sizes, mutable=["calibration"])
    want = group_amax(x, sizes, G)
    assert_same_bits(state["calibration"]["input_amax"], want, "input_amax")
    high = nvfp4_jax.linen.Experts(num_experts=G, features=N, recipe=None)
    kernel = variables["params"]["kernel"]
    assert_same_bits(
        high.apply({"params": {"kernel": kernel}}, x, sizes),
        jax.lax.ragged_dot(x, kernel, sizes),
        "high precision",
    )
    assert isinstance(layer, nn.Module)
