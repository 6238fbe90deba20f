"""The qwix provider (`nvfp4_jax.qwix`): one line, the numbers of `quantize_model` bit for bit.

The model is a small nnx LM with what qwix users write: `nnx.Linear` projections, attention
as two `jnp.einsum`s of activations (they stay in high precision), an output projection
`nnx.Einsum("bthe,hed->btd")` (two contracted axes, which `jnp.einsum` lists in another
order), a router and a dropless MoE block (`nvfp4_jax.nnx.Experts`, `recipe=None`: it calls
`jax.lax.ragged_dot`). The provider on the plain model must give, bit for bit, the losses
and every gradient of `nvfp4_jax.quantize_model` (stochastic rounding off: the layers' SR
keys come from their own streams) and of the drop-ins (`nvfp4_dot_general()`,
`NVFP4Einsum`, `Experts(recipe=...)`, all with `key=None`, stochastic rounding on).
"""

from __future__ import annotations

import re

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_bits

qwix = pytest.importorskip("qwix")
# Run again by the test command with the newest JAX (scripts/test.sh).
pytestmark = pytest.mark.newest

import nvfp4_jax  # noqa: E402
from nvfp4_jax import NVFP4Recipe, nvfp4_dot_general  # noqa: E402
from nvfp4_jax.qwix import NVFP4Provider, NVFP4Rule, search_pattern  # noqa: E402
from nvfp4_jax.rules import NVFP4Einsum, Rule, default_rules, quantize_linen  # noqa: E402

D, H, E, F, X, V = 32, 2, 16, 32, 4, 64
NO_SR = NVFP4Recipe(stochastic_rounding=False)
SR = NVFP4Recipe()
EDEN = NVFP4Recipe(backward="ms_eden")


def rules(recipe):
    return [Rule("gate", None), Rule("lm_head", None), Rule("", recipe)]


class Block(nnx.Module):
    def __init__(self, rngs, dot=None, einsum_op=None, experts_recipe=None):
        extra = {} if dot is None else {"dot_general": dot}
        self.q_proj = nnx.Linear(D, H * E, rngs=rngs, **extra)
        self.k_proj = nnx.Linear(D, H * E, rngs=rngs, **extra)
        self.v_proj = nnx.Linear(D, H * E, rngs=rngs, **extra)
        self.o_proj = nnx.Einsum(
            "bthe,hed->btd", (H, E, D), rngs=rngs, einsum_op=einsum_op or jnp.einsum
        )
        self.gate = nnx.Linear(D, X, use_bias=False, rngs=rngs)
        self.up = nvfp4_jax.nnx.Experts(X, D, F, recipe=None, rngs=rngs)
        self.down = nvfp4_jax.nnx.Experts(X, F, D, recipe=None, rngs=rngs)
        # The drop-in: the recipe without an SR stream, so key=None (the gradient's bits).
        self.up.recipe = self.down.recipe = experts_recipe

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).reshape(b, t, H, E) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = jnp.einsum("bthe,bshe->bhts", q, k) / np.sqrt(E)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        x = x + self.o_proj(jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(scores), v))
        tokens = x.reshape(-1, D)
        expert = jnp.argmax(self.gate(tokens), axis=-1)
        order = jnp.argsort(expert, stable=True)
        sizes = jnp.bincount(expert, length=X).astype(jnp.int32)
        h = self.down(jax.nn.silu(self.up(tokens[order], sizes)), sizes)
        y = jnp.zeros_like(h).at[order].set(h)
        return x + y.reshape(x.shape)


class LM(nnx.Module):
    def __init__(self, recipe=None, seed=0):
        rngs = nnx.Rngs(seed)
        dot = None if recipe is None else nvfp4_dot_general(recipe)
        einsum_op = None if recipe is None else NVFP4Einsum(recipe)
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.block = Block(rngs, dot, einsum_op, recipe)
        self.lm_head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        return self.lm_head(self.block(self.embed(tokens)))


TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, V)


def loss_fn(model, tokens=TOKENS):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def loss_and_grads(model):
    return nnx.value_and_grad(loss_fn)(model)


def params(grads) -> dict:
    """{path: gradient} of the parameters."""
    return {
        "/".join(str(k) for k in path): leaf[...]
        for path, leaf in nnx.to_flat_state(nnx.state(grads, nnx.Param))
    }


def assert_same_loss_and_grads(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert_same_bits(loss_a, loss_b, "loss")
    grads_a, grads_b = params(grads_a), params(grads_b)
    assert grads_a.keys() == grads_b.keys()
    for path in grads_a:
        assert_same_bits(grads_a[path], grads_b[path], path)


def qwix_lm(recipe, rngs=None, **provider_kwargs):
    provider = NVFP4Provider(rules(recipe), **provider_kwargs)
    extra = {} if rngs is None else {"rngs": rngs}
    return qwix.quantize_model(LM(), provider, TOKENS[:, :-1], **extra), provider


def test_equals_quantize_model_bit_for_bit():
    model, provider = qwix_lm(NO_SR)
    reference = LM()
    nvfp4_jax.quantize_model(reference, rules(NO_SR))
    got = loss_and_grads(model)
    assert_same_loss_and_grads(got, loss_and_grads(reference))
    # The NVFP4 GEMMs did something: the bf16 model's loss differs.
    assert float(got[0]) != float(loss_and_grads(LM())[0])


def test_equals_the_drop_ins_with_stochastic_rounding():
    model, _ = qwix_lm(SR)
    assert_same_loss_and_grads(loss_and_grads(model), loss_and_grads(LM(SR)))


def test_ms_eden_equals_the_drop_ins_and_draws_from_the_stream():
    # The MS-EDEN backward (dense, einsum and ragged_dot ops) through the provider: the
    # drop-ins' numbers with key=None, and fresh randomness from an rng stream each step.
    model, _ = qwix_lm(EDEN)
    assert_same_loss_and_grads(loss_and_grads(model), loss_and_grads(LM(EDEN)))
    model, _ = qwix_lm(EDEN, rngs=nnx.Rngs(sr=0), rng_stream="sr")
    model.set_attributes(qwix_rngs=nnx.Rngs(sr=1))
    first, second = (params(nnx.grad(loss_fn)(model)) for _ in range(2))
    assert not np.array_equal(first["block/q_proj/kernel"], second["block/q_proj/kernel"])


def test_jitted_adam_steps_equal_the_drop_ins():
    def train(model, steps=4):
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        return [float(step(model, optimizer)) for _ in range(steps)]

    got, expected = train(qwix_lm(SR)[0]), train(LM(SR))
    assert got == expected and got[-1] < got[0]


def test_the_report_says_what_each_op_did():
    _, provider = qwix_lm(SR)
    report = provider.report
    nvfp4 = {"block/q_proj:dot_general0", "block/o_proj:einsum0", "block/up:ragged_dot0"}
    assert nvfp4 <= set(report.paths("nvfp4"))
    assert report["block/gate:dot_general0"].action == "high_precision"
    assert report["lm_head:dot_general0"].action == "high_precision"
    attention = report["block:einsum0"]
    assert attention.action == "skipped" and "activations only" in attention.reason
    assert report["block/q_proj:dot_general0"].recipe == SR
    assert "block/o_proj:einsum0" in str(report)


def test_rules_convert_search_to_fullmatch():
    for pattern, path in [
        ("mlp/", "layers/3/mlp/down_proj"),
        ("^lm_head$", "lm_head"),
        ("^lm_head$", "x/lm_head"),
        ("head", "lm_head"),
        ("", "anything"),
        ("a|b", "xbx"),
        (r"layers[/_](\d+)/", "layers/12/attn"),
        # Global inline flags, which must open the expression.
        ("(?i)LM_HEAD", "model/lm_head"),
        ("(?i)LM_HEAD", "model/mlp"),
        ("(?i)(?s)^Model", "model/lm_head"),
        ("(?i)(?s)^Model", "x/model"),
        ("(?x) lm_head  # the output head", "model/lm_head"),
        ("(?x) lm_head  # the output head", "model/lmhead"),
        ("(?ix) LM _ HEAD $", "model/lm_head"),
    ]:
        expected = re.search(pattern, path) is not None
        assert (re.fullmatch(search_pattern(pattern), path) is not None) == expected, pattern
    converted = NVFP4Provider(default_rules(4))._rules
    assert all(isinstance(rule, NVFP4Rule) for rule in converted)
    assert [rule.recipe is None for rule in converted] == [
        rule.recipe is None for rule in default_rules(4)
    ]


def test_rules_with_inline_flags_match_as_rule_does():
    flagged = [Rule("(?i)GATE", None), Rule("(?i)LM_HEAD", None), Rule("", NO_SR)]
    provider = NVFP4Provider(flagged)
    qwix.quantize_model(LM(), provider, TOKENS[:, :-1])
    assert provider.report["lm_head:dot_general0"].action == "high_precision"
    assert provider.report["block/gate:dot_general0"].action == "high_precision"
    assert provider.report["block/q_proj:dot_general0"].action == "nvfp4"
    with pytest.raises(ValueError, match="search_pattern: '\\(' is not a regular expression"):
        search_pattern("(")


def test_plain_qwix_rules_keep_qwix_behaviour():
    """A plain qwix rule before the NVFP4 one: its ops are qwix's int8 (not NVFP4, not bf16)."""
    int8 = qwix.QtRule(module_path=".*q_proj.*", weight_qtype="int8", act_qtype="int8")
    provider = NVFP4Provider([int8, *[NVFP4Rule.from_rule(r) for r in rules(NO_SR)]])
    model = qwix.quantize_model(LM(), provider, TOKENS[:, :-1])
    assert "block/q_proj:dot_general0" not in provider.report
    assert "block/k_proj:dot_general0" in provider.report.paths("nvfp4")
    loss, _ = loss_and_grads(model)
    assert float(loss) != float(loss_and_grads(qwix_lm(NO_SR)[0])[0])


def test_rng_stream_draws_fresh_keys_per_step():
    model, _ = qwix_lm(SR, rngs=nnx.Rngs(sr=0), rng_stream="sr")
    model.set_attributes(qwix_rngs=nnx.Rngs(sr=1))  # qwix's way to hand an nnx model rngs
    first = params(nnx.grad(loss_fn)(model))
    second = params(nnx.grad(loss_fn)(model))  # the stream advanced: other rounding
    other = params(nnx.grad(loss_fn)(LM(SR)))  # key=None: other rounding again
    path = "block/q_proj/kernel"
    assert not np.array_equal(first[path], second[path])
    assert not np.array_equal(first[path], other[path])


# --- linen -------------------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.gelu(nn.Dense(64, name="up")(x))
        x = jax.nn.gelu(nn.DenseGeneral((2, 32), name="mid")(x))
        x = nn.Einsum((2, 32, 32), "bhd,hde->be", name="proj")(x)
        return nn.Dense(16, name="down")(x)


def test_linen_equals_quantize_linen_bit_for_bit():
    x = jax.random.normal(jax.random.key(1), (32, 48))
    model = LinenMLP()
    variables = model.init(jax.random.key(2), x)

    def loss(apply):
        return lambda v: jnp.sum(jnp.sin(apply(v, x)))

    qmodel = qwix.quantize_model(model, NVFP4Provider([Rule("", NO_SR)]))
    with quantize_linen([Rule("", NO_SR)]):
        expected = jax.jit(jax.value_and_grad(loss(model.apply)))(variables)
    got = jax.jit(jax.value_and_grad(loss(qmodel.apply)))(variables)
    assert_same_bits(got[0], expected[0], "loss")
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(expected[1]), strict=True
    ):
        assert_same_bits(a, b, jax.tree_util.keystr(path))
    assert float(got[0]) != float(jax.value_and_grad(loss(model.apply))(variables)[0])


def test_linen_rng_stream():
    x = jax.random.normal(jax.random.key(1), (32, 48))
    model = LinenMLP()
    variables = model.init(jax.random.key(2), x)
    qmodel = qwix.quantize_model(model, NVFP4Provider([Rule("", SR)], rng_stream="sr"))

    def grad(seed):
        def fn(v):
            return jnp.sum(jnp.sin(qmodel.apply(v, x, rngs={"sr": jax.random.key(seed)})))

        return jax.grad(fn)(variables)["params"]["up"]["kernel"]

    assert_same_bits(grad(3), grad(3), "same key")
    assert not np.array_equal(grad(3), grad(4))


# --- what qwix intercepts ----------------------------------------------------------------------


HIGH_PRECISION_FORWARD = NVFP4Recipe(fprop=False, stochastic_rounding=False)


class HighPrecisionForward(nnx.Module):
    """An nvfp4_jax layer whose own recipe computes the forward in high precision."""

    def __init__(self, k, n, recipe=HIGH_PRECISION_FORWARD):
        self.lin = nvfp4_jax.nnx.Linear(k, n, recipe=recipe, use_bias=False, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x)


def high_precision_product(x, w):
    return jax.lax.dot_general(x, w, DIMS, preferred_element_type=jnp.float32)


DIMS = (((1,), (0,)), ((), ()))
NVFP4_EVERYWHERE = [NVFP4Rule(recipe=NO_SR)]


def test_a_trace_made_inside_qwix_is_not_reused_outside():
    """qwix's patched `jax.lax.dot_general` must not leak into nvfp4_jax's cached traces.

    The shapes are this test's own, so the first trace of the layer's GEMM is made while
    qwix intercepts (inside `quantize_model`'s first call).
    """
    x = jax.random.normal(jax.random.key(3), (24, 80))
    model = HighPrecisionForward(80, 48)
    qmodel = qwix.quantize_model(model, NVFP4Provider(NVFP4_EVERYWHERE), x)
    w = model.lin.kernel[...]
    expected = high_precision_product(x, w)
    # The layer's recipe decides inside qwix too: its forward is high precision.
    np.testing.assert_allclose(qmodel(x), expected, rtol=1e-6, atol=1e-6)
    # And outside: the model, and the drop-in with the same recipe and shapes.
    np.testing.assert_allclose(model(x), expected, rtol=1e-6, atol=1e-6)
    y = nvfp4_jax.dot_general(x, w, DIMS, recipe=model.lin.recipe)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    step = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(step(model, x), expected, rtol=1e-6, atol=1e-6)


def test_a_trace_made_outside_is_not_reused_inside():
    """Traced outside first, then inside at the same and at new shapes: one result."""
    model = HighPrecisionForward(96, 32)
    w = model.lin.kernel[...]
    x = jax.random.normal(jax.random.key(4), (40, 96))
    np.testing.assert_allclose(model(x), high_precision_product(x, w), rtol=1e-6, atol=1e-6)
    qmodel = qwix.quantize_model(model, NVFP4Provider(NVFP4_EVERYWHERE), x)
    for batch in (40, 56):  # the traced shape, and one traced first inside qwix
        x = jax.random.normal(jax.random.key(batch), (batch, 96))
        expected = high_precision_product(x, w)
        np.testing.assert_allclose(qmodel(x), expected, rtol=1e-6, atol=1e-6)
        jitted = nnx.jit(lambda m, x: m(x))(qmodel, x)
        np.testing.assert_allclose(jitted, expected, rtol=1e-6, atol=1e-6)


def test_qwix_quantizes_nothing_inside_an_nvfp4_op():
    """qwix's own int8 provider on a model of nvfp4_jax layers: they compute as their recipe.

    An interceptor reaching inside would quantize the high-precision forward of `fprop=False`
    (and the emulated NVFP4 GEMM's dequantized operands) to int8.
    """
    int8 = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")
    x = jax.random.normal(jax.random.key(5), (16, 112))
    model = HighPrecisionForward(112, 64)
    qmodel = qwix.quantize_model(model, qwix.QtProvider([int8]), x)
    expected = high_precision_product(x, model.lin.kernel[...])
    np.testing.assert_allclose(qmodel(x), expected, rtol=1e-6, atol=1e-6)
    model = HighPrecisionForward(112, 48, NVFP4Recipe(stochastic_rounding=False))
    qmodel = qwix.quantize_model(model, qwix.QtProvider([int8]), x)
    assert_same_bits(qmodel(x), model(x), "an NVFP4 layer under qwix int8")
    loss = lambda m: jnp.sum(jnp.sin(m(x)))  # noqa: E731
    got, expected = nnx.grad(loss)(qmodel), nnx.grad(loss)(model)
    assert_same_bits(got.lin.kernel[...], expected.lin.kernel[...], "wgrad")


class Square(nnx.Module):
    """Square layers, to be called on a square batch: activations of the kernels' shape."""

    def __init__(self, n, dtype, param_dtype):
        kw = {"dtype": dtype, "param_dtype": param_dtype}
        self.a = nnx.Linear(n, n, rngs=nnx.Rngs(0), **kw)
        self.b = nnx.Linear(n, n, rngs=nnx.Rngs(1), **kw)

    def __call__(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(
    "dtype, param_dtype",
    [(None, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)],
    ids=["f32", "bf16_on_f32_params", "f32_on_bf16_params"],
)
def test_the_weight_is_told_by_identity_not_shape(dtype, param_dtype):
    n = 64
    x = jax.random.normal(jax.random.key(6), (n, n))
    provider = NVFP4Provider(NVFP4_EVERYWHERE)
    qmodel = qwix.quantize_model(Square(n, dtype, param_dtype), provider, x)
    assert set(provider.report.paths("nvfp4")) == {"a:dot_general0", "b:dot_general0"}
    reference = Square(n, dtype, param_dtype)
    nvfp4_jax.quantize_model(reference, [Rule("", NO_SR)])
    expected = reference(x)
    assert_same_bits(qmodel(x), expected, "eager")
    assert_same_bits(nnx.jit(lambda m, x: m(x))(qmodel, x), expected, "nnx.jit")
    assert_same_bits(jax.jit(lambda x: qmodel(x))(x), expected, "params closed over")


def test_linen_square_layer_on_a_square_batch():
    x = jax.random.normal(jax.random.key(7), (64, 64))
    model = nn.Dense(64)
    variables = model.init(jax.random.key(8), x)
    provider = NVFP4Provider([Rule("", NO_SR)])
    got = qwix.quantize_model(model, provider).apply(variables, x)
    assert provider.report[":dot_general0"].action == "nvfp4"
    with quantize_linen([Rule("", NO_SR)]):
        expected = model.apply(variables, x)
    assert_same_bits(got, expected, "linen square")


class ShapeAlike(nnx.Module):
    """Multiplies by a value computed from its kernel and the input: of the kernel's shape."""

    def __init__(self, n):
        self.kernel = nnx.Param(jnp.eye(n))

    def __call__(self, x):
        return jax.lax.dot_general(x, self.kernel[...] + x, DIMS)


class OffsetNorm(nnx.Module):
    """A norm as MaxText writes it: an einsum with its vector scale plus an offset."""

    def __init__(self, n):
        self.scale = nnx.Param(jnp.zeros((n,)))

    def __call__(self, x):
        return jnp.einsum("...k,k->...k", x, self.scale[...] + 1.0)


def test_a_vector_parameter_plus_an_offset_is_no_weight_to_tell():
    x = jax.random.normal(jax.random.key(9), (8, 64))
    provider = NVFP4Provider(NVFP4_EVERYWHERE)
    qmodel = qwix.quantize_model(OffsetNorm(64), provider, x)
    assert provider.report[":einsum0"].action == "skipped"
    np.testing.assert_array_equal(qmodel(x), OffsetNorm(64)(x))


def test_an_operand_of_a_parameters_shape_that_is_not_it_is_refused():
    x = jnp.ones((32, 32))
    with pytest.raises(ValueError, match="has the shape of parameter 'kernel' but is not"):
        qwix.quantize_model(ShapeAlike(32), NVFP4Provider(NVFP4_EVERYWHERE), x)
    # Kept in high precision by a rule, it runs.
    qmodel = qwix.quantize_model(ShapeAlike(32), NVFP4Provider([NVFP4Rule(recipe=None)]), x)
    np.testing.assert_array_equal(qmodel(x), ShapeAlike(32)(x))


# --- errors ------------------------------------------------------------------------------------


def test_bad_rules_raise_clear_errors():
    with pytest.raises(ValueError, match="NVFP4Rule: weight_qtype='int8'"):
        NVFP4Rule(weight_qtype="int8")
    with pytest.raises(TypeError, match="recipe must be an NVFP4Recipe or None"):
        NVFP4Rule(recipe="nvfp4")
    with pytest.raises(TypeError, match="rng_stream must be a str"):
        NVFP4Rule(rng_stream=0)
    with pytest.raises(ValueError, match="module_path '\\(' is not a regular expression"):
        NVFP4Rule(module_path="(")
    with pytest.raises(TypeError, match="rules must be a sequence of rules"):
        NVFP4Provider(Rule("", SR))
    with pytest.raises(TypeError, match=r"rules\[1\] must be an NVFP4Rule"):
        NVFP4Provider([NVFP4Rule(), "mlp"])
