"""`NVFP4Recipe(backward="ms_eden")`: Quartet II's backward in every path a recipe goes.

Shape letters: x (M, K), W (K, N), dy (M, N). The forward is the NVIDIA recipe's, bit for
bit; dgrad and wgrad multiply dy and the forward's quantized W and x, each re-quantized
with MS-EDEN along the contraction axis (docs/NUMERICS.md section 14). The GEMMs sum in f32
in an order of their own (XLA's or the native kernel's), so products are compared within
the f32 summation budget `(C + 2) * 2**-24 * sum |a b|` of a contraction of C terms.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import DENSE, assert_same_bits

import nvfp4_jax
from nvfp4_jax import NVFP4Array, NVFP4Recipe, QuantSpec, dot_general, kernels, ragged_dot
from nvfp4_jax._src.core.sr_keys import gradient_key, ms_eden_randomness
from nvfp4_jax._src.training import dot_general as dot_general_module

IMPLEMENTATIONS = ["reference"] + (["ffi"] if kernels.is_available("cpu") else [])
KEY = jax.random.key(7)
EDEN = NVFP4Recipe(backward="ms_eden")


def data(m=64, k=128, n=96, seed=0):
    """x, W in bf16 and dy in f32; N not a multiple of 128 (the backward pads it)."""
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n), jnp.float32)
    return x, w, dy


def vjp(recipe, x, w, dy, key=KEY):
    """(y, dx, dW) of `dot_general` under `recipe`, jitted, f32 result."""

    @jax.jit
    def run(x, w, dy, key):
        def f(a, b):
            return dot_general(
                a, b, DENSE, preferred_element_type=jnp.float32, recipe=recipe, key=key
            )

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    return run(x, w, dy, key)


def assert_within_sum_budget(got, want, terms, magnitude, what):
    budget = (terms + 2) * 2.0**-24 * np.asarray(magnitude, np.float64)
    error = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(error <= budget + 1e-30), f"{what}: max excess {np.max(error - budget)}"


# --- the recipe field ---------------------------------------------------------------------------


def test_the_field_is_checked_and_names_what_is_wrong():
    assert NVFP4Recipe().backward == "nvidia" and EDEN.random_backward
    assert not NVFP4Recipe(stochastic_rounding=False).random_backward
    with pytest.raises(ValueError, match="NVFP4Recipe.backward must be one of"):
        NVFP4Recipe(backward="quartet")
    with pytest.raises(ValueError, match="gradient_four_over_six='mse'"):
        NVFP4Recipe(backward="ms_eden", gradient_four_over_six="mse")
    # 4/6 on W and x stays (the forward is the NVIDIA recipe's).
    assert NVFP4Recipe(backward="ms_eden", weight_four_over_six="mae").weight_four_over_six


def test_the_backward_operands_specs_are_ms_eden():
    for operand, gemm, axis in (
        ("gradient", "dgrad", -1), ("weight", "dgrad", 1),
        ("activation", "wgrad", 0), ("gradient", "wgrad", -1),
    ):  # fmt: skip
        assert EDEN.spec(operand, gemm) == QuantSpec(axis=axis, ms_eden=True)
    assert EDEN.spec("weight", "fprop") == NVFP4Recipe().spec("weight", "fprop")


# --- dot_general --------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_is_the_nvidia_recipes_and_the_backward_is_ms_eden(implementation):
    x, w, dy = data()
    recipe = dataclasses.replace(EDEN, implementation=implementation)
    nvidia = dataclasses.replace(recipe, backward="nvidia")
    y, dx, dw = vjp(recipe, x, w, dy)
    assert_same_bits(y, vjp(nvidia, x, w, dy)[0], "y")
    # By hand, from the public ops: the forward's quantized operands as block values (times
    # their decode factor), MS-EDEN'd along the contraction axis padded to 128 with the
    # randomness `keys.ms_eden_randomness` gives dgrad and wgrad, multiplied in f32.
    qw = nvfp4_jax.quantize(w, axis=0, block_2d=True, implementation=implementation)
    qx = nvfp4_jax.quantize(x, implementation=implementation)
    block_values = nvfp4_jax.ops.block_values
    w_kn = block_values(qw, jnp.float32, implementation=implementation).T  # (K, N)
    x_km = block_values(qx, jnp.float32, implementation=implementation).T  # (K, M)
    dgrad, wgrad = ms_eden_randomness(KEY, implementation)

    def eden(v, seed, rotation):
        v = jnp.pad(v, ((0, 0), (0, -v.shape[1] % 128)))
        return nvfp4_jax.fake_quantize(
            v, ms_eden=True, key=seed, rotation_key=rotation, implementation=implementation,
            dtype=jnp.float32,
        )  # fmt: skip

    a = eden(dy, dgrad.gradient, dgrad.rotation)
    b = eden(w_kn, dgrad.other, dgrad.rotation) * qw.global_scale
    want_dx = a @ b.T
    a = eden(x_km, wgrad.other, wgrad.rotation) * qx.global_scale
    b = eden(dy.T, wgrad.gradient, wgrad.rotation)
    want_dw = a @ b.T
    # The same operand bits; the products differ by the rounding of the decode factors'
    # products and the order of the f32 sums, then by one rounding to bf16 (x's and W's).
    for got, want in ((dx, want_dx), (dw, want_dw)):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=2.0**-8, atol=1e-5 * scale
        )


def test_reference_and_native_kernels_agree():
    if len(IMPLEMENTATIONS) < 2:
        pytest.skip("native CPU kernels unavailable")
    x, w, dy = data(seed=1)
    got = {i: vjp(dataclasses.replace(EDEN, implementation=i), x, w, dy) for i in IMPLEMENTATIONS}
    for name, ref, native, terms in zip(
        ("y", "dx", "dW"), got["reference"], got["ffi"], (128, 128, 64), strict=True
    ):
        # The operands are the same bits; the native GEMM sums in its own order.
        assert_within_sum_budget(native, ref, terms, 16 * np.abs(np.asarray(ref)) + 64, name)


def test_without_a_key_the_gradient_gives_it():
    x, w, dy = data(seed=2)
    got = vjp(EDEN, x, w, dy, key=None)
    want = vjp(EDEN, x, w, dy, key=gradient_key(dy.astype(jnp.float32)))
    for g, o in zip(got, want, strict=True):
        assert_same_bits(g, o)


def test_randomness_is_jax_randoms_bit_for_bit():
    for implementation in IMPLEMENTATIONS:
        dgrad, wgrad = ms_eden_randomness(KEY, implementation)
        for got, gemm_key in zip((dgrad, wgrad), jax.random.split(KEY), strict=True):
            k = jax.random.wrap_key_data(jax.random.bits(gemm_key, (2,), jnp.uint32))
            assert_same_bits(got.rotation, jax.random.bits(k, (4,), jnp.uint32), "rotation")
            keys = jax.random.split(k)
            for seed, child in zip((got.gradient, got.other), keys, strict=True):
                assert_same_bits(seed.key_words, jax.random.bits(child, (2,), jnp.uint32))


def test_each_step_draws_fresh_randomness_and_means_converge():
    x, w, dy = data(m=128, seed=3)
    grads = jax.jit(jax.vmap(lambda k: vjp(EDEN, x, w, dy, k)[1:]))(
        jax.random.split(jax.random.key(11), 256)
    )
    assert not np.array_equal(np.asarray(grads[0][0]), np.asarray(grads[0][1]))
    qw = nvfp4_jax.quantize(w, axis=0, block_2d=True).dequantize()
    qx = nvfp4_jax.quantize(x).dequantize()
    for g, exact in zip(grads, (dy @ qw.T, qx.T @ dy), strict=True):
        # Unbiased: 256 draws err about 16 times less than one (tests/core/
        # test_ms_eden_statistics.py derives it); 8 times is a loose bound.
        one = jnp.linalg.norm(g[0] - exact)
        mean = jnp.linalg.norm(jnp.mean(g, axis=0) - exact)
        assert mean < one / 8, (float(one), float(mean))


@pytest.mark.parametrize("off", ["fprop", "dgrad", "wgrad"])
def test_precision_switches(off):
    x, w, dy = data(seed=4)
    recipe = dataclasses.replace(EDEN, **{off: False})
    got = vjp(recipe, x, w, dy)
    high = vjp(NVFP4Recipe(fprop=False, dgrad=False, wgrad=False), x, w, dy)
    eden = vjp(EDEN, x, w, dy)
    index = {"fprop": 0, "dgrad": 1, "wgrad": 2}[off]
    for i, (g, h, e) in enumerate(zip(got, high, eden, strict=True)):
        assert_same_bits(g, h if i == index else e, f"{off} off: output {i}")


def test_the_runtime_finish_flag_is_the_high_precision_forward():
    x, w, dy = data(seed=5)

    @jax.jit
    def run(flag):
        def f(a, b):
            with nvfp4_jax.high_precision_forward(flag):
                return dot_general(
                    a, b, DENSE, preferred_element_type=jnp.float32, recipe=EDEN, key=KEY
                )

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    for flag, recipe in ((True, dataclasses.replace(EDEN, fprop=False)), (False, EDEN)):
        for g, o in zip(run(flag), vjp(recipe, x, w, dy), strict=True):
            assert_same_bits(g, o, f"flag {flag}")


def test_residuals_are_no_larger_than_the_sr_recipes():
    x, w, _ = data(m=256, k=256, n=128, seed=6)

    def residual_bytes(recipe):
        _, residuals = dot_general_module._nvfp4_matmul_fwd(
            x, w, KEY, None, dataclasses.replace(recipe, gemm_backend="emulated"), jnp.bfloat16
        )
        w_res, x_res = residuals[:2]
        assert isinstance(w_res, NVFP4Array) and isinstance(x_res, NVFP4Array)
        return sum(leaf.nbytes for leaf in jax.tree.leaves(residuals[:2]))

    assert residual_bytes(EDEN) <= residual_bytes(NVFP4Recipe())


def test_batched_elements_are_their_own_gemms():
    b = 2
    x, w, dy = data(m=32, seed=8)
    xs, ws, dys = (jnp.stack([v, v[::-1]]) for v in (x, w, dy))
    dims = (((2,), (1,)), ((0,), (0,)))

    def f(a, c):
        return dot_general(a, c, dims, preferred_element_type=jnp.float32, recipe=EDEN, key=KEY)

    y, pullback = jax.vjp(f, xs, ws)
    got = (y, *pullback(dys))
    for i in range(b):
        one = vjp(EDEN, xs[i], ws[i], dys[i], jax.random.fold_in(KEY, i))
        for name, g, o in zip(("y", "dx", "dW"), got, one, strict=True):
            np.testing.assert_allclose(g[i], o, rtol=2**-12, atol=1e-4, err_msg=name)


# --- layers, rules and the grouped GEMM ---------------------------------------------------------


def test_nnx_layer_draws_its_keys_from_its_stream_and_trains():
    layer = nvfp4_jax.nnx.Linear(128, 96, recipe=EDEN, rngs=nnx.Rngs(params=0, quantize=1))
    assert layer.quantize_rngs is not None  # MS-EDEN needs a key though SR does not apply
    x = jnp.ones((16, 128), jnp.bfloat16) * jnp.linspace(-1, 1, 128, dtype=jnp.bfloat16)

    def grad(layer):
        return nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(layer).kernel[...]

    first, second = grad(layer), grad(layer)
    assert np.all(np.isfinite(first)) and not np.array_equal(first, second)


def test_quantize_model_rules_carry_the_field():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(128, 128, rngs=rngs)
            self.b = nnx.Linear(128, 32, rngs=rngs)

    net = Net(nnx.Rngs(0))
    rules = [nvfp4_jax.Rule("^a$", EDEN), nvfp4_jax.Rule(".*", None)]
    nvfp4_jax.quantize_model(net, rules, rngs=nnx.Rngs(quantize=2))
    assert net.a.recipe.backward == "ms_eden" and not isinstance(net.b, nvfp4_jax.nnx.Linear)
    g = nnx.grad(lambda m: jnp.sum(m.b(m.a(jnp.ones((16, 128)))) ** 2))(net)
    assert np.all(np.isfinite(g.a.kernel[...]))


def test_linen_dense_with_the_field():
    dense = nvfp4_jax.linen.Dense(96, recipe=EDEN)
    x = jnp.ones((16, 128))
    params = dense.init({"params": jax.random.key(0)}, x)
    loss = lambda p, k: jnp.sum(dense.apply(p, x, rngs={"quantize": k}) ** 2)  # noqa: E731
    g1 = jax.grad(loss)(params, jax.random.key(1))
    g2 = jax.grad(loss)(params, jax.random.key(2))
    k1, k2 = (jax.tree.leaves(g)[-1] for g in (g1, g2))
    assert np.all(np.isfinite(k1)) and not np.array_equal(k1, k2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_ragged_dot_groups_are_their_own_layers(implementation):
    m, k, n, g = 96, 64, 48, 3
    x, _, dy = data(m=m, k=k, n=n, seed=9)
    w = jax.random.normal(jax.random.key(10), (g, k, n), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.array([30, 0, 50], jnp.int32)  # the last 16 rows belong to no group
    recipe = dataclasses.replace(EDEN, implementation=implementation)

    @jax.jit
    def grads(key):
        f = lambda a, b: ragged_dot(a, b, sizes, None, jnp.float32, recipe=recipe, key=key)  # noqa: E731
        return jax.vjp(f, x, w)[1](dy)

    dx, dw = grads(KEY)
    assert not np.any(np.asarray(dx)[80:]) and not np.any(np.asarray(dw)[1])
    draws = jax.vmap(grads)(jax.random.split(jax.random.key(12), 128))
    starts, ends = (0, 30, 30), (30, 30, 80)
    for group in (0, 2):
        s, e = starts[group], ends[group]
        qw = nvfp4_jax.quantize(w[group], axis=0, block_2d=True).dequantize()
        qx = nvfp4_jax.quantize(x[s:e]).dequantize()
        for got, exact in (
            (draws[0][:, s:e], dy[s:e] @ qw.T),
            (draws[1][:, group], qx.T @ dy[s:e]),
        ):
            one = jnp.linalg.norm(got[0] - exact)
            assert jnp.linalg.norm(jnp.mean(got, axis=0) - exact) < one / 6
