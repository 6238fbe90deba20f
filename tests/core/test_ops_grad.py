"""Differentiation of every public op, on every implementation, with one rule per op.

The rules (nvfp4_jax.ops): `apply_rht` is linear (its transpose is the inverse RHT),
`tensor_amax` differentiates as `jnp.max(jnp.abs(.))`, `fake_quantize` by the straight-through
estimator (identity; zero where a caller-given amax clips; the RHT with `rht`; times S_enc
without the global scale), `dequantize` in its float inputs, `quantize` not at all (zero).
Gradients must be the same bits on every implementation: they come from the same rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numerics_oracle as oracle
import numpy as np
import optax
import pytest
from helpers import assert_same_bits, heavy_tailed, make_impl
from jax.test_util import check_grads

import nvfp4_jax


def data(shape=(32, 64), seed=0, dtype="f32"):
    return jnp.asarray(heavy_tailed(shape, dtype, seed=seed, outliers=False))


def grad_of(fn, *args, argnums=0):
    return jax.jit(jax.grad(fn, argnums=argnums))(*args)


def weights(shape, seed=1):
    """Random cotangent weights: `sum(w * f(x))` has gradient `J^T w`."""
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# --- apply_rht --------------------------------------------------------------------------------


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_rht_gradient_is_the_transpose(impl, inverse):
    x, w = data(), weights((32, 64))

    def loss(v):
        return jnp.sum(w * nvfp4_jax.apply_rht(v, inverse, implementation=impl.implementation))

    g = grad_of(loss, x)
    # d/dx sum(w * (x M)) = w M^T: the other transform, as matrices (f32 round-off only).
    m = oracle.rht_matrix().astype(np.float64)
    m = m if inverse else m.T  # forward is x @ M, inverse x @ M.T
    want = (np.asarray(w, np.float64).reshape(-1, 16) @ m).reshape(w.shape)
    np.testing.assert_allclose(g, want, rtol=0, atol=1e-6 * np.abs(want).max())
    reference = grad_of(
        lambda v: jnp.sum(w * nvfp4_jax.apply_rht(v, inverse, implementation="reference")), x
    )
    assert_same_bits(g, reference, "same rule on every implementation")


@pytest.mark.slow
def test_rht_check_grads_forward_and_reverse(impl):
    x = data((4, 32))

    def f(v):
        return nvfp4_jax.apply_rht(v, implementation=impl.implementation)

    check_grads(f, (x,), order=2, modes=("fwd", "rev"), atol=1e-3, rtol=1e-3)


# --- tensor_amax ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_amax_gradient_is_that_of_max_abs(impl, rht):
    x = data(seed=3)

    def amax(v):
        return nvfp4_jax.tensor_amax(v, rht=rht, implementation=impl.implementation)

    g = grad_of(amax, x)
    y = nvfp4_jax.reference.apply_rht(x) if rht else x
    want = jax.grad(lambda v: jnp.max(jnp.abs(nvfp4_jax.reference.apply_rht(v) if rht else v)))(x)
    assert_same_bits(g, want, "d amax / dx")
    assert int(np.count_nonzero(g)) == (16 if rht else 1)  # the argmax (its 16-group with RHT)
    assert float(amax(x)) == float(jnp.max(jnp.abs(y)))


def test_amax_check_grads(impl):
    x = data((2, 32), seed=4)  # a unique maximum: the function is smooth around x

    def f(v):
        return nvfp4_jax.tensor_amax(v, implementation=impl.implementation)

    check_grads(f, (x,), order=1, modes=("fwd", "rev"), atol=1e-3, rtol=1e-3)


def test_amax_gradient_splits_between_ties(impl):
    x = jnp.zeros((1, 16)).at[0, 3].set(2.0).at[0, 9].set(-2.0)
    g = grad_of(lambda v: nvfp4_jax.tensor_amax(v, implementation=impl.implementation), x)
    np.testing.assert_array_equal(g[0, [3, 9]], [0.5, -0.5])
    assert int(np.count_nonzero(g)) == 2


# --- fake_quantize: the straight-through estimator ----------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"block_2d": True},
        {"axis": 0},
        {"stochastic_rounding": True, "key": jax.random.key(1)},
        {"dtype": jnp.bfloat16},
    ],
    ids=["1x16", "16x16", "axis0", "sr", "bf16_out"],
)
def test_fake_quantize_gradient_is_the_identity(impl, flags):
    x, w = data(), weights((32, 64))

    def loss(v):
        out = nvfp4_jax.fake_quantize(v, implementation=impl.implementation, **flags)
        return jnp.sum(w * out.astype(jnp.float32))

    g = grad_of(loss, x)
    want = w.astype(flags.get("dtype", jnp.float32)).astype(jnp.float32)
    assert_same_bits(g, want, "straight-through")


def test_fake_quantize_gradient_is_zero_where_an_explicit_amax_clips(impl):
    x, w = data(seed=5), weights((32, 64))
    amax = jnp.float32(0.5) * jnp.max(jnp.abs(x))

    def loss(v):
        out = nvfp4_jax.fake_quantize(v, amax=amax, implementation=impl.implementation)
        return jnp.sum(w * out)

    g = np.asarray(grad_of(loss, x))
    clipped = np.abs(np.asarray(x)) > float(amax)
    assert clipped.any() and (~clipped).any()
    np.testing.assert_array_equal(g[clipped], 0)
    np.testing.assert_array_equal(g[~clipped], np.asarray(w)[~clipped])


def test_fake_quantize_gradient_with_rht_is_the_transform(impl):
    # With rht the values stay in the rotated basis: out ~ x M, so the gradient is w M^T.
    x, w = data(seed=6), weights((32, 64))

    def loss(v):
        return jnp.sum(w * nvfp4_jax.fake_quantize(v, rht=True, implementation=impl.implementation))

    want = jax.grad(lambda v: jnp.sum(w * nvfp4_jax.reference.apply_rht(v)))(x)
    assert_same_bits(grad_of(loss, x), want, "RHT straight-through")


def test_fake_quantize_gradient_without_global_scale_carries_s_enc(impl):
    x, w = data(seed=7), weights((32, 64))

    def loss(v):
        out = nvfp4_jax.fake_quantize(v, global_scale=False, implementation=impl.implementation)
        return jnp.sum(w * out)

    s_enc = nvfp4_jax.reference.encode_scale(jnp.max(jnp.abs(x)))
    assert_same_bits(grad_of(loss, x), w * s_enc, "times S_enc")


def test_fake_quantize_forward_mode_equals_reverse(impl):
    x, t = data(seed=8), weights((32, 64), seed=9)

    def f(v):
        return nvfp4_jax.fake_quantize(v, implementation=impl.implementation)

    _, tangent = jax.jvp(f, (x,), (t,))
    assert_same_bits(tangent, t, "jvp of the identity")


# --- dequantize and quantize ---------------------------------------------------------------------


def test_dequantize_is_differentiable_in_the_amax(impl):
    q = nvfp4_jax.quantize(data(seed=10), implementation="reference")

    def decoded_sum(amax):
        moved = q.__class__(q.codes, q.scales, amax, q.dtype, q.axis, q.block_2d, q.rht)
        return jnp.sum(nvfp4_jax.dequantize(moved, implementation=impl.implementation))

    g = grad_of(decoded_sum, q.amax)
    # x_hat is linear in A: d sum(x_hat) / dA = sum(x_hat) / A.
    total = float(decoded_sum(q.amax))
    np.testing.assert_allclose(float(g), total / float(q.amax), rtol=1e-5)
    _, tangent = jax.jvp(decoded_sum, (q.amax,), (jnp.float32(1),))
    np.testing.assert_allclose(tangent, g, rtol=1e-5)  # forward mode, another summation order


def test_quantize_outputs_carry_no_gradient(impl):
    x = data(seed=11)

    def loss(v):
        q = nvfp4_jax.quantize(v, implementation=impl.implementation)
        return jnp.sum(nvfp4_jax.dequantize(q, implementation=impl.implementation))

    np.testing.assert_array_equal(grad_of(loss, x), 0)


# --- transformations and learning -------------------------------------------------------------


def test_grad_under_vmap_is_per_example(impl):
    xs, w = jnp.stack([data(seed=s) for s in range(3)]), weights((32, 64))

    def loss(v):
        return jnp.sum(w * nvfp4_jax.fake_quantize(v, rht=True, implementation=impl.implementation))

    batched = jax.jit(jax.vmap(jax.grad(loss)))(xs)
    for i in range(3):
        assert_same_bits(batched[i], grad_of(loss, xs[i]), f"example {i}")


def qat_losses(implementation, steps=150):
    """Regression onto a fixed linear teacher through a fake-quantized weight, with Adam."""
    k_teacher, k_x = jax.random.split(jax.random.key(0))
    teacher = jax.random.normal(k_teacher, (64, 32)) / 8

    def loss(w, x):
        w_q = nvfp4_jax.fake_quantize(w, axis=0, implementation=implementation)
        return jnp.mean((x @ w_q - x @ teacher) ** 2)

    tx = optax.adam(1e-2)

    @jax.jit
    def step(w, state, x):
        value, g = jax.value_and_grad(loss)(w, x)
        updates, state = tx.update(g, state, w)
        return optax.apply_updates(w, updates), state, value

    w = jnp.zeros((64, 32))
    state, losses = tx.init(w), []
    for i in range(steps):
        w, state, value = step(w, state, jax.random.normal(jax.random.fold_in(k_x, i), (128, 64)))
        losses.append(float(value))
    return losses


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_quantization_aware_training_learns(name):
    impl = make_impl(name)
    losses = qat_losses(impl.implementation)
    # The teacher's outputs have variance 1; NVFP4's relative error (about 0.9% MSE on
    # normal data, docs/NUMERICS.md section 10) bounds how close the quantized student gets.
    start, final = losses[0], float(np.mean(losses[-10:]))
    assert np.all(np.isfinite(losses))
    assert final < 0.05 * start, f"loss {start:.4f} -> {final:.4f}"
