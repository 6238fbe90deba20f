"""Whole-model NVFP4 by rules: matching, in-place conversion, the linen interceptor, training.

The quantized path is checked in the jaxpr: the forward of every matched layer holds one
`custom_vjp_call` of `nvfp4_jax.dot_general`'s `_nvfp4_matmul`, and (with the native kernels)
the forward and backward hold 5 quantize custom calls per matched layer: fprop x and W, dgrad
dy, wgrad x and dy.
"""

from __future__ import annotations

import collections
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe
from nvfp4_jax._src.core import backends
from nvfp4_jax._src.flax.einsum import NVFP4Einsum, einsum_plan
from nvfp4_jax._src.flax.walk import named_layers
from nvfp4_jax._src.model.convert.linen import quantize_linen, quantized
from nvfp4_jax._src.model.convert.nnx import quantize_model
from nvfp4_jax._src.model.convert.rules import (
    Rule,
    check_rules,
    default_rules,
    keep_bf16,
    match_rule,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import lm_model

NO_SR = NVFP4Recipe(stochastic_rounding=False)
NATIVE = backends.resolve(None, "tests").name == "ffi"
QUANTIZE_CALLS_PER_LAYER = 5  # fprop x, W; dgrad dy; wgrad x, dy


# --- jaxpr inspection ------------------------------------------------------------------------


def _subjaxprs(eqn):
    for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                yield sub.jaxpr


def nvfp4_calls(jaxpr) -> collections.Counter:
    """Counts `_nvfp4_matmul` custom_vjp calls and nvfp4 quantize custom calls, at any depth."""
    counts = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "custom_vjp_call":
            source = eqn.params["call_jaxpr"].jaxpr.debug_info.func_src_info
            counts["matmul"] += source.startswith("_nvfp4_matmul ")
        if eqn.params.get("target_name") in ("nvfp4_quantize", "nvfp4_fake_quantize"):
            counts["quantize"] += 1
        for sub in _subjaxprs(eqn):
            counts.update(nvfp4_calls(sub))
    return counts


def nnx_jaxprs(model, x):
    """(forward jaxpr, forward + backward jaxpr) of `mean(model(x) ** 2)`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):
        out = nnx.merge(graphdef, params, rest, copy=True)(x)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    forward = jax.make_jaxpr(loss)(params, rest).jaxpr
    backward = jax.make_jaxpr(jax.grad(loss))(params, rest).jaxpr
    return nvfp4_calls(forward), nvfp4_calls(backward)


def assert_nvfp4_layers(counts, n: int):
    forward, backward = counts
    assert forward["matmul"] == n
    if NATIVE:
        assert backward["quantize"] == QUANTIZE_CALLS_PER_LAYER * n


# --- models ----------------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, dtype=None):
        self.up = nnx.Linear(32, 64, dtype=dtype, rngs=rngs)
        self.mid = nnx.Linear(64, 64, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(64, 16, dtype=dtype, precision="highest", rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.mid(jax.nn.gelu(self.up(x)))))


def regression_batch(step: int, batch: int = 64):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(7), step), (batch, 32))
    w = jax.random.normal(jax.random.key(8), (32, 16)) / np.sqrt(32)
    return x, jnp.tanh(x @ w)


# --- rules -----------------------------------------------------------------------------------


def test_rules_match_by_path_and_the_first_wins():
    rules = [Rule("lm_head", None), Rule(r"mlp/", NO_SR), Rule(".*", NVFP4Recipe())]
    assert match_rule(rules, "lm_head") == (0, rules[0])
    assert match_rule(rules, "layers/3/mlp/down_proj") == (1, rules[1])
    assert match_rule(rules, "layers/3/self_attn/q_proj") == (2, rules[2])
    assert match_rule(rules[:2], "layers/3/self_attn/q_proj") is None
    assert Rule(pattern="^mlp$", recipe=None).matches("mlp")
    assert not Rule("^mlp$", None).matches("layers/0/mlp")
    assert keep_bf16("a", "b") == [Rule("a", None), Rule("b", None)]
    assert Rule("x", NO_SR) == Rule("x", NO_SR) and hash(Rule("x", None)) == hash(Rule("x", None))


def test_default_rules_follow_the_paper():
    rules = default_rules(6, first=1, last=2)

    def recipe(path):
        return match_rule(rules, path)[1].recipe

    for path in ("lm_head", "embed_tokens", "model/embedding", "head", "model/head"):
        assert recipe(path) is None, path
    assert recipe("layers/2/attention/output/dense") is not None
    blocks = [recipe(f"layers/{i}/mlp/up_proj") for i in range(6)]
    assert [r is None for r in blocks] == [True, False, False, False, True, True]
    assert blocks[1] == NVFP4Recipe()
    # linen names blocks `layers_3`; block 1 is not block 10 or 11.
    assert recipe("layers_4/mlp/up_proj") is None and recipe("layers_1/mlp/up_proj") is not None
    rules = default_rules(12, first=1, last=0)
    assert match_rule(rules, "layers/10/attn/q")[1].recipe is not None
    assert match_rule(rules, "heads_proj")[1].recipe is not None  # "head" is a whole name
    assert default_rules(4, first=0, last=0, recipe=NO_SR)[-1] == Rule(".*", NO_SR)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Rule("[", None), ValueError, re.escape("Rule(pattern='[', recipe=None)")),
        (lambda: Rule(3, None), TypeError, "pattern must be a str"),
        (lambda: Rule("x", "bf16"), TypeError, re.escape("Rule(pattern='x', recipe='bf16')")),
        (lambda: check_rules([Rule("x", None), "y"]), TypeError, r"rules\[1\]"),
        (lambda: check_rules(Rule("x", None)), TypeError, "sequence of Rule"),
        (lambda: default_rules(2, first=2, last=1), ValueError, "exceeds num_layers"),
        (lambda: default_rules(2, first=-1), ValueError, "first must be"),
        (lambda: default_rules(2, layer_pattern="layers/"), ValueError, "layer_pattern"),
        (lambda: quantize_model(nnx.Linear, []), TypeError, "model must be"),
        (lambda: quantize_model(MLP(nnx.Rngs(0)), [("x", None)]), TypeError, r"rules\[0\]"),
        (
            lambda: quantize_model(MLP(nnx.Rngs(0)), [], rngs=nnx.Rngs(params=0)),
            ValueError,
            "rngs has neither",
        ),
        (lambda: quantized(None, []), TypeError, "fn must be callable"),
    ],
)
def test_errors_name_the_argument(make, error, message):
    with pytest.raises(error, match=message):
        make()


# --- nnx ---------------------------------------------------------------------------------------


def test_quantize_model_keeps_parameters_bit_for_bit():
    model = MLP(nnx.Rngs(0), dtype=jnp.bfloat16)
    before = {
        path: (layer, layer.kernel, layer.bias) for path, layer in named_layers(model).items()
    }
    values = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    report = quantize_model(model, [Rule("up|down", NO_SR)], rngs=nnx.Rngs(quantize=3))
    assert report.paths("nvfp4") == ["down", "up"] and report.paths("unmatched") == ["mid"]
    assert model.mid is before["mid"][0]  # unmatched: untouched
    for path in ("up", "down"):
        old, kernel, bias = before[path]
        new = getattr(model, path)
        assert type(new) is nvfp4_jax.nnx.Linear and new.recipe == NO_SR
        assert new.kernel is kernel and new.bias is bias  # the same variable objects
        for name in ("dtype", "param_dtype", "precision", "preferred_element_type"):
            assert getattr(new, name) == getattr(old, name), name
        assert (new.in_features, new.out_features) == (old.in_features, old.out_features)
    assert model.down.precision == "highest" and model.up.dtype == jnp.bfloat16
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, values, after)
    assert report["up"].rule == 0 and report["up"].recipe == NO_SR
    assert report.to_dict()["up"]["recipe"]["gemm_dtype"] == "bfloat16"
    assert "rules[0] 'up|down'" in str(report)


def test_none_rules_turn_nvfp4_layers_back_and_repeats_change_nothing():
    model = MLP(nnx.Rngs(0))
    quantize_model(model, [Rule(".*", NVFP4Recipe())])
    up, kernel = model.up, model.up.kernel
    again = quantize_model(model, [Rule(".*", NVFP4Recipe())])
    assert model.up is up and again.paths("nvfp4") == ["down", "mid", "up"]
    back = quantize_model(model, keep_bf16("up"))
    assert type(model.up) is nnx.Linear and model.up.kernel is kernel
    assert back["up"].action == "high_precision" and back["down"].action == "unmatched"
    assert type(model.down) is nvfp4_jax.nnx.Linear


class Odd(nnx.Module):
    def __init__(self, rngs):
        shared = nnx.Linear(32, 32, rngs=rngs)
        self.blocks = nnx.List([shared, nnx.Linear(32, 24, rngs=rngs)])
        self.again = shared  # one layer, two paths
        self.lora = nnx.LoRALinear(32, 32, lora_rank=2, rngs=rngs)
        self.frozen = nvfp4_jax.nnx.Linear.from_quantized(
            nvfp4_jax.quantize(jnp.ones((32, 16)), axis=0)
        )


def test_shared_odd_shaped_and_frozen_layers():
    model = Odd(nnx.Rngs(0))
    report = quantize_model(model, [Rule(".*", NVFP4Recipe())])
    assert model.blocks[0] is model.again and type(model.again) is nvfp4_jax.nnx.Linear
    assert report["again"].action == "nvfp4" and report["again"].aliases == ("blocks/0",)
    assert report["blocks/0"] is report["again"] and list(report.layers)[0] == "again"
    odd = report["blocks/1"]
    assert odd.action == "skipped" and "out_features=24" in odd.reason
    assert type(model.blocks[1]) is nnx.Linear
    assert report["frozen"].action == "skipped" and "from_quantized" in report["frozen"].reason
    assert report["lora"].action == "skipped" and "LoRALinear" in report["lora"].reason
    assert type(model.lora) is nnx.LoRALinear


def test_jaxpr_holds_the_nvfp4_gemms_of_matched_layers_only():
    model = MLP(nnx.Rngs(0))
    x = jnp.ones((16, 32))
    assert_nvfp4_layers(nnx_jaxprs(model, x), 0)
    quantize_model(model, [Rule("mid", None), Rule(".*", NVFP4Recipe())])
    assert_nvfp4_layers(nnx_jaxprs(model, x), 2)


def test_a_plain_nnx_mlp_trains_in_nvfp4():
    model = MLP(nnx.Rngs(0))
    report = quantize_model(model, [Rule(".*", NVFP4Recipe())], rngs=nnx.Rngs(quantize=5))
    assert len(report.paths("nvfp4")) == 3
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    count = int(model.up.quantize_rngs.count[...])
    losses = [float(step(model, optimizer, *regression_batch(i))) for i in range(60)]
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:3]), losses
    assert int(model.up.quantize_rngs.count[...]) == count + 60  # a fresh SR key per step


def test_the_example_llama_built_in_bf16_trains_in_nvfp4():
    cfg = lm_model.LMConfig(vocab=64, width=32, depth=1, heads=2, recipe=None)
    model = lm_model.TransformerLM(cfg, nnx.Rngs(0))
    report = quantize_model(model, default_rules(cfg.depth, first=0, last=0))
    assert report["lm_head"].action == "high_precision"
    assert set(report.paths("nvfp4")) == {
        f"layers/0/{name}"
        for name in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj")
        + ("self_attn/o_proj", "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
    }
    assert type(model.layers[0].mlp.down_proj) is nvfp4_jax.nnx.Linear
    assert model.layers[0].mlp.down_proj.dtype == jnp.bfloat16
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lm_model.loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    batch = jax.random.randint(jax.random.key(0), (8, 33), 0, cfg.vocab)
    losses = [float(step(model, optimizer, batch)) for _ in range(8)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses


# --- einsum --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "shape", "message"),
    [
        ("hd,hdk->hk", (2, 32, 16), "batch dimension"),
        ("bd,dk->b", (32, 16), "summed"),
        ("bd,dk", (32, 16), "explicit form"),
        ("bdd,dk->bk", (32, 16), "repeat"),
        ("bd,ek->bdek", (32, 16), "no dimension is contracted"),
        ("bd,dk->bk", (32, 24), "N=24"),
        ("bd,...k->bk", (32, 16), "ellipsis in the kernel"),
    ],
)
def test_einsum_plan_says_why_a_contraction_is_not_dense(spec, shape, message):
    with pytest.raises(ValueError, match=message):
        einsum_plan(spec, shape)


def test_nvfp4_einsum_computes_the_einsum_and_converts_nnx_einsum():
    op = NVFP4Einsum(NO_SR)
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))
    w = jax.random.normal(jax.random.key(1), (2, 16, 32))  # (h, e, d): contract d

    @jax.jit
    def both(x, w):
        return op("btd,hed->bteh", x, w), op("...d,hed->...he", x, w)

    (got, ellipsis), exact = both(x, w), jnp.einsum("btd,hed->bteh", x, w)
    assert got.shape == exact.shape and ellipsis.shape == (2, 16, 2, 16)
    assert float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact)) < 0.2
    np.testing.assert_array_equal(ellipsis, jnp.swapaxes(got, 2, 3))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Einsum("btd,dhe->bthe", (32, 2, 16), (2, 16), rngs=rngs)
            self.batched = nnx.Einsum("bhd,hde->bhe", (2, 32, 16), rngs=rngs)

        def __call__(self, x):
            return self.proj(x).sum(-1) + self.batched(x[:, :2]).sum()

    model = Model(nnx.Rngs(0))
    kernel = model.proj.kernel
    report = quantize_model(model, [Rule(".*", NVFP4Recipe())])
    assert report["proj"].action == "nvfp4" and model.proj.kernel is kernel
    assert report["batched"].action == "skipped" and "batch" in report["batched"].reason
    assert isinstance(model.proj.einsum_op, NVFP4Einsum)
    assert_nvfp4_layers(nnx_jaxprs(model, x), 1)
    quantize_model(model, keep_bf16("proj"))
    assert model.proj.einsum_op is jnp.einsum


# --- linen -------------------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.gelu(nn.Dense(64, name="up")(x))
        x = jax.nn.gelu(nn.DenseGeneral(64, name="mid")(x))
        x = nn.Einsum((64, 32), "bd,dk->bk", name="proj")(x)
        return nn.Dense(16, name="down")(x)


def linen_jaxprs(apply, params, x):
    def loss(params):
        return jnp.mean(apply(params, x) ** 2)

    forward = jax.make_jaxpr(loss)(params).jaxpr
    return nvfp4_calls(forward), nvfp4_calls(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)


def test_linen_rules_intercept_matched_layers_and_keep_parameters():
    model = LinenMLP()
    x = jnp.ones((16, 32))
    params = jax.jit(model.init)(jax.random.key(0), x)
    rules = [Rule("^mid$", None), Rule(".*", NVFP4Recipe())]
    with quantize_linen(rules) as report:
        quantized_params = jax.jit(model.init)(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, params, quantized_params)
    assert report.paths("nvfp4") == ["up", "proj", "down"]
    assert report["mid"].action == "high_precision" and report["proj"].layer == "Einsum"
    assert_nvfp4_layers(linen_jaxprs(model.apply, params, x), 0)
    assert_nvfp4_layers(linen_jaxprs(quantized(model.apply, rules), params, x), 3)
    unmatched = quantized(model.apply, keep_bf16("up", "proj"))
    assert_nvfp4_layers(linen_jaxprs(unmatched, params, x), 0)


def test_linen_layers_that_cannot_be_quantized_are_reported():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.DenseGeneral(16, batch_dims=(0,), name="batched")(x)
            return nn.Dense(24, name="odd")(y)

    x = jnp.ones((2, 16, 32))
    params = jax.eval_shape(Model().init, jax.random.key(0), x)
    with quantize_linen([Rule(".*", NVFP4Recipe())]) as report:
        jax.eval_shape(Model().apply, params, x)
    assert "batch_dims" in report["batched"].reason and "N=24" in report["odd"].reason
    assert report.paths("skipped") == ["batched", "odd"]


def test_a_plain_linen_mlp_trains_in_nvfp4():
    model, tx = LinenMLP(), optax.adam(1e-2)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((64, 32)))
    opt_state = tx.init(params)
    apply = quantized(model.apply, [Rule(".*", NVFP4Recipe())])

    @jax.jit
    def step(params, opt_state, x, y, key):
        def loss_fn(p):
            return jnp.mean((apply(p, x, rngs={"quantize": key}) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(60):
        key = jax.random.fold_in(jax.random.key(3), i)
        params, opt_state, loss = step(params, opt_state, *regression_batch(i), key)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:3]), losses
