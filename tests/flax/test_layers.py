"""Flax layers: `nvfp4_jax.nnx.Linear`, `nvfp4_jax.linen.Dense`, and the drop-in dot_general.

Every layer is compared with flax's own (same parameters, same initializers) and with the
functional `nvfp4_jax.dot_general` on the layer's parameters; training runs a small MLP on
a synthetic regression task and checks that the loss falls below a stated bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from helpers import DENSE, assert_same_bits, bits

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe, nvfp4_dot_general


def shapes(tree):
    return jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype).name), tree)


def inputs(shape=(32, 64), seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


# --- nnx -------------------------------------------------------------------------------------


def test_nnx_linear_params_match_flax_and_forward_is_the_nvfp4_gemm():
    layer = nvfp4_jax.nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    reference = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    params, flax_params = nnx.state(layer, nnx.Param), nnx.state(reference, nnx.Param)
    assert shapes(params) == shapes(flax_params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(flax_params), strict=True):
        assert_same_bits(a, b)  # the rng stream for SR is forked after the parameters
    x = inputs()
    y = layer(x)
    expected = nvfp4_jax.dot_general(x, layer.kernel[...], DENSE) + layer.bias[...]
    assert_same_bits(y, expected)  # the forward draws no randomness
    assert y.shape == reference(x).shape


def nnx_grads(layer, x):
    def loss(model):
        return jnp.sum(model(x) ** 2)

    return nnx.grad(loss)(layer)


def test_nnx_linear_draws_a_fresh_sr_key_every_call():
    layer = nvfp4_jax.nnx.Linear(64, 32, rngs=nnx.Rngs(0, quantize=1))
    x = inputs()
    count = int(layer.quantize_rngs.count[...])
    g1, g2 = nnx_grads(layer, x), nnx_grads(layer, x)
    assert int(layer.quantize_rngs.count[...]) == count + 2
    assert not np.array_equal(bits(g1.kernel[...]), bits(g2.kernel[...]))
    # The forward is deterministic: only the gradient's rounding changes.
    assert_same_bits(layer(x), layer(x))


@pytest.mark.slow
@pytest.mark.parametrize(
    "implementation", ["reference"] + (["ffi"] if nvfp4_jax.kernels.is_available("cpu") else [])
)
def test_nnx_sr_keys_are_the_rng_streams_own(implementation):
    # The layers hash their key of the step themselves (one native custom call on the CPU):
    # the keys, and so the gradients' rounding, are nnx's `stream()` bit for bit, the count
    # advancing the same way, eagerly and under nnx.jit.
    recipe = NVFP4Recipe(implementation=implementation)

    def make():
        return nvfp4_jax.nnx.Linear(64, 32, recipe=recipe, rngs=nnx.Rngs(0, quantize=1))

    stream = make().quantize_rngs
    keys = [stream(), stream()]  # nnx's own keys of the first two steps
    layer, x = make(), inputs()
    bias = layer.bias[...]

    def grad_of(w, key):
        def loss(w):
            return jnp.sum((nvfp4_jax.dot_general(x, w, DENSE, recipe=recipe, key=key) + bias) ** 2)

        return jax.grad(loss)(w)

    @nnx.jit
    def jitted_grads(model):
        return nnx_grads(model, x)

    got = [nnx_grads(layer, x).kernel[...], jitted_grads(layer).kernel[...]]
    assert int(layer.quantize_rngs.count[...]) == 2
    # Eagerly against eagerly, jitted against jitted (XLA may order a fused dot's sum otherwise).
    want = [grad_of(layer.kernel[...], keys[0]), jax.jit(grad_of)(layer.kernel[...], keys[1])]
    for g, w in zip(got, want, strict=True):
        assert_same_bits(g, w)
    assert not np.array_equal(bits(want[0]), bits(want[1]))


def test_nnx_linear_without_sr_keeps_no_rng_stream_and_is_deterministic():
    layer = nvfp4_jax.nnx.Linear(
        64, 32, recipe=NVFP4Recipe(stochastic_rounding=False), rngs=nnx.Rngs(0)
    )
    assert layer.quantize_rngs is None
    x = inputs()
    assert_same_bits(nnx_grads(layer, x).kernel[...], nnx_grads(layer, x).kernel[...])


def test_nnx_linear_rejects_a_dot_general():
    with pytest.raises(TypeError, match="dot_general is fixed"):
        nvfp4_jax.nnx.Linear(64, 32, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0))


def test_flax_nnx_linear_with_drop_in_dot_general():
    layer = nnx.Linear(64, 32, dot_general=nvfp4_dot_general(), rngs=nnx.Rngs(0))
    x = inputs(shape=(2, 16, 64))
    expected = nvfp4_jax.dot_general(x, layer.kernel[...], (((2,), (0,)), ((), ())))
    assert_same_bits(layer(x), expected + layer.bias[...])


def test_drop_in_sr_randomness_follows_the_gradient():
    # Without bias, doubling x doubles y and dy exactly, so with a fixed key the kernel's
    # gradient (of sum(y**2)) is exactly 4x; the drop-in without a key derives it from dy's
    # bits, so 2x gets other rounding, while the same x gets the same rounding.
    x = inputs()

    def kernel_grads(dot_general):
        layer = nnx.Linear(64, 32, use_bias=False, dot_general=dot_general, rngs=nnx.Rngs(0))
        return [nnx_grads(layer, x * s).kernel[...] for s in (1.0, 1.0, 2.0)]

    fixed = kernel_grads(nvfp4_dot_general(key=jax.random.key(4)))
    assert_same_bits(4 * fixed[0], fixed[2])
    derived = kernel_grads(nvfp4_dot_general())
    assert_same_bits(derived[0], derived[1])
    assert not np.array_equal(bits(4 * derived[0]), bits(derived[2]))


# --- linen -----------------------------------------------------------------------------------


def test_linen_dense_params_match_flax_and_forward_is_the_nvfp4_gemm():
    x = inputs(shape=(2, 16, 64))
    layer, reference = nvfp4_jax.linen.Dense(32), nn.Dense(32)
    params = layer.init(jax.random.key(0), x)
    flax_params = reference.init(jax.random.key(0), x)
    assert shapes(params) == shapes(flax_params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(flax_params), strict=True):
        assert_same_bits(a, b)
    y = layer.apply(params, x)
    p = params["params"]
    expected = nvfp4_jax.dot_general(x, p["kernel"], (((2,), (0,)), ((), ()))) + p["bias"]
    assert_same_bits(y, expected)
    assert y.shape == reference.apply(flax_params, x).shape


def linen_grads(layer, params, x, rngs=None):
    def loss(p):
        return jnp.sum(layer.apply(p, x, rngs=rngs) ** 2)

    return jax.grad(loss)(params)["params"]["kernel"]


def test_linen_dense_sr_key_comes_from_the_quantize_collection():
    layer, x = nvfp4_jax.linen.Dense(32), inputs()
    params = layer.init(jax.random.key(0), x)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    g1 = linen_grads(layer, params, x, {"quantize": k1})
    assert_same_bits(g1, linen_grads(layer, params, x, {"quantize": k1}))
    assert not np.array_equal(bits(g1), bits(linen_grads(layer, params, x, {"quantize": k2})))
    # Without the collection, the key is derived from the gradient: valid, and different.
    g0 = linen_grads(layer, params, x)
    assert np.all(np.isfinite(g0)) and not np.array_equal(bits(g0), bits(g1))


def test_linen_dense_rejects_a_dot_general():
    layer = nvfp4_jax.linen.Dense(32, dot_general=jax.lax.dot_general)
    with pytest.raises(TypeError, match="dot_general is fixed"):
        layer.init(jax.random.key(0), inputs())


@pytest.mark.parametrize(
    "module, x_shape, dims",
    [
        (nn.Dense(32, dot_general=nvfp4_dot_general()), (32, 64), DENSE),
        (
            nn.DenseGeneral((4, 16), axis=(-2, -1), dot_general=nvfp4_dot_general()),
            (8, 4, 16),
            (((1, 2), (0, 1)), ((), ())),
        ),
    ],
    ids=["linen_dense", "linen_dense_general_2_axes"],
)
def test_flax_linen_layers_with_drop_in_dot_general(module, x_shape, dims):
    x = inputs(x_shape)
    params = module.init(jax.random.key(0), x)
    p = params["params"]
    expected = nvfp4_jax.dot_general(x, p["kernel"], dims) + p["bias"]
    assert_same_bits(module.apply(params, x), expected)
    g = jax.grad(lambda q: jnp.sum(module.apply(q, x) ** 2))(params)
    assert shapes(g) == shapes(params)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(g))


# --- training --------------------------------------------------------------------------------

IN, WIDTH, OUT, BATCH, STEPS = 32, 64, 16, 128, 150
LEARNING_RATE = 1e-2
# The teacher's outputs have about unit variance; the untrained student starts near 1.4.
# Measured with Adam(1e-2), mean of the last 10 of 150 steps: flax's f32 MLP 0.106, the
# NVFP4 one 0.136 (the student's gelu cannot fit the tanh teacher exactly). The bound is
# 1/7 of the initial loss and 2x the f32 result: quantization must not stall training.
LOSS_BOUND = 0.2


def regression_batch(step):
    """A fixed random 2-layer teacher on fresh Gaussian inputs, outputs scaled to unit variance."""
    teacher = jax.random.key(1234)
    a = jax.random.normal(jax.random.fold_in(teacher, 0), (IN, WIDTH)) / np.sqrt(IN)
    b = jax.random.normal(jax.random.fold_in(teacher, 1), (WIDTH, OUT)) / np.sqrt(WIDTH)
    x = jax.random.normal(jax.random.fold_in(jax.random.key(7), step), (BATCH, IN))
    y = jnp.tanh(x @ a) @ b
    return x, y / 0.55  # std of tanh(N(0,1)) @ b is about 0.55


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nvfp4_jax.nnx.Linear(IN, WIDTH, rngs=rngs)
        self.fc2 = nvfp4_jax.nnx.Linear(WIDTH, OUT, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


def test_nnx_mlp_trains_below_loss_bound():
    model = NnxMLP(nnx.Rngs(0, quantize=1))
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, *regression_batch(i))) for i in range(STEPS)]
    final = float(np.mean(losses[-10:]))
    assert np.all(np.isfinite(losses))
    assert final < LOSS_BOUND, f"loss {losses[0]:.3f} -> {final:.3f}"


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nvfp4_jax.linen.Dense(OUT)(jax.nn.gelu(nvfp4_jax.linen.Dense(WIDTH)(x)))


def test_linen_mlp_trains_below_loss_bound():
    model, tx = LinenMLP(), optax.adam(LEARNING_RATE)
    params = model.init(jax.random.key(0), jnp.zeros((BATCH, IN)))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y, key):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x, rngs={"quantize": key}) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(STEPS):
        params, opt_state, loss = step(
            params, opt_state, *regression_batch(i), jax.random.fold_in(jax.random.key(3), i)
        )
        losses.append(float(loss))
    final = float(np.mean(losses[-10:]))
    assert np.all(np.isfinite(losses))
    assert final < LOSS_BOUND, f"loss {losses[0]:.3f} -> {final:.3f}"


# --- frozen NVFP4 weights and calibration ----------------------------------------------------


def quantized_kernel(seed=0, shape=(64, 32)):
    return nvfp4_jax.quantize(jax.random.normal(jax.random.key(seed), shape), axis=0)


@pytest.mark.parametrize("activations", ["high_precision", "nvfp4"])
def test_nnx_linear_from_quantized_computes_like_the_engines(activations):
    q, x = quantized_kernel(), inputs((8, 64))
    input_scale = jnp.float32(3.0) * jnp.float32(1 / 2688)
    layer = nvfp4_jax.nnx.Linear.from_quantized(
        q, input_scale=input_scale, activations=activations, dtype=jnp.bfloat16
    )
    xb = x.astype(jnp.bfloat16)
    if activations == "nvfp4":  # W4A4: the activations quantized with the static scale
        xb = nvfp4_jax.fake_quantize(xb, amax=input_scale * 2688)
    expected = jnp.matmul(xb, nvfp4_jax.dequantize(q, jnp.bfloat16))
    assert_same_bits(layer(x), expected)
    assert not jax.tree.leaves(nnx.state(layer, nnx.Param))  # the weight is not a parameter


def test_nnx_linear_from_quantized_fine_tunes_the_other_parameters():
    q = quantized_kernel(1)
    layer = nvfp4_jax.nnx.Linear.from_quantized(q, bias=jnp.zeros(32), dtype=jnp.float32)
    optimizer = nnx.Optimizer(layer, optax.adam(1e-1), wrt=nnx.Param)
    x = inputs((16, 64))
    target = layer(x) + 0.5  # the bias alone can reach it

    @nnx.jit
    def step(layer, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)
        optimizer.update(layer, grads)
        return loss

    losses = [float(step(layer, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.05 * losses[0], losses
    assert_same_bits(layer.kernel.get_value().codes, q.codes)  # the weight stayed frozen


def test_nnx_linear_from_quantized_rejects_what_it_cannot_serve():
    with pytest.raises(ValueError, match="needs input_scale"):
        nvfp4_jax.nnx.Linear.from_quantized(quantized_kernel(), activations="nvfp4")
    with pytest.raises(ValueError, match="quantized along axis 0"):
        nvfp4_jax.nnx.Linear.from_quantized(nvfp4_jax.quantize(jnp.ones((64, 32))))
    with pytest.raises(ValueError, match="activations must be"):
        nvfp4_jax.nnx.Linear.from_quantized(quantized_kernel(), activations="fp8")


@pytest.mark.parametrize(
    ("bias", "error", "message"),
    [
        (jnp.ones(()), ValueError, r"bias must be \(32,\), got \(\)"),  # would broadcast
        (jnp.ones((1, 32)), ValueError, r"bias must be \(32,\), got \(1, 32\)"),
        (jnp.ones((64,)), ValueError, r"bias must be \(32,\), got \(64,\)"),  # (in,)
        (jnp.ones((32,), jnp.int32), TypeError, "bias must be a float array, got int32"),
    ],
    ids=["scalar", "row", "in-features", "int"],
)
def test_nnx_linear_from_quantized_checks_its_bias(bias, error, message):
    # A bias the layer cannot add as (out,) is the caller's mistake: named where it is given,
    # not broadcast silently (a scalar) or found at the first call as a shape error.
    with pytest.raises(error, match=f"Linear.from_quantized: {message}"):
        nvfp4_jax.nnx.Linear.from_quantized(quantized_kernel(), bias=bias)
    layer = nvfp4_jax.nnx.Linear.from_quantized(
        quantized_kernel(), bias=jnp.arange(32.0), dtype=jnp.float32
    )
    x = inputs((4, 64))
    want = x @ nvfp4_jax.dequantize(quantized_kernel()) + jnp.arange(32.0)
    assert_same_bits(layer(x), want)


def test_nnx_calibration_records_the_largest_input():
    model = NnxMLP(nnx.Rngs(0, quantize=1))
    assert nvfp4_jax.nnx.calibrate(model) == 2

    @nnx.jit
    def forward(model, x):
        return model(x)

    batches = [inputs((8, IN), seed) * scale for seed, scale in ((1, 1.0), (2, 4.0), (3, 2.0))]
    for x in batches:
        forward(model, x)
    expected = max(float(jnp.max(jnp.abs(x))) for x in batches)
    assert float(model.fc1.input_amax[...]) == expected
    assert float(model.fc2.input_amax[...]) > 0
    nvfp4_jax.nnx.calibrate(model, False)
    forward(model, batches[1] * 10)
    assert float(model.fc1.input_amax[...]) == expected  # off: nothing recorded


def test_linen_dense_calibration_and_frozen_kernel():
    layer, x = nvfp4_jax.linen.Dense(32, calibrate=True), inputs((8, 64))
    params = layer.init(jax.random.key(0), x)
    _, state = layer.apply(params, x * 3, mutable=["calibration"])
    assert float(state["calibration"]["input_amax"]) == float(jnp.max(jnp.abs(x * 3)))
    q = nvfp4_jax.quantize(params["params"]["kernel"], axis=0)
    frozen = {"params": {"kernel": q, "bias": params["params"]["bias"], "input_scale": 0.01}}
    w4a16 = nvfp4_jax.linen.Dense(32).apply(frozen, x)
    assert_same_bits(w4a16, x @ nvfp4_jax.dequantize(q) + params["params"]["bias"])
    w4a4 = nvfp4_jax.linen.Dense(32, activations="nvfp4").apply(frozen, x)
    x_q = nvfp4_jax.fake_quantize(x, amax=jnp.float32(0.01) * 2688)
    assert_same_bits(w4a4, x_q @ nvfp4_jax.dequantize(q) + params["params"]["bias"])


# --- a non-finite input scale: data in the model, a constructor argument checked ---------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0], ids=["nan", "inf", "neg"])
def test_a_bad_stored_input_scale_gives_the_same_nan_eagerly_and_under_jit(bad):
    # A scale stored in the model (restored, calibrated on non-finite data, a loaded param) is
    # data: W4A4 then quantizes the activations to NaN, eagerly as under jit, never an error.
    q, x = quantized_kernel(2), inputs((8, 64))
    layer = nvfp4_jax.nnx.Linear.from_quantized(
        q, input_scale=jnp.float32(0.01), activations="nvfp4", dtype=jnp.float32
    )
    layer.input_scale[...] = jnp.float32(bad)
    layer.input_amax[...] = jnp.float32(bad) * 2688
    eager = layer(x)
    assert np.all(np.isnan(np.asarray(eager)))
    assert_same_bits(eager, nnx.jit(lambda m, v: m(v))(layer, x))

    frozen = {"params": {"kernel": q, "bias": jnp.zeros(32), "input_scale": jnp.float32(bad)}}
    dense = nvfp4_jax.linen.Dense(32, activations="nvfp4")
    eager = dense.apply(frozen, x)
    assert np.all(np.isnan(np.asarray(eager)))
    assert_same_bits(eager, jax.jit(dense.apply)(frozen, x))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0], ids=["nan", "inf", "neg"])
def test_from_quantized_rejects_a_bad_input_scale_argument(bad):
    for activations in ("nvfp4", "high_precision"):
        with pytest.raises(ValueError, match="input_scale must be a finite, non-negative number"):
            nvfp4_jax.nnx.Linear.from_quantized(
                quantized_kernel(), input_scale=bad, activations=activations
            )
    # Traced (built under jit), it cannot be checked: it is data, as a stored one.
    build = nnx.jit(
        lambda s: nvfp4_jax.nnx.Linear.from_quantized(
            quantized_kernel(), input_scale=s, activations="nvfp4"
        )
    )
    assert np.all(np.isnan(np.asarray(build(jnp.float32(bad))(inputs((4, 64))))))
