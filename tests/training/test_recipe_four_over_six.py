"""Four Over Six per operand class in `NVFP4Recipe` (docs/NUMERICS.md sections 9 and 13).

`weight_four_over_six`, `activation_four_over_six` and `gradient_four_over_six` choose 4/6 for
W (fprop and dgrad), x (fprop and wgrad) and dy (dgrad and wgrad). Each GEMM of
`dot_general` is then the product of the operands `quantize(..., four_over_six=...)` gives
(their dequantized values, f32 accumulation), up to the f32 summation order; the rest of the
recipe (16x16 weights, the RHT, stochastic rounding) is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ragged_oracle import assert_equals_group_loop

import nvfp4_jax
import nvfp4_jax.nnx as nvfp4_nnx
from nvfp4_jax import NVFP4Recipe, kernels, ragged_dot
from nvfp4_jax._src.flax.layer_info import layer_recipe
from nvfp4_jax._src.model.convert.nnx import quantize_model
from nvfp4_jax._src.model.convert.rules import Rule, recipe_from_dict, recipe_to_dict
from nvfp4_jax._src.training.dot_general import pad_tokens

dot_general_module = importlib.import_module("nvfp4_jax._src.training.dot_general")
DIMS = (((1,), (0,)), ((), ()))
IMPLEMENTATIONS = ["reference"] + (["ffi"] if kernels.is_available("cpu") else [])
CLASSES = ("weight", "activation", "gradient")
KEY = jax.random.key(5)


def _data(m=48, k=64, n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * rng.lognormal(0.0, 1.0, (m, 1))
    w = rng.standard_normal((k, n)) / 8
    dy = rng.standard_normal((m, n)) * rng.lognormal(0.0, 1.0, (m, 1))
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, w, dy))


def _recipe(implementation, mode="mse", classes=CLASSES, e4m3_max=256, **flags):
    fos = {f"{c}_four_over_six": mode for c in classes}
    return NVFP4Recipe(
        implementation=implementation, four_over_six_e4m3_max=e4m3_max, **fos, **flags
    )


@functools.partial(jax.jit, static_argnames=("recipe",))
def _vjp(x, w, dy, recipe):
    y, pullback = jax.vjp(
        lambda a, b: nvfp4_jax.dot_general(a, b, DIMS, recipe=recipe, key=KEY), x, w
    )
    return (y, *pullback(dy))


def _values(x, recipe, kind, **flags):
    """The operand (f64, stored layout: quantized axis last, in the rotated basis with the
    RHT) that `quantize` gives `x` under the recipe's 4/6 for `kind`: `value * s_b * D`."""
    q = nvfp4_jax.quantize(x, implementation=recipe.implementation, **flags,
                           **recipe.four_over_six(kind))  # fmt: skip
    values = np.asarray(nvfp4_jax.ops.block_values(q, jnp.float32), np.float64)
    return values * float(q.global_scale), q


def _assert_close(actual, expected, k, what):
    """Equal up to the f32 summation order of a GEMM over k terms."""
    expected = np.asarray(expected, np.float64)
    atol = (k + 2) * 2.0**-23 * np.abs(expected).max()
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=atol,
                               err_msg=what)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "classes", [("weight",), ("activation",), ("gradient",), CLASSES], ids="+".join
)
@pytest.mark.parametrize("mode", ["mae", "mse"])
def test_each_gemm_is_the_product_of_the_four_over_six_operands(mode, classes, implementation):
    """RN everywhere (SR's bits are covered by the next test): fprop, dgrad and wgrad each
    equal the product of the dequantized operands, those of the 4/6 classes quantized with
    4/6 (M = 256) and the others plain, and they differ from the plain recipe's."""
    x, w, dy = _data()
    recipe = _recipe(implementation, mode, classes, stochastic_rounding=False)
    y, dx, dw = _vjp(x, w, dy, recipe)
    xq, _ = _values(x, recipe, "activation", axis=1)  # (M, K)
    wq, qw = _values(w, recipe, "weight", axis=0, block_2d=True)  # (N, K)
    dyq, _ = _values(dy, recipe, "gradient", axis=1)  # (M, N)
    x_tok, _ = _values(pad_tokens(x), recipe, "activation", axis=0, rht=True)  # (K, Mp)
    dy_tok, _ = _values(pad_tokens(dy), recipe, "gradient", axis=0, rht=True)  # (N, Mp)
    _assert_close(y, xq @ wq.T, x.shape[1], "fprop")
    _assert_close(dx, dyq @ wq, w.shape[1], "dgrad")
    # The RHT along the tokens cancels in x^T dy: the rotated operands' product is dW.
    _assert_close(dw, x_tok @ dy_tok.T, x_tok.shape[1], "wgrad")
    assert (qw.four_over_six == mode) == ("weight" in classes)
    plain = _vjp(x, w, dy, dataclasses.replace(recipe, **{f"{c}_four_over_six": None
                                                          for c in CLASSES}))  # fmt: skip
    changed = {"weight": ("fprop", "dgrad"), "activation": ("fprop", "wgrad"),
               "gradient": ("dgrad", "wgrad")}  # fmt: skip
    for name, a, b in zip(("fprop", "dgrad", "wgrad"), (y, dx, dw), plain, strict=True):
        moved = any(name in changed[c] for c in classes)
        assert moved == (not np.array_equal(np.asarray(a), np.asarray(b))), name


@pytest.mark.slow
@pytest.mark.skipif(len(IMPLEMENTATIONS) < 2, reason="no native CPU kernels")
@pytest.mark.parametrize("e4m3_max", [256, 448])
def test_stochastic_rounding_under_four_over_six_is_the_same_on_every_implementation(e4m3_max):
    """With SR on dy (the default recipe), the reference and the native kernels give the
    same dx and dW up to the GEMMs' summation order: the same SR bits in each candidate."""
    x, w, dy = _data(seed=1)
    out = [_vjp(x, w, dy, _recipe(impl, "mse", CLASSES, e4m3_max)) for impl in IMPLEMENTATIONS]
    for name, k, a, b in zip(("y", "dx", "dW"), (64, 32, 48), *out, strict=True):
        _assert_close(a, b, k, name)


def test_four_over_six_lowers_every_gemm_error_on_gaussian_data():
    """Less quantization error per operand gives less error per GEMM (RN; N(0,1) data)."""
    x, w, dy = _data(256, 256, 256, seed=2)
    x, dy = x / jnp.std(x), dy / jnp.std(dy)
    exact = (x @ w, dy @ w.T, x.T @ dy)
    errors = {}
    for mode in (None, "mse"):
        recipe = _recipe("reference", mode, CLASSES, stochastic_rounding=False)
        got = _vjp(x, w, dy, recipe)
        errors[mode] = [float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
                        for g, e in zip(got, exact, strict=True)]  # fmt: skip
    assert all(a < b for a, b in zip(errors["mse"], errors[None], strict=True)), errors


def test_the_recipe_checks_its_four_over_six_fields_by_name():
    with pytest.raises(ValueError, match="weight_four_over_six"):
        NVFP4Recipe(weight_four_over_six="l1")
    with pytest.raises(TypeError, match="gradient_four_over_six"):
        NVFP4Recipe(gradient_four_over_six=True)
    with pytest.raises(ValueError, match="four_over_six_e4m3_max"):
        NVFP4Recipe(four_over_six_e4m3_max=300)
    with pytest.raises(ValueError, match="operand must be one of"):
        NVFP4Recipe().four_over_six("bias")
    recipe = NVFP4Recipe(activation_four_over_six="mae", four_over_six_e4m3_max=448)
    assert recipe.four_over_six("activation") == dict(four_over_six="mae",
                                                       four_over_six_e4m3_max=448)  # fmt: skip
    assert recipe.four_over_six("weight")["four_over_six"] is None
    assert recipe.uses_four_over_six and not NVFP4Recipe().uses_four_over_six
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    assert hash(recipe) != hash(NVFP4Recipe())


def test_rules_carry_the_four_over_six_recipe_into_nnx_layers_that_train():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(32, 64, rngs=rngs)
            self.b = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    model = Net(nnx.Rngs(0))
    recipe = NVFP4Recipe(weight_four_over_six="mse", gradient_four_over_six="mae")
    report = quantize_model(model, [Rule("a", recipe), Rule("b", None)], rngs=nnx.Rngs(1))
    assert isinstance(model.a, nvfp4_nnx.Linear) and layer_recipe(model.a) == recipe
    assert report["a"].recipe == recipe
    x = jax.random.normal(jax.random.key(0), (24, 32))
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads.a.kernel[...]).sum()) > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_ragged_dot_with_weight_four_over_six_is_the_per_group_dot_general(implementation):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((40, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 32, 16)) * (10.0 ** np.arange(3))[:, None, None],
                    jnp.float32)  # fmt: skip
    dy = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
    recipe = NVFP4Recipe(weight_four_over_six="mse", implementation=implementation)
    assert_equals_group_loop(x, w, [9, 0, 25], dy, KEY, recipe, exact=False)


@pytest.mark.parametrize("operand", ["activation", "gradient"])
def test_ragged_dot_refuses_four_over_six_on_activations_and_gradients(operand):
    recipe = NVFP4Recipe(**{f"{operand}_four_over_six": "mse"})
    with pytest.raises(NotImplementedError, match=f"{operand}_four_over_six"):
        ragged_dot(jnp.ones((8, 16)), jnp.ones((2, 16, 16)), jnp.array([4, 4]), recipe=recipe)
