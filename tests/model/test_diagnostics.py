"""NVFP4 diagnostics: the numbers against a direct computation, the report's forms, rules.

The direct computation quantizes x, W and dy with `nvfp4_jax.quantize` as the recipe does
(docs/NUMERICS.md) and measures in NumPy (f64 where it sums): relative errors, the share of
underflowing blocks (scale 0, values not all 0), the share of saturated values
(`|x| * enc_b > 6`, `enc_b = 1 / (s_b / S_enc)`), the amax, and the products.
"""

from __future__ import annotations

import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rich.console import Console

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe
from nvfp4_jax._src.model.convert.nnx import quantize_model
from nvfp4_jax._src.model.convert.rules import Rule, check_rules
from nvfp4_jax.diagnostics import ModelReport, analyze_layer, inspect_model

FLT_MAX = np.float32(np.finfo(np.float32).max)
RULES = [Rule("^c$", None), Rule(".*", NVFP4Recipe())]
KEY = jax.random.key(11)


class Net(nnx.Module):
    """`a` runs twice, `c` is kept in high precision by RULES, `odd` cannot be NVFP4."""

    def __init__(self, rngs):
        self.a = nnx.Linear(32, 32, rngs=rngs)
        self.b = nnx.Linear(32, 32, rngs=rngs)
        self.c = nnx.Linear(32, 32, rngs=rngs)
        self.odd = nnx.Linear(32, 24, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.gelu(self.a(jax.nn.gelu(self.a(x))))
        return self.odd(self.c(jax.nn.gelu(self.b(x))))


def net_input():
    """(2, 16, 32) with one huge value: blocks of small values elsewhere underflow."""
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    x = x.at[0, 0, 0].set(3e6)
    return x.at[1, 3:6].multiply(1e-4)


def snapshot(model):
    return nnx.graphdef(model), jax.tree.map(np.asarray, nnx.state(model))


@pytest.fixture(scope="module")
def run():
    model = Net(nnx.Rngs(0))
    before = snapshot(model)
    layers = {name: getattr(model, name) for name in ("a", "b", "c", "odd")}
    report = inspect_model(model, net_input(), rules=RULES, key=KEY)
    return model, before, layers, report


# --- the direct computation ----------------------------------------------------------------------


def direct_operand(x, **flags):
    """(rel_error, underflow, saturated, amax) of `x` quantized along its last axis."""
    q = nvfp4_jax.quantize(x, axis=-1, **flags)
    x = np.asarray(x, np.float32)
    rel = np.linalg.norm(np.asarray(q.dequantize(jnp.float32), np.float64) - x) / np.linalg.norm(
        x.astype(np.float64)
    )
    stored = np.asarray(nvfp4_jax.apply_rht(jnp.asarray(x)) if flags.get("rht") else x)
    blocks = np.abs(stored).reshape(*q.scales.shape, 16)
    scales = np.asarray(q.scales.astype(jnp.float32))
    amax = np.float32(q.amax)
    underflow = np.mean((scales == 0) & (blocks.max(-1) > 0))
    s_dec = np.float32(1) / np.minimum(np.float32(2688) / amax, FLT_MAX)
    with np.errstate(divide="ignore", over="ignore"):
        encode = np.minimum(np.float32(1) / (scales * s_dec), FLT_MAX)
        saturated = np.mean((blocks * encode[..., None] > 6) & (scales > 0)[..., None])
    return rel, underflow, saturated, amax


def deq(x, **flags):
    return np.asarray(nvfp4_jax.quantize(x, **flags).dequantize(jnp.float32), np.float64)


def angle(a, b):
    cos = np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b))
    return np.degrees(np.arccos(np.clip(cos, -1, 1)))


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def direct_layer(x, w, dy, key):
    """The LayerStats numbers of NVFP4Recipe() for 2-D x (M, K), w (K, N), dy (M, N)."""
    dgrad_key, wgrad_key = jax.random.split(key)
    sr = dict(stochastic_rounding=True)
    operands = {
        "x": direct_operand(x),
        "w": direct_operand(w.T, block_2d=True),
        "dy": direct_operand(dy, key=dgrad_key, **sr),
        "x_wgrad": direct_operand(x.T, rht=True),
        "dy_wgrad": direct_operand(dy.T, rht=True, key=wgrad_key, **sr),
    }
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    w_q = deq(w, axis=0, block_2d=True)
    x_t = deq(x, axis=0, rht=True)
    dw = x64.T @ dy64
    numbers = {
        "fprop_error": relative(deq(x) @ w_q, x64 @ w64),
        "dgrad_error_sr": relative(deq(dy, key=dgrad_key, **sr) @ w_q.T, dy64 @ w64.T),
        "dgrad_error_rtn": relative(deq(dy) @ w_q.T, dy64 @ w64.T),
        "wgrad_angle_sr": angle(x_t.T @ deq(dy, axis=0, rht=True, key=wgrad_key, **sr), dw),
        "wgrad_angle_rtn": angle(x_t.T @ deq(dy, axis=0, rht=True), dw),
    }  # fmt: skip
    return operands, numbers


def assert_stats_match(stats, operands, numbers, rtol):
    for name, (rel, underflow, saturated, amax) in operands.items():
        got = stats.operands[name]
        np.testing.assert_allclose(got.rel_error, rel, rtol=rtol, err_msg=name)
        np.testing.assert_allclose(got.underflow, underflow, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got.saturated, saturated, atol=2e-3, err_msg=name)
        np.testing.assert_allclose(got.amax, amax, rtol=1e-6, err_msg=name)
    for name, value in numbers.items():
        tolerance = dict(atol=0.02) if "angle" in name else dict(rtol=rtol)
        np.testing.assert_allclose(getattr(stats, name), value, err_msg=name, **tolerance)
    assert stats.wgrad_angle == stats.wgrad_angle_sr and stats.dgrad_error == stats.dgrad_error_sr


def test_analyze_layer_matches_the_direct_computation():
    x = net_input().reshape(32, 32)
    w = jax.random.normal(jax.random.key(2), (32, 32))
    dy = jax.random.normal(jax.random.key(3), (32, 32)) * 1e-3
    stats = analyze_layer(x, w, dy, key=KEY, path="layer")
    operands, numbers = direct_layer(x, w, dy, KEY)
    assert_stats_match(stats, operands, numbers, rtol=1e-4)
    assert stats.operands["x"].underflow > 0.05  # the outlier's tensor scale flushes blocks
    assert stats.operands["w"].underflow == 0 and stats.operands["w"].saturated > 0
    assert (stats.tokens, stats.in_features, stats.out_features) == (32, 32, 32)
    # SR is unbiased but noisier than round-to-nearest on one draw.
    assert stats.dgrad_error_sr > stats.dgrad_error_rtn


def test_inspect_model_captures_the_operands_of_every_analyzed_layer(run):
    model, _, _, report = run
    assert [stats.path for stats in report.layers] == ["a", "b"]
    assert report.high_precision == ("c",) and "out_features=24" in report.skipped["odd"]
    assert report["a"].tokens == 64  # two calls of 32 tokens
    # Layer b, from the model's own pass: x is b's input and dy its output gradient.
    x = jax.nn.gelu(model.a(jax.nn.gelu(model.a(net_input())))).reshape(32, 32)
    y = model.b(x)

    def rest(y):
        return jnp.mean(model.odd(model.c(jax.nn.gelu(y))) ** 2)

    dy = jax.grad(rest)(y)
    stats = report["b"]
    operands, numbers = direct_layer(x, model.b.kernel[...], dy, jax.random.fold_in(KEY, 1))
    assert_stats_match(stats, operands, numbers, rtol=2e-3)
    np.testing.assert_allclose(report.loss, jnp.mean(model(net_input()) ** 2), rtol=1e-5)


def test_the_model_is_unchanged(run):
    model, (graphdef, state), layers, _ = run
    after_graphdef, after_state = snapshot(model)
    assert after_graphdef == graphdef
    jax.tree.map(np.testing.assert_array_equal, state, after_state)
    for name, layer in layers.items():
        assert getattr(model, name) is layer and type(layer) is nnx.Linear


def test_an_nvfp4_model_is_inspected_as_it_trains(run):
    *_, hp_report = run
    model = Net(nnx.Rngs(0))
    quantize_model(model, RULES, rngs=nnx.Rngs(quantize=4))
    count = int(model.a.quantize_rngs.count[...])
    report = inspect_model(model, net_input(), key=KEY)  # every NVFP4 Linear
    assert [stats.path for stats in report.layers] == ["a", "b"]
    assert report.high_precision == ("c", "odd") and not report.skipped
    assert int(model.a.quantize_rngs.count[...]) == count  # the pass ran on a copy
    # The forward through NVFP4 layers changes b's input only slightly.
    np.testing.assert_allclose(
        report["b"].operands["x"].amax, hp_report["b"].operands["x"].amax, rtol=0.1
    )


class Two(nnx.Module):
    def __init__(self, rngs):
        self.used = nnx.Linear(32, 32, rngs=rngs)
        self.unused = nnx.Linear(32, 32, rngs=rngs)


def test_custom_loss_static_inputs_and_errors():
    model = Two(nnx.Rngs(0))
    x = jnp.ones((32, 32))  # layer b's shapes: its compiled analysis is reused

    def loss_fn(model, batch, scale):
        return jnp.sum(model.used(batch["x"])) * scale

    rules = [Rule("", NVFP4Recipe())]
    report = inspect_model(model, {"x": x}, 2.0, loss_fn=loss_fn, rules=rules, key=5)
    assert [s.path for s in report.layers] == ["used"]
    assert report.skipped == {"unused": "not called in the pass"}
    assert report.loss == pytest.approx(2 * float(jnp.sum(model.used(x))), rel=1e-5)
    assert report["used"].operands["dy"].rel_error == 0  # dy = 2 everywhere: exact
    # The model may be the layer itself.
    root = inspect_model(model.used, x, rules=rules)
    assert [s.path for s in root.layers] == [""] and root[""].tokens == 32
    nothing = inspect_model(model.used, x)  # high precision, no rules: nothing to analyze
    assert nothing.layers == () and nothing.high_precision == ("",)
    with pytest.raises(TypeError, match="model must be"):
        inspect_model(lambda x: x, x)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        inspect_model(model, x, loss_fn=3)
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        inspect_model(model, x, rules=["x"])
    with pytest.raises(TypeError, match="recipe must be"):
        analyze_layer(x, jnp.ones((32, 32)), x, recipe="nvfp4")
    with pytest.raises(ValueError, match="needs x"):
        analyze_layer(jnp.ones((4, 32)), jnp.ones((32, 16)), jnp.ones((4, 32)))
    with pytest.raises(ValueError, match="multiples of 16"):
        analyze_layer(jnp.ones((4, 24)), jnp.ones((24, 16)), jnp.ones((4, 16)))


def test_inspecting_again_reuses_the_compiled_passes(monkeypatch):
    """A model inspected again (its graph, paths, loss and input types unchanged, as every N
    steps of a training run) runs the compiled passes of the first call: the same report,
    nothing traced anew. New input types trace their own passes; a static input that cannot
    be hashed traces them at every call (and gives the same numbers)."""
    from nvfp4_jax._src.model.diagnostics import capture  # noqa: PLC0415

    made = []
    monkeypatch.setattr(capture, "_PROGRAMS", type(capture._PROGRAMS)())
    original = capture._programs
    monkeypatch.setattr(capture, "_programs", lambda *a: made.append(a[1]) or original(*a))
    model, x = Two(nnx.Rngs(0)), jax.random.normal(jax.random.key(3), (8, 32))

    class Unhashable:
        __hash__ = None
        value = 0.5

    def loss_fn(model, x, scale):
        return jnp.sum(model.used(x) ** 2) * getattr(scale, "value", scale)

    rules = [Rule("", NVFP4Recipe())]
    first = inspect_model(model, x, 0.5, loss_fn=loss_fn, rules=rules, key=1)
    again = inspect_model(Two(nnx.Rngs(0)), x, 0.5, loss_fn=loss_fn, rules=rules, key=1)
    assert len(made) == 1 and again == first
    assert inspect_model(model, x[:4], 0.5, loss_fn=loss_fn, rules=rules) != first
    assert len(made) == 2  # another input shape: its own passes
    half = inspect_model(model, x.astype(jnp.bfloat16), 0.5, loss_fn=loss_fn, rules=rules)
    assert half["used"].operands["x"].rel_error != first["used"].operands["x"].rel_error
    assert len(made) == 3  # another dtype: its own passes (bf16 x, as the layer saw it)
    unhashed = inspect_model(model, x, Unhashable(), loss_fn=loss_fn, rules=rules, key=1)
    assert len(made) == 4 and unhashed == first  # not cached, the same numbers
    assert len(capture._PROGRAMS) == 3
    # A static input equal to the first's but of another type traces its own passes.
    inspect_model(model, x, 1, loss_fn=loss_fn, rules=rules, key=1)
    inspect_model(model, x, 1.0, loss_fn=loss_fn, rules=rules, key=1)
    assert len(made) == 6


def test_einsum_layers_a_rule_covers_are_reported_skipped_not_dropped():
    class WithEinsum(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 32, rngs=rngs)
            self.proj = nnx.Einsum("btd,dhe->bthe", (32, 2, 16), rngs=rngs)
            self.head = nnx.Einsum("btd,de->bte", (32, 16), rngs=rngs)

        def __call__(self, x):
            h = self.up(x)
            return self.proj(h).reshape(*x.shape[:2], 32) + jnp.tile(self.head(h), 2)

    model = WithEinsum(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 16, 32))
    report = inspect_model(model, x, rules=[Rule("head", None), Rule("", NVFP4Recipe())])
    assert [s.path for s in report.layers] == ["up"]
    assert report.skipped == {"proj": "an nnx.Einsum layer: only nnx.Linear layers are analyzed"}
    assert report.high_precision == ("head",)
    # Without rules only nvfp4_jax.nnx.Linear layers count: every plain layer is high precision.
    plain = inspect_model(model, x)
    assert plain.skipped == {}
    assert plain.high_precision == ("head", "proj", "up") and plain.layers == ()


# --- the report's forms --------------------------------------------------------------------------


def test_json_round_trip(run):
    *_, report = run
    text = report.to_json()
    assert json.loads(text) == report.to_dict()
    assert ModelReport.from_json(text) == report
    data = json.loads(text)
    assert data["layers"][0]["recipe"]["gemm_dtype"] == "bfloat16"
    assert data["rules"][0] == {"pattern": "^c$", "recipe": None}
    assert set(data["layers"][1]["operands"]) == {"x", "w", "dy", "x_wgrad", "dy_wgrad"}


def test_table_renders(run):
    *_, report = run
    console = Console(record=True, width=120, file=io.StringIO())
    report.print(console)
    text = console.export_text()
    assert "NVFP4 diagnostics: 2 layers, 32-64 tokens" in text and "SR/RTN" in text
    b = report["b"]
    row = next(line for line in text.splitlines() if line.strip().startswith("b "))
    for value in (
        f"{100 * b.operands['dy'].rel_error:.1f}",
        f"{b.wgrad_angle_sr:.1f}/{b.wgrad_angle_rtn:.1f}",
        "32×32",
    ):
        assert value in row, (value, row)
    assert "…" not in text  # 120 columns are enough


def test_plot_writes_a_png(run, tmp_path):
    *_, report = run
    path = report.plot(str(tmp_path / "diagnostics.png"))
    data = (tmp_path / "diagnostics.png").read_bytes()
    assert (
        path.endswith("diagnostics.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    )


# --- suggested rules ------------------------------------------------------------------------------


def synthetic(report, angles):
    template = report.layers[0]
    layers = tuple(
        dataclasses.replace(template, path=f"layers/{i}/mlp", wgrad_angle=angle)
        for i, angle in enumerate(angles)
    )
    return dataclasses.replace(report, layers=layers, high_precision=("lm_head",), rules=None)


def test_suggested_rules_keep_the_worst_layers_first(run):
    *_, report = run
    report = synthetic(report, [3.0, 9.0, 1.0, 7.0, 2.0, 8.0, 1.5, 2.5, 4.0, 5.0])
    rules = report.suggest_rules(0.25)  # 2.5 of 10 layers: 3, rounded up
    assert rules == [
        Rule("^layers/1/mlp$", None),
        Rule("^layers/5/mlp$", None),
        Rule("^layers/3/mlp$", None),
        Rule("^lm_head$", None),  # in high precision before: kept there
        Rule(".*", NVFP4Recipe()),
    ]
    assert check_rules(rules) == tuple(rules)
    assert len(report.suggest_rules(0)) == 2 and len(report.suggest_rules(1)) == 12
    by_error = report.suggest_rules(0.1, score="error")
    worst = max(report.layers, key=lambda s: s.summed_error).path
    assert by_error[0] == Rule(f"^{worst}$", None)
    custom = report.suggest_rules(0.1, score=lambda s: -s.wgrad_angle)
    assert custom[0].pattern == "^layers/2/mlp$"
    # A layer with another recipe keeps it.
    other = NVFP4Recipe(wgrad_rht=False)
    mixed = dataclasses.replace(
        report, layers=(*report.layers[:9], dataclasses.replace(report.layers[9], recipe=other))
    )
    assert mixed.suggest_rules(0)[-2:] == [Rule("^layers/9/mlp$", other), Rule(".*", NVFP4Recipe())]
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="share must be"):
            report.suggest_rules(bad)
    with pytest.raises(ValueError, match="score must be"):
        report.suggest_rules(0.1, score="angle")


def test_suggested_rules_extend_the_inspection_rules_and_apply(run):
    *_, report = run
    rules = report.suggest_rules(0.5)
    worst = max(report.layers, key=lambda s: s.wgrad_angle).path
    assert rules == [Rule(f"^{worst}$", None), *RULES]
    model = Net(nnx.Rngs(0))
    result = quantize_model(model, rules)
    assert result.paths("high_precision") == sorted([worst, "c"])
    assert result.paths("nvfp4") == [{"a": "b", "b": "a"}[worst]]
    assert result["odd"].action == "skipped"
