"""Rules, `quantize_model`, `quantize_linen`, `default_rules` and `inspect_model` on MoE layers.

A small Mixtral-style block (router `gate`, top-2, tokens sorted by expert, `Experts`) is put
in NVFP4 or high precision by rules; the router stays in high precision under
`default_rules`; `inspect_model` reports each expert as its own GEMM (`experts[e]`), with the
numbers `analyze_layer` gives on that expert's tokens, weight and output gradient.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import assert_same_bits

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe, Rule, default_rules, inspect_model, quantize_model
from nvfp4_jax._src.model.convert.linen import quantize_linen
from nvfp4_jax._src.model.convert.rules import ROUTER
from nvfp4_jax._src.model.diagnostics.numbers import analyze_layer

G, K, N, TOP_K = 4, 32, 64, 2
RTN = NVFP4Recipe(stochastic_rounding=False)
ALL_RTN = [Rule(".*", RTN)]


def route(logits: jax.Array, top_k: int = TOP_K):
    """(order, group_sizes, weights): the (token, choice) pairs sorted by expert."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=logits.shape[-1]).astype(jnp.int32)
    return order, sizes, weights


class MoE(nnx.Module):
    def __init__(self, rngs, recipe=None, sr=False):
        self.gate = nnx.Linear(K, G, use_bias=False, rngs=rngs)
        self.experts = nvfp4_jax.nnx.Experts(G, K, N, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        order, sizes, weights = route(self.gate(x))
        rows = x[order // TOP_K]
        y = self.experts(rows, sizes)
        unsorted = jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], TOP_K, N)
        return jnp.einsum("tkn,tk->tn", unsorted, weights.astype(y.dtype))


def tokens(seed=0, m=40):
    return jax.random.normal(jax.random.key(seed), (m, K), jnp.float32)


def test_router_pattern_names_routers_not_projections():
    router = re.compile(ROUTER)
    for path in ("layers/0/mlp/gate", "block_sparse_moe/gate", "mlp/router", "gate"):
        assert router.search(path), path
    for path in ("layers/0/mlp/gate_proj", "mlp/experts/gate_proj", "gated/up", "router_bias"):
        assert not router.search(path), path


def test_default_rules_keep_the_router_and_put_the_experts_in_nvfp4():
    model = MoE(nnx.Rngs(0))
    report = quantize_model(model, default_rules(1, first=0, last=0))
    assert report["gate"].action == "high_precision"
    assert report["experts"].action == "nvfp4" and report["experts"].layer == "Experts"
    assert type(model.gate) is nnx.Linear
    assert model.experts.recipe == NVFP4Recipe()
    assert model.experts.quantize_rngs is not None  # the default recipe rounds stochastically
    x = tokens()
    assert np.all(np.isfinite(model(x)))


def test_a_rule_sets_the_experts_recipe_and_a_none_rule_puts_them_in_high_precision():
    model = MoE(nnx.Rngs(0), recipe=None)
    x = tokens()
    high = model(x)
    kernel = model.experts.kernel
    report = quantize_model(model, [Rule("gate", None), Rule("experts", RTN)])
    assert report["experts"].action == "nvfp4" and model.experts.kernel is kernel
    order, sizes, _ = route(model.gate(x))
    rows = x[order // TOP_K]
    expected = nvfp4_jax.ragged_dot(rows, kernel[...], sizes, recipe=RTN)
    assert_same_bits(model.experts(rows, sizes), expected, "experts")
    assert not np.array_equal(model(x), high)
    report = quantize_model(model, [Rule("experts", None)])
    assert report["experts"].action == "high_precision" and model.experts.recipe is None
    assert_same_bits(model(x), high, "back in high precision")


def test_experts_that_cannot_be_nvfp4_are_skipped_with_the_reason():
    layer = nvfp4_jax.nnx.Experts(G, 24, 16, recipe=None, rngs=nnx.Rngs(0))
    report = quantize_model(layer, ALL_RTN)
    assert report[""].action == "skipped"
    assert "in_features=24" in report[""].reason and layer.recipe is None


def test_stacked_experts_get_a_stream_per_layer():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return nvfp4_jax.nnx.Experts(G, K, N, recipe=None, rngs=nnx.Rngs(key))

    class Stack(nnx.Module):
        def __init__(self):
            self.experts = make(jax.random.split(jax.random.key(0), 3))

    model = Stack()
    report = quantize_model(model, [Rule(".*", NVFP4Recipe())], rngs=nnx.Rngs(quantize=5))
    assert report["experts"].stack == (3,) and report["experts"].action == "nvfp4"
    assert model.experts.quantize_rngs.key[...].shape == (3,)
    assert model.experts.input_amax[...].shape == (3, G)


@pytest.mark.parametrize("recipe", [RTN, None])
def test_quantize_linen_sets_the_recipe_of_linen_experts(recipe):
    layer = nvfp4_jax.linen.Experts(num_experts=G, features=N, recipe=NVFP4Recipe())
    x, sizes = tokens(), jnp.array([10, 0, 25, 5], jnp.int32)
    params = layer.init(jax.random.key(0), x, sizes)
    with quantize_linen([Rule(".*", recipe)]) as report:
        y = layer.apply(params, x, sizes)
    kernel = params["params"]["kernel"]
    if recipe is None:
        expected = jax.lax.ragged_dot(x, kernel, sizes)
        assert report[""].action == "high_precision"
    else:
        expected = nvfp4_jax.ragged_dot(x, kernel, sizes, recipe=recipe)
        assert report[""].action == "nvfp4"
    assert_same_bits(y, expected, "linen experts")


def test_quantize_linen_skips_linen_experts_of_the_wrong_size():
    layer = nvfp4_jax.linen.Experts(num_experts=G, features=24, recipe=None)
    x, sizes = tokens(), jnp.array([10, 10, 10, 10], jnp.int32)
    params = layer.init(jax.random.key(0), x, sizes)
    with quantize_linen(ALL_RTN) as report:
        layer.apply(params, x, sizes)
    assert report[""].action == "skipped" and "N=24" in report[""].reason


def expert_operands(model: MoE, x: jax.Array):
    """Each expert's (x rows, W, dy rows) of the default loss, computed by hand."""
    order, sizes, weights = route(model.gate(x))
    rows = x[order // TOP_K]

    def loss_of_y(y):
        unsorted = jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], TOP_K, N)
        out = jnp.einsum("tkn,tk->tn", unsorted, weights.astype(y.dtype))
        return jnp.mean(jnp.square(out))

    dy = jax.grad(loss_of_y)(model.experts(rows, sizes))
    ends = np.cumsum(np.asarray(sizes))
    return [
        (rows[end - size : end], model.experts.kernel[e], dy[end - size : end])
        for e, (size, end) in enumerate(zip(np.asarray(sizes), ends, strict=True))
    ]


@pytest.mark.slow
def test_inspect_model_reports_each_expert_as_its_own_gemm():
    model = MoE(nnx.Rngs(0), recipe=RTN)
    x = tokens(m=64)
    report = inspect_model(model, x, key=3)
    operands = expert_operands(model, x)
    called = [e for e, (rows, _, _) in enumerate(operands) if rows.shape[0]]
    assert [s.path for s in report.layers] == [f"experts[{e}]" for e in called]
    assert {s.module_path for s in report.layers} == {"experts"}
    assert "gate" in report.high_precision
    for e in range(G):
        rows, w, dy = operands[e]
        if not rows.shape[0]:
            continue
        stats = report[f"experts[{e}]"]
        assert stats.tokens == rows.shape[0]
        # The layer's key (its index among the analyzed layers: 0), then the expert's.
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 0), e)
        expected = analyze_layer(rows, w, dy, recipe=RTN, key=key, path=stats.path)
        assert stats.operands == expected.operands
        np.testing.assert_allclose(stats.fprop_error, expected.fprop_error, rtol=1e-6)
        np.testing.assert_allclose(stats.wgrad_angle, expected.wgrad_angle, rtol=1e-5, atol=1e-4)
    # A worst expert keeps the whole Experts layer: the unit rules can name.
    assert report.suggest_rules(0.01)[0] == Rule("^experts$", None)


@pytest.mark.slow
def test_inspect_model_under_rules_and_through_remat_and_dispatched_tokens():
    x = tokens(m=64)
    plain = inspect_model(MoE(nnx.Rngs(0)), x, rules=ALL_RTN, key=3)
    assert plain.layers and all(re.fullmatch(r"experts\[\d\]", s.path) for s in plain.layers)
    assert plain.skipped == {"gate": "in_features=32 and out_features=4 must be multiples of 16"}

    class Remat(nnx.Module):
        def __init__(self, rngs):
            self.moe = MoE(rngs)

        def __call__(self, x):
            return nnx.remat(lambda moe, x: moe(x))(self.moe, x)

    remat = inspect_model(Remat(nnx.Rngs(0)), x, rules=ALL_RTN, key=3)
    assert [s.path for s in remat.layers] == [f"moe/{s.path}" for s in plain.layers]
    for stats in plain.layers:
        assert remat[f"moe/{stats.path}"].operands == stats.operands

    layer = nvfp4_jax.nnx.Experts(G, K, N, recipe=RTN, rngs=nnx.Rngs(0))
    dispatched = jax.random.normal(jax.random.key(2), (G, 16, K))
    report = inspect_model(layer, dispatched, key=1)
    assert [s.path for s in report.layers] == [f"[{e}]" for e in range(G)]
    dy = jax.grad(lambda y: jnp.mean(jnp.square(y)))(layer(dispatched))
    for e in range(G):
        expected = analyze_layer(dispatched[e], layer.kernel[e], dy[e], recipe=RTN)
        assert report[f"[{e}]"].operands == expected.operands
        assert report[f"[{e}]"].tokens == 16


def test_linen_experts_in_a_linen_moe_under_default_rules():
    class LinenMoE(nn.Module):
        @nn.compact
        def __call__(self, x):
            order, sizes, weights = route(nn.Dense(G, use_bias=False, name="gate")(x))
            y = nvfp4_jax.linen.Experts(G, N, recipe=None, name="experts")(x[order // TOP_K], sizes)
            unsorted = jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], TOP_K, N)
            return jnp.einsum("tkn,tk->tn", unsorted, weights)

    model, x = LinenMoE(), tokens()
    params = model.init(jax.random.key(0), x)
    with quantize_linen(default_rules(1, first=0, last=0)) as report:
        y = model.apply(params, x, rngs={"quantize": jax.random.key(1)})
    assert report["gate"].action == "high_precision"
    assert report["experts"].action == "nvfp4"
    assert np.all(np.isfinite(y))
