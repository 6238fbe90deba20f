"""Frozen NVFP4 layers (`from_quantized`, an `NVFP4Array` kernel): state, derivatives, rules.

* State: `Experts.from_quantized` holds concrete variables, as `Linear.from_quantized` does,
  so a model holding it runs under `nnx.jit`, saves as a checkpoint and calibrates.
* Derivatives: the weight-only GEMMs (`gemm.weight_only_matmul`, `weight_only_ragged_dot`)
  run the native W4A16 kernel for up to `WEIGHT_ONLY_MAX_ROWS` rows on the CPU and XLA's dot
  of the dequantized weight above; at every row count their derivative in x is bit for bit
  that of the XLA expression (`x @ dequantize(W)`, `ragged_dot`), eagerly and under `jit`,
  forward and reverse mode, and they have none in the frozen weight. The frozen layers
  built on them differentiate the same way, and `inspect_model` sees through them.
* Rules: every frozen layer (linear, experts, a linen `Dense` with an `NVFP4Array` kernel)
  is "skipped" by `quantize_model`, `quantize_linen` and `inspect_model`, and left as it is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import assert_same_bits, heavy_tailed

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe, Rule, inspect_model, quantize_model
from nvfp4_jax._src.core import ops
from nvfp4_jax._src.flax import layer_info
from nvfp4_jax._src.flax.layer_info import layer_recipe
from nvfp4_jax._src.model.convert.linen import quantize_linen
from nvfp4_jax._src.training import weight_only
from nvfp4_jax._src.training.ragged.groups import group_amax

G, K, N = 3, 64, 32
ROWS = [
    1,
    8,
    weight_only.WEIGHT_ONLY_MAX_ROWS,
    weight_only.WEIGHT_ONLY_MAX_ROWS + 1,
]  # native, then XLA
RTN = NVFP4Recipe(stochastic_rounding=False)


def weight(seed=0, shape=(K, N)):
    w = heavy_tailed(shape, seed=seed) * np.float32(shape[0] ** -0.5)
    return nvfp4_jax.quantize(jnp.asarray(w), axis=0)


def experts_weight(seed=0):
    per_expert = [weight(seed + e) for e in range(G)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_expert)


def activations(shape, seed=1, dtype=jnp.bfloat16):
    return jnp.asarray(heavy_tailed(shape, seed=seed), jnp.float32).astype(dtype)


def maybe_jit(fn, mode: str):
    return jax.jit(fn) if mode == "jit" else fn


def layer_dx(layer, x, mode: str, *args):
    """The VJP in x of `layer(x, *args)` (fixed cotangent), eagerly or under `nnx.jit`."""

    def dx(layer, x):
        return vjp_x(lambda v: layer(v, *args), x)[1]

    return nnx.jit(dx)(layer, x) if mode == "jit" else dx(layer, x)


def vjp_x(fn, x, seed=7):
    """`fn`'s output and its VJP in x with a fixed heavy-tailed cotangent."""
    y, pullback = jax.vjp(fn, x)
    g = activations(jnp.shape(y), seed=seed, dtype=jnp.result_type(y))
    return y, pullback(g)[0]


def sizes_for(rows: int) -> jax.Array:
    """G group sizes covering all but the last row (it belongs to no expert)."""
    first = rows // 3
    return jnp.asarray([first, 0, rows - first - 1], jnp.int32)


# --- state: frozen layers hold concrete variables --------------------------------------


class MoE(nnx.Module):
    def __init__(self):
        self.experts = nvfp4_jax.nnx.Experts.from_quantized(experts_weight(seed=40))
        self.linear = nvfp4_jax.nnx.Linear.from_quantized(weight(seed=41, shape=(N, N)))

    def __call__(self, x, sizes):
        return self.linear(self.experts(x, sizes))


def test_frozen_layers_hold_no_abstract_state():
    for layer in (MoE().experts, MoE().linear):
        leaves = jax.tree.leaves(nnx.state(layer))
        assert leaves and all(isinstance(leaf, jax.Array) for leaf in leaves), nnx.state(layer)
    experts = MoE().experts
    assert_same_bits(experts.input_amax[...], np.zeros((G,), np.float32), "input_amax")


@pytest.mark.slow
@pytest.mark.parametrize("rows", [6, weight_only.WEIGHT_ONLY_MAX_ROWS + 4])
def test_a_model_with_frozen_experts_jits_saves_and_calibrates(rows, tmp_path):
    model = MoE()
    x, sizes = activations((rows, K), seed=42, dtype=jnp.float32), sizes_for(rows)
    eager = model(x, sizes)
    forward = nnx.jit(lambda m, x, s: m(x, s))
    assert_same_bits(forward(model, x, sizes), eager, "nnx.jit")
    # A checkpoint of the state restores into a fresh (abstract) model, bit for bit.
    nvfp4_jax.save_checkpoint(tmp_path / "ckpt", nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(MoE))
    restored = nnx.merge(graphdef, nvfp4_jax.restore_checkpoint(tmp_path / "ckpt", abstract))
    assert_same_bits(restored(x, sizes), eager, "restored")
    # Calibration records each expert's max |x| (and the linear's), eagerly and under jit.
    assert nvfp4_jax.nnx.calibrate(model) == 2
    forward(model, x, sizes)
    model(0.5 * x, sizes)
    want = group_amax(x, sizes, G)
    assert_same_bits(model.experts.input_amax[...], want, "experts' input_amax")
    assert float(model.linear.input_amax[...]) > 0


# --- derivatives: the weight-only GEMMs and the layers built on them ----------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("rows", ROWS)
def test_weight_only_matmul_grad_in_x_is_the_dequantized_matmuls(impl, rows, mode):
    q, x = weight(), activations((rows, K))
    i = impl.implementation

    def native(x):
        return weight_only.weight_only_matmul(x, q, implementation=i)

    def xla(x):
        return jnp.matmul(x, ops.dequantize(q, x.dtype, implementation=i))

    _, got = vjp_x(maybe_jit(native, mode), x)
    _, want = vjp_x(maybe_jit(xla, mode), x)
    assert_same_bits(got, want, f"dx of {rows} rows")
    # A batch of rows, and an f32 result (preferred_element_type) of bf16 activations.
    xs = activations((2, max(rows // 2, 1), K), seed=3)

    def native_f32(x):
        return weight_only.weight_only_matmul(
            x, q, preferred_element_type=jnp.float32, implementation=i
        )

    def xla_f32(x):
        weight = ops.dequantize(q, x.dtype, implementation=i)
        return jnp.matmul(x, weight, preferred_element_type=jnp.float32)

    assert_same_bits(
        vjp_x(maybe_jit(native_f32, mode), xs)[1], vjp_x(maybe_jit(xla_f32, mode), xs)[1], "f32"
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_weight_only_matmul_forward_mode_is_the_dequantized_matmuls(impl, mode):
    q, x = weight(seed=2, shape=(32, 16)), activations((2, 32), seed=4)
    i = impl.implementation

    def native(x):
        return weight_only.weight_only_matmul(x, q, implementation=i)

    def xla(x):
        return jnp.matmul(x, ops.dequantize(q, x.dtype, implementation=i))

    tangent = activations((2, 32), seed=5)
    y, dy = maybe_jit(lambda x, t: jax.jvp(native, (x,), (t,)), mode)(x, tangent)
    assert_same_bits(y, maybe_jit(native, mode)(x), "primal: the native kernel's")
    want = maybe_jit(lambda x, t: jax.jvp(xla, (x,), (t,))[1], mode)(x, tangent)
    assert_same_bits(dy, want, "tangent")
    for jac in (jax.jacfwd, jax.jacrev):
        assert_same_bits(
            maybe_jit(jac(native), mode)(x), maybe_jit(jac(xla), mode)(x), jac.__name__
        )


@pytest.mark.parametrize("rows", [4, weight_only.WEIGHT_ONLY_MAX_ROWS + 1])
def test_the_frozen_weight_gets_no_derivative(impl, rows):
    q, x = weight(seed=3), activations((rows, K), seed=6)

    def out(amax, scales):
        frozen = dataclasses.replace(q, amax=amax, scales=scales)
        y = weight_only.weight_only_matmul(x, frozen, implementation=impl.implementation)
        return jnp.sum(y.astype(jnp.float32))

    d_amax, d_scales = jax.grad(out, argnums=(0, 1))(q.amax, q.scales)
    assert float(d_amax) == 0 and not np.any(np.asarray(d_scales, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(
    "rows", [7, weight_only.WEIGHT_ONLY_MAX_ROWS, weight_only.WEIGHT_ONLY_MAX_ROWS + 8]
)
def test_weight_only_ragged_dot_grad_in_x_is_the_ragged_dots(impl, rows, mode):
    q, x, sizes = experts_weight(seed=10), activations((rows, K), seed=11), sizes_for(rows)
    i = impl.implementation

    def native(x):
        return weight_only.weight_only_ragged_dot(x, q, sizes, implementation=i)

    def xla(x):
        return jax.lax.ragged_dot(x, ops.dequantize(q, x.dtype, implementation=i), sizes)

    _, got = vjp_x(maybe_jit(native, mode), x)
    _, want = vjp_x(maybe_jit(xla, mode), x)
    assert_same_bits(got, want, f"dx of {rows} rows")
    tangent = activations((rows, K), seed=12)
    got = maybe_jit(lambda x, t: jax.jvp(native, (x,), (t,))[1], mode)(x, tangent)
    want = maybe_jit(lambda x, t: jax.jvp(xla, (x,), (t,))[1], mode)(x, tangent)
    assert_same_bits(got, want, "tangent")


# The frozen layers run the default implementation: the native kernels where they run.


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("activations_kind", ["high_precision", "nvfp4"])
@pytest.mark.parametrize("rows", [4, weight_only.WEIGHT_ONLY_MAX_ROWS + 1])
def test_nnx_linear_from_quantized_is_differentiable_in_its_input(rows, activations_kind, mode):
    q, scale = weight(seed=20), jnp.float32(0.01)
    layer = nvfp4_jax.nnx.Linear.from_quantized(
        q, bias=jnp.ones((N,)), input_scale=scale, activations=activations_kind
    )
    x = activations((2, rows, K), seed=21, dtype=jnp.float32)

    def xla(x):
        x = x.astype(jnp.bfloat16)
        if activations_kind == "nvfp4":
            x = ops.fake_quantize_with_data_amax(x, scale * 2688, dtype=jnp.bfloat16)
        return jnp.matmul(x, ops.dequantize(q, jnp.bfloat16))

    assert_same_bits(layer_dx(layer, x, mode), vjp_x(maybe_jit(xla, mode), x)[1], "dx")
    # nnx.grad of a loss through the layer, as a training step takes it.
    dx = nnx.grad(lambda layer, x: jnp.sum(layer(x).astype(jnp.float32) ** 2), argnums=1)(layer, x)
    assert dx.shape == x.shape and np.all(np.isfinite(np.asarray(dx)))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("rows", [4, weight_only.WEIGHT_ONLY_MAX_ROWS + 1])
def test_linen_dense_with_an_nvfp4_kernel_is_differentiable_in_its_input(rows, mode):
    q = weight(seed=22)
    frozen = {"params": {"kernel": q, "bias": jnp.zeros((N,), jnp.bfloat16)}}
    dense = nvfp4_jax.linen.Dense(N)
    x = activations((rows, K), seed=23)

    def xla(x):
        return jnp.matmul(x, ops.dequantize(q, x.dtype))

    got = vjp_x(maybe_jit(lambda x: dense.apply(frozen, x), mode), x)[1]
    assert_same_bits(got, vjp_x(maybe_jit(xla, mode), x)[1], "dx")


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("rows", [6, weight_only.WEIGHT_ONLY_MAX_ROWS + 4])
def test_experts_from_quantized_are_differentiable_in_their_input(rows, mode):
    q = experts_weight(seed=24)
    layer = nvfp4_jax.nnx.Experts.from_quantized(q)
    x, sizes = activations((rows, K), seed=25, dtype=jnp.float32), sizes_for(rows)

    def xla(x):
        x = x.astype(jnp.bfloat16)
        return jax.lax.ragged_dot(x, ops.dequantize(q, jnp.bfloat16), sizes)

    got = layer_dx(layer, x, mode, sizes)
    assert_same_bits(got, vjp_x(maybe_jit(xla, mode), x)[1], "dx, sorted tokens")
    # Dispatched tokens (G, capacity, in): each expert's weight-only matmul.
    dispatched = activations((G, 5, K), seed=26)

    def xla_dispatched(x):
        w = ops.dequantize(q, x.dtype)
        return jnp.stack([jnp.matmul(x[e], w[e]) for e in range(G)])

    want = vjp_x(maybe_jit(xla_dispatched, mode), dispatched)[1]
    assert_same_bits(layer_dx(layer, dispatched, mode), want, "dispatched")


class FrozenNet(nnx.Module):
    """An NVFP4 layer `a`, then a frozen linear and frozen experts: `a`'s dy crosses both."""

    def __init__(self, rngs, recipe=RTN):
        self.a = nvfp4_jax.nnx.Linear(K, K, recipe=recipe, rngs=rngs)
        self.frozen = nvfp4_jax.nnx.Linear.from_quantized(weight(seed=30, shape=(K, K)))
        self.experts = nvfp4_jax.nnx.Experts.from_quantized(experts_weight(seed=31))

    def __call__(self, x):
        h = self.frozen(jax.nn.gelu(self.a(x)))
        return self.experts(h, sizes_for(x.shape[0]))


@pytest.mark.slow
@pytest.mark.parametrize("rows", [8, weight_only.WEIGHT_ONLY_MAX_ROWS + 8])
def test_inspect_model_sees_through_frozen_layers(rows):
    model = FrozenNet(nnx.Rngs(0))
    x = activations((rows, K), seed=32, dtype=jnp.float32)
    report = inspect_model(model, x, key=1)
    assert [s.path for s in report.layers] == ["a"] and report["a"].tokens == rows
    assert report.high_precision == ("experts", "frozen") and not report.skipped
    # a's dy is the gradient through the frozen layers (the XLA expressions').
    y = model.a(x)
    dy = jax.grad(lambda y: jnp.mean(jnp.square(rest(model, x, y))))(y)
    np.testing.assert_allclose(
        report["a"].operands["dy"].amax, float(jnp.max(jnp.abs(dy))), rtol=1e-2
    )


def rest(model: FrozenNet, x, y):
    """The default loss's output from a's output y, through the XLA expressions."""
    h = jnp.matmul(
        jax.nn.gelu(y).astype(jnp.bfloat16),
        ops.dequantize(model.frozen.kernel.get_value(), jnp.bfloat16),
    )
    q = model.experts.kernel.get_value()
    return jax.lax.ragged_dot(h, ops.dequantize(q, jnp.bfloat16), sizes_for(x.shape[0])).astype(
        jnp.float32
    )


# --- rules and diagnostics leave every frozen layer as it is ------------------------------


@pytest.mark.parametrize("recipe", [RTN, None], ids=["nvfp4_rule", "high_precision_rule"])
def test_quantize_model_skips_frozen_experts_as_it_skips_a_frozen_linear(recipe):
    model = MoE()
    x, sizes = activations((6, K), seed=50, dtype=jnp.float32), sizes_for(6)
    before, kernel = model(x, sizes), model.experts.kernel
    report = quantize_model(model, [Rule(".*", recipe)])
    for path, kind in (("experts", "Experts"), ("linear", "Linear")):
        entry = report[path]
        assert (entry.action, entry.recipe) == ("skipped", None), entry
        assert entry.reason == f"a frozen quantized weight ({kind}.from_quantized)"
    assert model.experts.kernel is kernel and model.experts.recipe is None
    assert model.experts.quantize_rngs is None  # no stochastic-rounding stream attached
    assert layer_recipe(model.experts) is None and layer_recipe(model.linear) is None
    assert_same_bits(model(x, sizes), before, "unchanged")


def test_frozen_problem_names_every_frozen_layer():
    model = MoE()
    assert (
        layer_info.frozen_problem(model.experts)
        == "a frozen quantized weight (Experts.from_quantized)"
    )
    assert (
        layer_info.frozen_problem(model.linear)
        == "a frozen quantized weight (Linear.from_quantized)"
    )
    assert layer_info.frozen_problem(nvfp4_jax.nnx.Experts(G, K, N, rngs=nnx.Rngs(0))) == ""
    assert layer_info.frozen_problem(nnx.Linear(K, N, rngs=nnx.Rngs(0))) == ""


def test_inspect_model_with_a_rule_reaching_frozen_layers():
    model = FrozenNet(nnx.Rngs(0))
    x = activations((8, K), seed=51, dtype=jnp.float32)
    report = inspect_model(model, x, rules=[Rule(".*", RTN)], key=2)
    assert [s.path for s in report.layers] == ["a"]
    assert report.skipped == {
        "experts": "a frozen quantized weight (Experts.from_quantized)",
        "frozen": "a frozen quantized weight (Linear.from_quantized)",
    }
    # Only frozen layers: nothing to analyze, both reported.
    frozen_only = inspect_model(MoE(), x, sizes_for(8), rules=[Rule("", RTN)])
    assert frozen_only.layers == () and set(frozen_only.skipped) == {"experts", "linear"}


def test_quantize_linen_skips_a_dense_with_an_nvfp4_kernel():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nvfp4_jax.linen.Dense(N, name="frozen")(nn.Dense(K, name="dense")(x))

    x = activations((4, K), seed=52, dtype=jnp.float32)
    params = Net().init(jax.random.key(0), x)
    params["params"]["frozen"]["kernel"] = weight(seed=53)
    with quantize_linen([Rule(".*", RTN)]) as report:
        y = Net().apply(params, x)
    assert report["dense"].action == "nvfp4"
    assert report["frozen"].action == "skipped"
    assert report["frozen"].reason == "a frozen quantized weight (an NVFP4Array kernel)"
    assert y.shape == (4, N) and np.all(np.isfinite(np.asarray(y)))
