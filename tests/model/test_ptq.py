"""Post-training quantization (`nvfp4_jax.ptq.quantize_for_export`) and its example.

Each method freezes a float model's linears to valid NVFP4Arrays that the exporter writes
as they are: "max" is bit for bit what `export_hf_checkpoint` writes for the float model,
"mse" never loses to "max" in weight error, "four_over_six" carries the 4/6 decode scale,
"gptq" lowers the output error on the calibration data below "max"'s (and with an identity
Hessian is exactly "max"). Fused groups share one decode scale and (W4A4) one input scale;
the caller's model is left unchanged; bad arguments are errors naming the argument.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_jax
from nvfp4_jax import hf, ptq
from nvfp4_jax._src.core import formats
from nvfp4_jax._src.model.ptq import methods as ptq_methods
from nvfp4_jax._src.model.ptq.methods import gptq_codes

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import lm_model  # noqa: E402
import ptq_lm  # noqa: E402
import train_lm  # noqa: E402

CFG = lm_model.LMConfig(width=32, depth=1, heads=2)  # q 32x32, k/v 32x16, MLP 32x96
LINEARS = [
    *(f"layers/0/self_attn/{n}" for n in ("k_proj", "o_proj", "q_proj", "v_proj")),
    *(f"layers/0/mlp/{n}" for n in ("down_proj", "gate_proj", "up_proj")),
]


def _bits(a) -> bytes:
    return np.asarray(a).tobytes()


@functools.cache
def lm() -> tuple[nnx.Module, list]:
    """The tiny Llama (f32 parameters, bf16 compute) and 3 calibration batches of tokens."""
    model = lm_model.TransformerLM(CFG, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32) for _ in range(3)]
    return model, batches


@functools.cache
def frozen_lm(method: str, activations: str = "high_precision"):
    model, batches = lm()
    return ptq.quantize_for_export(model, batches, method=method, activations=activations)


def _layer(model, path: str):
    for part in path.split("/"):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def _node(tree, path: str):
    for part in path.split("/"):
        tree = tree[int(part)] if part.isdigit() and int(part) in tree else tree[part]
    return tree


class Mixed(nnx.Module):
    """A linear pair fed different inputs (gate x, up 2x), a lone linear, one of 24 inputs."""

    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(32, 48, rngs=rngs)
        self.up_proj = nnx.Linear(32, 48, rngs=rngs)
        self.down_proj = nnx.Linear(48, 32, rngs=rngs)
        self.odd = nnx.Linear(24, 16, rngs=rngs)

    def __call__(self, x):
        h = self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(2 * x))
        return h, self.odd(x[..., :24])


@functools.cache
def mixed() -> tuple[nnx.Module, list]:
    """`Mixed` and 4 batches of correlated inputs (a random mixing of normal noise)."""
    model = Mixed(nnx.Rngs(1))
    key, mix = jax.random.split(jax.random.key(2))
    mixing = jax.random.normal(mix, (32, 32)) * jnp.linspace(0.2, 2.0, 32)
    batches = [jax.random.normal(k, (64, 32)) @ mixing + 0.5 for k in jax.random.split(key, 4)]
    return model, batches


# --- the methods --------------------------------------------------------------------------


def test_max_is_what_the_exporter_writes_for_the_float_model(tmp_path):
    model, _ = lm()
    frozen, report = frozen_lm("max")
    assert set(report.paths("nvfp4")) == set(LINEARS)
    assert report["lm_head"].action == "high_precision"  # the default rules, as the exporter
    config = CFG.hf_config()
    float_dir, frozen_dir = tmp_path / "float", tmp_path / "frozen"
    nvfp4_jax.export_hf_checkpoint(float_dir, model, config=config, quant_algo="W4A16_NVFP4")
    nvfp4_jax.export_hf_checkpoint(
        frozen_dir, nnx.state(frozen), config=config, quant_algo=report.quant_algo
    )
    expected = hf.read_safetensors(float_dir / hf.WEIGHTS_NAME)
    written = hf.read_safetensors(frozen_dir / hf.WEIGHTS_NAME)
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert written[name].dtype == tensor.dtype and _bits(written[name]) == _bits(tensor), name
    assert sum(name.endswith(".weight_scale_2") for name in written) == len(LINEARS)


@pytest.mark.slow
@pytest.mark.parametrize("method", ptq.METHODS)
def test_every_method_exports_w4a4_and_loads_back_bit_exactly(tmp_path, method):
    frozen, report = frozen_lm(method, "nvfp4")
    assert report.quant_algo == "NVFP4"
    # dtype=None: the float tensors (norms, embeddings, lm_head) keep their f32.
    exported = nvfp4_jax.export_hf_checkpoint(
        tmp_path, nnx.state(frozen), config=CFG.hf_config(), quant_algo="NVFP4", dtype=None
    )
    assert len(exported.quantized) == len(LINEARS)
    assert set(exported.excluded) == {"lm_head", "model.embed_tokens"}
    tree = nvfp4_jax.load_hf_checkpoint(tmp_path)
    tensors = hf.read_safetensors(tmp_path / hf.WEIGHTS_NAME)
    decode = {}
    for path in LINEARS:
        layer, loaded = _layer(frozen, path), _node(tree, path)
        q = layer.kernel.get_value()
        nvfp4_jax.validate_nvfp4_array(q)
        assert _bits(nvfp4_jax.dequantize(loaded["kernel"])) == _bits(nvfp4_jax.dequantize(q))
        assert np.float32(loaded["input_scale"]) == np.float32(layer.input_scale[...])
        assert layer.activations == "nvfp4"
        decode[path] = _bits(q.global_scale)
        name = "model." + path.replace("/", ".")
        assert _bits(tensors[f"{name}.weight_scale_2"]) == decode[path]  # D, whatever the method
    # The fused groups share one decode scale (weight_scale_2), as engines need.
    attn, mlp = "layers/0/self_attn/", "layers/0/mlp/"
    assert decode[attn + "q_proj"] == decode[attn + "k_proj"] == decode[attn + "v_proj"]
    assert decode[mlp + "gate_proj"] == decode[mlp + "up_proj"]
    # The frozen model computes what the exported checkpoint computes, bit for bit.
    _, batches = lm()
    loaded = lm_model.from_params(CFG, tree, activations="nvfp4", dtype=jnp.bfloat16)
    assert _bits(loaded(batches[0])) == _bits(frozen(batches[0]))


def test_mse_never_loses_to_max_and_searches_the_amax():
    _, report = frozen_lm("mse")
    sets = {}
    for path in LINEARS:
        entry = report[path]
        sets.setdefault(entry.group or (path,), []).append(entry)
        assert entry.amax_factor in ptq.DEFAULT_MSE_GRID
    improved = 0
    for members in sets.values():
        # Summed over a fused group (squared errors: relative error times ||W||^2).
        model, _ = lm()
        norms = [float(jnp.sum(_layer(model, e.path).kernel[...] ** 2)) for e in members]
        mse = sum(e.weight_error * n for e, n in zip(members, norms, strict=True))
        rtn = sum(e.max_weight_error * n for e, n in zip(members, norms, strict=True))
        assert mse <= rtn * (1 + 1e-12)
        improved += mse < rtn
        # Members share c and the amax f32(c) * A.
        assert len({e.amax for e in members}) == len({e.amax_factor for e in members}) == 1
    assert improved >= 2  # the search finds something on random weights
    max_report = frozen_lm("max")[1]
    for path in LINEARS:
        entry, base = report[path], max_report[path]
        assert entry.amax == float(np.float32(entry.amax_factor) * np.float32(base.amax))


def test_four_over_six_arrays_carry_the_4over6_decode_scale(tmp_path):
    model, _ = lm()
    frozen, report = frozen_lm("four_over_six")
    # What the exporter writes for the float model with four_over_six="mse", bit for bit.
    config = CFG.hf_config()
    kwargs = dict(config=config, quant_algo="W4A16_NVFP4")
    nvfp4_jax.export_hf_checkpoint(tmp_path / "float", model, four_over_six="mse", **kwargs)
    nvfp4_jax.export_hf_checkpoint(tmp_path / "frozen", nnx.state(frozen), **kwargs)
    expected = hf.read_safetensors(tmp_path / "float" / hf.WEIGHTS_NAME)
    written = hf.read_safetensors(tmp_path / "frozen" / hf.WEIGHTS_NAME)
    assert set(written) == set(expected)
    assert all(_bits(written[name]) == _bits(t) for name, t in expected.items())
    for path in LINEARS:
        q = _layer(frozen, path).kernel.get_value()
        entry = report[path]
        assert (q.four_over_six, q.e4m3_max, q.block_2d) == ("mse", 256, True)
        # D = A / (6 * 256) with the group's A, as decode_scale (the exporter's weight_scale_2).
        assert _bits(q.decode_scale) == _bits(np.float32(entry.amax) * np.float32(1 / 1536))
        expected = nvfp4_jax.quantize(
            _layer(model, path).kernel[...],
            axis=0,
            block_2d=True,
            amax=jnp.float32(entry.amax),
            four_over_six="mse",
            four_over_six_e4m3_max=256,
        )
        assert _bits(q.codes) == _bits(expected.codes) and _bits(q.scales) == _bits(expected.scales)
    # Options reach quantize: "mae" with M = 448 decodes with A * RCP2688.
    _, batches = lm()
    frozen, report = ptq.quantize_for_export(
        model, batches, method="four_over_six", four_over_six="mae", four_over_six_e4m3_max=448
    )
    q = _layer(frozen, LINEARS[0]).kernel.get_value()
    assert (q.four_over_six, q.e4m3_max) == ("mae", 448)
    assert _bits(q.global_scale) == _bits(np.float32(report[LINEARS[0]].amax) * formats.RCP2688)


@pytest.mark.parametrize("block_2d", [True, False])
def test_gptq_with_an_identity_hessian_rounds_to_nearest_as_quantize(block_2d):
    # With H = I no error moves: each block scale and code must be the contract's, bit for
    # bit, also when the fixed amax is below max |W| (the largest values saturate).
    kernel = jax.random.normal(jax.random.key(3), (64, 48)) * jnp.linspace(0.1, 3, 48)
    for amax in (float(jnp.max(jnp.abs(kernel))), 0.7 * float(jnp.max(jnp.abs(kernel)))):
        codes, scales = gptq_codes(kernel.T, jnp.eye(64), jnp.float32(amax), block_2d=block_2d)
        q = nvfp4_jax.quantize(kernel, axis=0, block_2d=block_2d, amax=jnp.float32(amax))
        assert _bits(formats.pack_nibbles(codes)) == _bits(q.codes)
        assert _bits(scales) == _bits(q.scales)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_on_the_calibration_data(act_order):
    model, batches = mixed()
    frozen, report = ptq.quantize_for_export(
        model, batches, method="gptq", gptq_act_order=act_order, block_2d=False
    )
    for path in ("gate_proj", "up_proj", "down_proj"):
        entry = report[path]
        assert entry.output_error < 0.8 * entry.max_output_error, entry
        assert entry.damping == ptq.DEFAULT_GPTQ_DAMP
    # The report's error is the real one: gate_proj's inputs are the batches themselves.
    x = jnp.concatenate(batches)
    w = model.gate_proj.kernel[...]
    q = frozen.gate_proj.kernel.get_value()
    nvfp4_jax.validate_nvfp4_array(q)
    assert q.decode_scale is None and _bits(q.amax) == _bits(np.float32(report["gate_proj"].amax))
    w_hat = nvfp4_jax.dequantize(q)
    direct = float(jnp.sum((x @ (w_hat - w)) ** 2) / jnp.sum((x @ w) ** 2))
    assert direct == pytest.approx(report["gate_proj"].output_error, rel=1e-3)
    assert report["odd"].action == "skipped" and "multiples of 16" in report["odd"].reason


def test_w4a4_input_scales_are_the_calibrated_amax_times_rcp2688():
    model, batches = mixed()
    frozen, report = ptq.quantize_for_export(model, batches, activations="nvfp4")
    amax = np.float32(max(float(jnp.max(jnp.abs(b))) for b in batches))
    # gate sees x, up sees 2x: the fused pair shares the larger amax (engines quantize the
    # fused layer's input with one scale).
    for path in ("gate_proj", "up_proj"):
        assert report[path].input_amax == float(2 * amax)
        assert report[path].input_scale == float(np.float32(2 * amax) * formats.RCP2688)
        assert _bits(_layer(frozen, path).input_scale[...]) == _bits(
            np.float32(2 * amax) * formats.RCP2688
        )
    hidden = jax.nn.silu(model.gate_proj(jnp.concatenate(batches))) * model.up_proj(
        2 * jnp.concatenate(batches)
    )
    down = np.float32(jnp.max(jnp.abs(hidden)))
    assert report["down_proj"].input_scale == float(down * formats.RCP2688)
    assert frozen.down_proj.activations == "nvfp4"


# --- rules, groups, the caller's model ----------------------------------------------------


def test_rules_choose_the_layers_and_groups_stay_whole():
    model, batches = mixed()
    rules = [nvfp4_jax.Rule("up_proj", None), nvfp4_jax.Rule("down", nvfp4_jax.NVFP4Recipe())]
    frozen, report = ptq.quantize_for_export(model, batches, rules=rules)
    assert report["up_proj"].action == "high_precision" and not report["up_proj"].reason
    # gate_proj is matched by no rule... and its fused sibling stays bf16 anyway.
    assert report["gate_proj"].action == "unmatched"
    assert report["odd"].action == "unmatched"
    assert report.paths("nvfp4") == ["down_proj"]
    assert type(frozen.up_proj) is nnx.Linear and type(frozen.gate_proj) is nnx.Linear
    assert isinstance(frozen.down_proj.kernel.get_value(), nvfp4_jax.NVFP4Array)
    # A group partly kept in high precision is kept whole, with the reason.
    rules = [nvfp4_jax.Rule("up_proj", None), nvfp4_jax.Rule(".*", nvfp4_jax.NVFP4Recipe())]
    _, report = ptq.quantize_for_export(model, batches, rules=rules)
    assert report["gate_proj"].action == "high_precision"
    assert "up_proj" in report["gate_proj"].reason
    assert report.paths("nvfp4") == ["down_proj"]


def test_the_callers_model_is_unchanged():
    model, batches = mixed()
    before = jax.tree.map(np.asarray, nnx.state(model))
    frozen, _ = ptq.quantize_for_export(model, batches, method="gptq", activations="nvfp4")
    after = jax.tree.map(np.asarray, nnx.state(model))
    assert jax.tree.all(jax.tree.map(lambda a, b: _bits(a) == _bits(b), before, after))
    assert type(model.gate_proj) is nnx.Linear and frozen is not model
    assert type(frozen.gate_proj) is nvfp4_jax.nnx.FrozenLinear


LAYERS = 2


class Stacked(nnx.Module):
    """Blocks made under nnx.vmap, run under nnx.scan, and a plain linear after them."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(rngs):
            return nnx.Linear(32, 32, rngs=rngs)

        self.blocks = make(rngs)
        self.out_proj = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return jax.nn.relu(block(x))

        return self.out_proj(body(x, self.blocks))


def test_stacked_layers_are_skipped_with_the_reason():
    model = Stacked(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (8, 32))
    frozen, report = ptq.quantize_for_export(model, [x], method="gptq")
    assert report["blocks"].action == "skipped" and "stacked" in report["blocks"].reason
    assert report.paths("nvfp4") == ["out_proj"]
    assert frozen(x).shape == (8, 16)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(method="awq"), ValueError, "method must be one of"),
        (dict(activations="fp8"), ValueError, "activations must be one of"),
        (dict(batches=[]), ValueError, "batches is empty"),
        (dict(batches=None), TypeError, "batches must be an iterable"),
        (dict(batches=jnp.ones((4, 32))), TypeError, "pass [batch]"),
        (dict(rules=[nvfp4_jax.Rule(".*", None)]), ValueError, "no linear layer to quantize"),
        (dict(rules=nvfp4_jax.Rule(".*", None)), TypeError, "rules must be a sequence"),
        (dict(mse_grid=[0.9, -1.0]), ValueError, "mse_grid"),
        (dict(gptq_damp=0.0), ValueError, "gptq_damp"),
        (dict(four_over_six="max"), ValueError, "four_over_six"),
        (dict(four_over_six_e4m3_max=300), ValueError, "four_over_six_e4m3_max"),
        (dict(forward="model"), TypeError, "forward must be callable"),
        (dict(block_2d=1), TypeError, "block_2d must be a bool"),
        (dict(fused_groups="q_proj"), TypeError, "fused_groups"),
    ],
)
def test_bad_arguments_are_errors_naming_the_argument(kwargs, error, words):
    model, batches = mixed()
    kwargs = dict(batches=batches) | kwargs
    with pytest.raises(error, match="^quantize_for_export: ") as info:
        ptq.quantize_for_export(model, **kwargs)
    assert words in str(info.value)


def _with(batches, index, value, batch=2):
    """`batches` with `value` at `index` of batch `batch`."""
    return [b.at[index].set(value) if i == batch else b for i, b in enumerate(batches)]


CALIBRATIONS = [
    ("max", "high_precision"),
    ("mse", "high_precision"),
    ("four_over_six", "high_precision"),
    ("gptq", "high_precision"),
    ("max", "nvfp4"),
    ("gptq", "nvfp4"),
]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(("method", "activations"), CALIBRATIONS)
def test_non_finite_calibration_inputs_are_refused_naming_layers_and_batch(
    method, activations, value
):
    """Batch 2 holds one bad value in a column `odd` does not read: gate and up see it,
    down sees what they made of it; each is named with the batch, whatever the method."""
    model, batches = mixed()
    bad = _with(batches, (5, 30), value)
    with pytest.raises(ValueError, match="^quantize_for_export: ") as info:
        ptq.quantize_for_export(model, bad, method=method, activations=activations)
    message = str(info.value)
    for path in ("gate_proj", "up_proj", "down_proj"):
        assert f"'{path}' (batch 2)" in message, message
    assert "odd" not in message and "gptq_damp" not in message, message
    assert "NaN or inf" in message, message


@pytest.mark.parametrize("method", ["max", "gptq"])
def test_calibration_inputs_too_large_for_f32_statistics_are_refused(method):
    """Finite inputs whose X^T X overflows f32: no Hessian, no output error, no damping."""
    model, batches = mixed()
    bad = _with(batches, (5, 30), 1e20)
    with pytest.raises(ValueError, match="^quantize_for_export: ") as info:
        ptq.quantize_for_export(model, bad, method=method)
    message = str(info.value)
    assert "overflow" in message and "'gate_proj'" in message, message
    assert "gptq_damp" not in message, message


@pytest.mark.parametrize("method", ["max", "gptq"])
@pytest.mark.parametrize(
    ("layer", "param", "index"), [("up_proj", "kernel", (3, 7)), ("gate_proj", "bias", (4,))]
)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused_naming_the_layer(method, layer, param, index, value):
    """Named as the weights' fault, before calibration blames the inputs they spoil."""
    model, batches = mixed()
    model = nnx.clone(model)
    variable = getattr(getattr(model, layer), param)
    variable[...] = variable[...].at[index].set(value)
    with pytest.raises(ValueError, match=rf"^quantize_for_export: the {param} of '{layer}'"):
        ptq.quantize_for_export(model, batches, method=method)


def test_gptq_says_raise_gptq_damp_only_for_an_ill_conditioned_hessian():
    indefinite = np.array([[1.0, 1e4], [1e4, 1.0]])  # (f32 rounding makes X^T X so, mildly)
    hessian = np.kron(indefinite, np.eye(8))
    with pytest.raises(ValueError, match="'layers/3/up' is not positive definite.*gptq_damp"):
        ptq_methods.inverse_hessian_factor(hessian, 0.01, "layers/3/up")
    upper, relative = ptq_methods.inverse_hessian_factor(np.eye(16) * 2.0, 0.01, "x")
    assert relative == 0.01 and np.allclose(upper.T @ upper, np.eye(16) / 2.02)
    for value in (np.nan, np.inf):
        hessian = np.eye(16)
        hessian[2, 3] = value
        with pytest.raises(ValueError, match="'layers/3/up' is not finite") as info:
            ptq_methods.inverse_hessian_factor(hessian, 0.01, "layers/3/up")
        assert "gptq_damp" not in str(info.value)


def test_a_model_whose_only_linear_cannot_be_quantized_says_why():
    with pytest.raises(ValueError, match="must be multiples of 16"):
        ptq.quantize_for_export(nnx.Linear(24, 16, rngs=nnx.Rngs(0)), [jnp.ones((2, 24))])
    with pytest.raises(TypeError, match="model must be a flax.nnx.Module"):
        ptq.quantize_for_export({"kernel": jnp.ones((16, 16))}, [jnp.ones((2, 16))])


# --- the example --------------------------------------------------------------------------


@pytest.mark.slow
def test_ptq_lm_quantizes_a_tiny_bf16_run(tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--width", "32", "--depth", "1", "--heads", "2", "--batch", "8", "--seq-len", "32"]
    trained = train_lm.main([*flags, "--recipe", "bf16", "--steps", "3", "--out", str(run)])
    results = ptq_lm.main(
        ["--from", str(run), "--methods", "max", "gptq", "--modes", "w4a4"]
        + ["--rule-sets", "default", "--calib-batches", "2"]
    )
    # The same model and validation batches as the run's last evaluation.
    assert results["bf16_val_loss"] == trained["results"]["bf16"]["final_val_loss"]
    assert [(r["method"], r["mode"]) for r in results["runs"]] == [
        ("max", "w4a4"),
        ("gptq", "w4a4"),
    ]
    for entry in results["runs"]:
        assert np.isfinite(entry["val_loss"]) and entry["quantized_layers"] == 7
    gptq, rtn = results["runs"][1], results["runs"][0]
    assert gptq["mean_output_error"] < rtn["mean_output_error"]
    written = json.loads((run / "ptq.json").read_text())
    assert written["runs"][0]["report"]["layers"]["lm_head"]["action"] == "high_precision"
    assert "gap vs bf16" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        ptq_lm.main(["--from", str(tmp_path / "nothing")])
    assert info.value.code == 2 and "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        ptq_lm.main(["--from", str(tmp_path)])
    assert info.value.code == 2 and "holds no bf16 checkpoint" in capsys.readouterr().err


def test_gptq_act_order_changes_the_order_and_so_the_codes():
    # act_order processes the columns by decreasing Hessian diagonal: the same layers end with
    # other codes (the option is not silently ignored).
    model, batches = mixed()
    codes = {}
    for act_order in (False, True):
        frozen, _ = ptq.quantize_for_export(
            model, batches, method="gptq", gptq_act_order=act_order, block_2d=False
        )
        codes[act_order] = [_bits(frozen.down_proj.kernel.get_value().codes)]
    assert codes[False] != codes[True]
