"""Reliability round 3: layers behind nnx transforms, nvfp4_dot_general layers, tied and stacked.

* `inspect_model` taps layers that the model runs through `nnx.remat`, `nnx.scan` (over a
  stacked layer axis) and `nnx.jit`; a plain model's numbers are unchanged.
* A `recipe=None` rule puts a layer built with `dot_general=nvfp4_dot_general()` back in high
  precision (nnx and linen), bit for bit the plain layer; a rule with a recipe uses that one.
* A layer held at two paths (a tied head) is reported with both; rules that disagree on it
  are an error. A stacked `nnx.Linear` (made under `nnx.vmap`, run under `nnx.scan`) is
  quantized: forward and gradient equal a loop over unstacked NVFP4 layers, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe, nvfp4_dot_general
from nvfp4_jax._src.model.convert.linen import quantize_linen
from nvfp4_jax._src.model.convert.nnx import quantize_model
from nvfp4_jax._src.model.convert.rules import Rule
from nvfp4_jax._src.model.diagnostics.inspection import inspect_model

RTN = NVFP4Recipe(stochastic_rounding=False)
ALL_RTN = [Rule(".*", RTN)]
LAYERS = 3


def batch(shape=(2, 16, 32), seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def loss(model, x):
    return jnp.mean(jnp.square(model(x).astype(jnp.float32)))


@nnx.jit
def output_and_grads(model, x):
    """The output and the gradient of `loss` (the output, not the scalar loss: the order of
    its reduction is up to XLA's fusion, which differs between a scan and a loop)."""

    def with_output(model):
        y = model(x)
        return jnp.mean(jnp.square(y.astype(jnp.float32))), y

    (_, y), grads = nnx.value_and_grad(with_output, has_aux=True)(model)
    return y, grads


# --- models --------------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class Stacked(nnx.Module):
    """Flax's "scan over layers": blocks made under nnx.vmap, run with nnx.scan."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


class Unrolled(nnx.Module):
    """The same blocks, one module each, run in a Python loop."""

    def __init__(self, stacked: Stacked):
        abstract = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
        graphdef, _ = nnx.split(abstract)
        state = nnx.state(stacked.blocks)
        self.layers = nnx.List(
            [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(LAYERS)]
        )

    def __call__(self, x):
        for block in self.layers:
            x = block(x)
        return x


class Remat(nnx.Module):
    def __init__(self, rngs, remat: bool):
        self.a = nnx.Linear(32, 32, rngs=rngs)
        self.b = nnx.Linear(32, 32, rngs=rngs)
        self.remat = remat

    def __call__(self, x):
        def first(layer, x):
            return jax.nn.gelu(layer(jax.nn.gelu(layer(x))))

        if self.remat:
            first = nnx.remat(first)
        return self.b(first(self.a, x))


class Jitted(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(32, 32, rngs=rngs)
        self.b = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.jit(lambda layer, x: jax.nn.gelu(layer(x)))(self.a, x))


def stats_numbers(stats):
    """The numbers of a LayerStats that do not depend on the SR key."""
    operands = {
        k: (v.rel_error, v.underflow, v.saturated, v.amax) for k, v in stats.operands.items()
    }
    fields = ("tokens", "fprop_error", "dgrad_error_rtn", "wgrad_angle_rtn", "dgrad_error")
    return operands, {f: getattr(stats, f) for f in fields}


def assert_same_numbers(got, want, rtol=0.0):
    (got_ops, got_fields), (want_ops, want_fields) = stats_numbers(got), stats_numbers(want)
    for name in want_ops:
        np.testing.assert_allclose(got_ops[name], want_ops[name], rtol=rtol, err_msg=name)
    for name in want_fields:
        np.testing.assert_allclose(got_fields[name], want_fields[name], rtol=rtol, err_msg=name)


# --- 3: inspect_model through nnx transforms -----------------------------------------------------


def test_inspect_model_sees_layers_behind_nnx_remat_with_unchanged_numbers():
    x = batch()
    plain = inspect_model(Remat(nnx.Rngs(0), remat=False), x, rules=ALL_RTN, key=3)
    remat = inspect_model(Remat(nnx.Rngs(0), remat=True), x, rules=ALL_RTN, key=3)
    assert [s.path for s in remat.layers] == ["a", "b"] and remat["a"].tokens == 64
    for path in ("a", "b"):
        assert remat[path] == plain[path]  # every number, SR ones included
    assert remat.loss == plain.loss
    jitted = inspect_model(Jitted(nnx.Rngs(0)), x, rules=ALL_RTN)
    assert [s.path for s in jitted.layers] == ["a", "b"] and jitted["a"].tokens == 32


@pytest.mark.slow
def test_inspect_model_reports_each_slice_of_a_stacked_layer_under_nnx_scan():
    model = Stacked(nnx.Rngs(0))
    x = batch()
    report = inspect_model(model, x, rules=ALL_RTN, key=3)
    assert [s.path for s in report.layers] == [
        f"blocks/{name}[{i}]" for name in ("down", "up") for i in range(LAYERS)
    ]
    assert {s.module_path for s in report.layers} == {"blocks/down", "blocks/up"}
    unrolled = inspect_model(Unrolled(model), x, rules=ALL_RTN, key=3)
    for i in range(LAYERS):
        for name in ("up", "down"):
            assert_same_numbers(report[f"blocks/{name}[{i}]"], unrolled[f"layers/{i}/{name}"], 1e-5)
    np.testing.assert_allclose(report.loss, unrolled.loss, rtol=1e-6)
    # A slice among the worst keeps the stacked layer, the unit rules can name.
    worst = report.suggest_rules(0.01)[0]
    assert worst == Rule(f"^{report.layers[0].module_path}$", None) or worst.pattern in (
        "^blocks/down$",
        "^blocks/up$",
    )
    # The quantized stacked model is inspected as it trains: its own recipe, per slice.
    quantize_model(model, ALL_RTN)
    again = inspect_model(model, x, key=3)
    assert len(again.layers) == 2 * LAYERS and again.high_precision == ()


# --- 4: a recipe=None rule over a layer built with nvfp4_dot_general ------------------------------


class Head(nnx.Module):
    def __init__(self, rngs, dot_general=jax.lax.dot_general):
        self.head = nnx.Linear(32, 32, dot_general=dot_general, rngs=rngs)

    def __call__(self, x):
        return self.head(x)


def test_a_none_rule_puts_an_nnx_nvfp4_dot_general_layer_in_high_precision():
    x = batch()
    plain = Head(nnx.Rngs(0))
    built = Head(nnx.Rngs(0), dot_general=nvfp4_dot_general())
    assert not np.array_equal(built(x), plain(x))  # it computes in NVFP4
    # Inspected as it is, it is an NVFP4 layer (not listed as high precision).
    assert [s.path for s in inspect_model(built, x).layers] == ["head"]
    report = quantize_model(built, [Rule("head", None)])
    assert report["head"].action == "high_precision"
    np.testing.assert_array_equal(built(x), plain(x))
    np.testing.assert_array_equal(jax.jit(built)(x), jax.jit(plain)(x))
    # A rule with a recipe: the layer computes with the rule's recipe, not its own.
    built = Head(nnx.Rngs(0), dot_general=nvfp4_dot_general())
    report = quantize_model(built, ALL_RTN)
    assert report["head"].action == "nvfp4" and report["head"].recipe == RTN
    reference = Head(nnx.Rngs(0))
    quantize_model(reference, ALL_RTN)
    assert type(reference.head) is nvfp4_jax.nnx.Linear
    np.testing.assert_array_equal(built(x), reference(x))
    assert type(built.head) is nvfp4_jax.nnx.Linear and built.head.quantize_rngs is None


def test_a_none_rule_puts_a_linen_nvfp4_dot_general_dense_in_high_precision():
    x = batch()
    built, plain = nn.Dense(32, dot_general=nvfp4_dot_general()), nn.Dense(32)
    params = plain.init(jax.random.key(0), x)
    assert not np.array_equal(built.apply(params, x), plain.apply(params, x))
    with quantize_linen([Rule(".*", None)]) as report:
        y = built.apply(params, x)
    assert report[""].action == "high_precision"
    np.testing.assert_array_equal(y, plain.apply(params, x))
    with quantize_linen(ALL_RTN) as report:
        y = built.apply(params, x)
    assert report[""].recipe == RTN
    np.testing.assert_array_equal(y, nvfp4_jax.linen.Dense(32, recipe=RTN).apply(params, x))


# --- 12: tied and stacked layers ------------------------------------------------------------


class Tied(nnx.Module):
    def __init__(self, rngs):
        self.embed_proj = nnx.Linear(32, 32, rngs=rngs)
        self.body = nnx.Linear(32, 32, rngs=rngs)
        self.head = self.embed_proj  # one layer, two paths

    def __call__(self, x):
        return self.head(self.body(self.embed_proj(x)))


def test_a_tied_layer_is_reported_at_both_paths_and_conflicting_rules_raise():
    model = Tied(nnx.Rngs(0))
    report = quantize_model(model, [Rule("head", RTN), Rule("body", None)])
    entry = report["embed_proj"]
    assert entry.action == "nvfp4" and entry.aliases == ("head",) and report["head"] is entry
    assert "head" in report and "also at head" in str(report)
    assert model.head is model.embed_proj and type(model.head) is nvfp4_jax.nnx.Linear
    model = Tied(nnx.Rngs(0))
    rules = [Rule("^head$", None), Rule(".*", RTN)]
    for run in (
        lambda: quantize_model(model, rules),
        lambda: inspect_model(model, batch(), rules=rules),
    ):
        with pytest.raises(ValueError) as error:
            run()
        message = str(error.value)
        for part in ("'embed_proj'", "'head'", "rules[0]", "rules[1]", "'^head$'", "'.*'"):
            assert part in message, (part, message)
    assert type(model.head) is nnx.Linear and type(model.body) is nnx.Linear  # unchanged
    # Rules that agree (or a path no rule matches) are no conflict.
    agree = quantize_model(Tied(nnx.Rngs(0)), [Rule("^head$", RTN), Rule("^embed", RTN)])
    assert agree["head"].action == "nvfp4" and agree["body"].action == "unmatched"


def test_stacked_layers_are_quantized_and_equal_a_loop_of_unstacked_nvfp4_layers():
    model = Stacked(nnx.Rngs(0))
    unrolled = Unrolled(model)
    kernel = model.blocks.up.kernel
    report = quantize_model(model, ALL_RTN)
    assert report.paths("nvfp4") == ["blocks/down", "blocks/up"]
    assert report["blocks/up"].stack == (LAYERS,) and "stacked 3" in str(report)
    up = model.blocks.up
    assert type(up) is nvfp4_jax.nnx.Linear and up.kernel is kernel and up.recipe == RTN
    assert up.kernel.shape == (LAYERS, 32, 64) and up.input_amax.shape == (LAYERS,)
    assert quantize_model(unrolled, ALL_RTN).paths("nvfp4") == [
        f"layers/{i}/{name}" for i in range(LAYERS) for name in ("down", "up")
    ]
    x = batch()
    (got_y, got), (want_y, want) = output_and_grads(model, x), output_and_grads(unrolled, x)
    np.testing.assert_array_equal(got_y, want_y)
    for name in ("up", "down"):
        # The kernels' gradients (the NVFP4 dgrad and wgrad GEMMs), bit for bit.
        stacked = getattr(got["blocks"], name).kernel[...]
        loop = np.stack([getattr(want["layers"][i], name).kernel[...] for i in range(LAYERS)])
        np.testing.assert_array_equal(stacked, loop, err_msg=name)
        # The biases' are plain sums of dy over the tokens, summed in the order XLA's fusion
        # picks (which differs between a scan and a loop, NVFP4 or not).
        stacked = getattr(got["blocks"], name).bias[...]
        loop = np.stack([getattr(want["layers"][i], name).bias[...] for i in range(LAYERS)])
        np.testing.assert_allclose(stacked, loop, rtol=1e-5, atol=1e-7, err_msg=name)


def test_stacked_layers_keep_per_layer_sr_streams_and_calibration():
    model = Stacked(nnx.Rngs(0))
    quantize_model(model, [Rule(".*", NVFP4Recipe())], rngs=nnx.Rngs(quantize=1))
    stream = model.blocks.up.quantize_rngs
    assert stream.key.shape == (LAYERS,) and stream.count.shape == (LAYERS,)
    assert len({str(jax.random.key_data(k)) for k in stream.key[...]}) == LAYERS
    nvfp4_jax.nnx.calibrate(model)
    x = batch()
    output_and_grads(model, x)
    np.testing.assert_array_equal(stream.count[...], np.ones(LAYERS))  # one draw per layer
    amax = np.asarray(model.blocks.up.input_amax[...])
    assert amax.shape == (LAYERS,) and amax[0] == np.max(np.abs(np.asarray(x)))
    assert len(set(amax.tolist())) == LAYERS  # each layer its own input
