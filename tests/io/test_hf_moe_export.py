"""Mixture-of-experts checkpoints in ModelOpt's NVFP4 layout, written (SERVING_FORMATS.md 5;
nvfp4_jax/_src/io/hf/export/, an experts stack as E linears): ModelOpt's encoder reproduces
the fixture and the export writes what ModelOpt writes, the MoE rules one by one, the sources
of the input amax, an export read back, the experts' recipe followed, and the errors. The
fixture and its helpers are hf_moe_fixture.py's.
"""

from __future__ import annotations

import json

import hf_moe_fixture
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_bits
from hf_fixture import assert_same_config_meaning, raw_tensors
from hf_moe_fixture import (
    EXPERT_LINEARS,
    EXPERTS,
    HIDDEN,
    LAYER_INPUT_AMAX,
    LAYERS,
    PROJ,
    RCP2688,
    ROUTERS,
    SIZE,
    amax,
    assert_same_but_zero_sign,
    checkpoint_dir,
    expert_input_amax,
    expert_weight_amax,
    flax_tree_from_hf,
    leaf,
    model_config,
    modelopt_decode,
    modelopt_encode,
    with_attention_scales,
)

import nvfp4_jax
from nvfp4_jax import hf
from nvfp4_jax._src.core.array import NVFP4Array

# The checkpoint conftest.py's `fixture_tensors` and `source` read.
FIXTURE, REFERENCE = hf_moe_fixture.FIXTURE, hf_moe_fixture.REFERENCE


@pytest.fixture(scope="module")
def exports(tmp_path_factory, source, fixture_tensors) -> dict:
    """The source exported W4A4 with 1x16 blocks (ModelOpt's), with 16x16, and as W4A16."""
    root = tmp_path_factory.mktemp("moe_exports")
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    out = {}
    for flavour, kwargs in {
        "1x16": {"block_2d": False, "input_amax": expert_input_amax()},
        "16x16": {"block_2d": True, "input_amax": expert_input_amax()},
        "W4A16_NVFP4": {"block_2d": False, "quant_algo": "W4A16_NVFP4"},
    }.items():
        if flavour == "W4A16_NVFP4":
            tree = flax_tree_from_hf(source)
        out[flavour + "/report"] = hf.export_hf_checkpoint(
            root / flavour,
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            **kwargs,
        )
        out[flavour] = root / flavour
        out[flavour + "/tensors"] = hf.read_safetensors(root / flavour / "model.safetensors")
    return out


# --- export, against ModelOpt ---------------------------------------------------------------


def test_modelopt_encoder_reproduces_the_fixture(source, fixture_tensors):
    """ModelOpt's bytes are its encoder on the source with M2's and M3's amaxes: the rules."""
    for module in EXPERT_LINEARS:
        weight = source[f"{module}.weight"]
        codes, scales, ws2 = modelopt_encode(weight, expert_weight_amax(source, module))
        assert_same_bits(codes, fixture_tensors[f"{module}.weight"], module)
        assert_same_bits(
            scales.view(np.uint8), fixture_tensors[f"{module}.weight_scale"].view(np.uint8)
        )
        assert_same_bits(ws2, fixture_tensors[f"{module}.weight_scale_2"], module)


@pytest.mark.parametrize("flavour", ["1x16", "16x16"])
def test_export_writes_what_modelopt_writes(exports, flavour, source, fixture_tensors):
    """(b) The source exported with ModelOpt's settings: ModelOpt's tensors and configs.

    Names, dtypes and shapes are the fixture's, exactly. Every expert is quantized with the
    amax ModelOpt used (its weight_scale_2 is f32(amax / 2688) of ours, N1); the input
    scales are ModelOpt's bytes; the router is ModelOpt's bf16. With 1x16 blocks the codes
    and block scales are ModelOpt's except at N3's ties (adjacent values, < 1%), and
    ModelOpt's decode of every expert is our dequantize of it (T2).
    """
    ours = exports[f"{flavour}/tensors"]
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {
        k: (v.dtype, v.shape) for k, v in fixture_tensors.items()
    }
    assert_same_config_meaning(exports[flavour], FIXTURE)
    assert exports[f"{flavour}/report"].excluded == ("lm_head", "model.embed_tokens", *ROUTERS)
    for router in ROUTERS:
        assert_same_bits(ours[f"{router}.weight"], fixture_tensors[f"{router}.weight"], router)
    differ = [0, 0]
    for module in EXPERT_LINEARS:
        weight_amax = expert_weight_amax(source, module)
        ws2 = ours[f"{module}.weight_scale_2"]
        assert_same_bits(ws2, weight_amax * RCP2688, module)
        assert_same_bits(
            weight_amax / np.float32(2688), fixture_tensors[f"{module}.weight_scale_2"], module
        )
        assert_same_bits(
            ours[f"{module}.input_scale"], fixture_tensors[f"{module}.input_scale"], module
        )
        kernel = jnp.asarray(source[f"{module}.weight"]).T
        q = nvfp4_jax.quantize(
            kernel, axis=0, block_2d=flavour == "16x16", amax=jnp.float32(weight_amax)
        )
        parts = (ours[f"{module}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2"))
        decoded = modelopt_decode(*parts)
        assert_same_but_zero_sign(decoded, np.asarray(nvfp4_jax.dequantize(q)).T, module)
        if flavour == "1x16":
            differ[0] += assert_adjacent_codes(
                ours[f"{module}.weight"], fixture_tensors[f"{module}.weight"], module
            )
            differ[1] += assert_adjacent_scales(
                ours[f"{module}.weight_scale"], fixture_tensors[f"{module}.weight_scale"], module
            )
    if flavour == "1x16":
        assert differ[0] < 0.01 * len(EXPERT_LINEARS) * SIZE * HIDDEN, differ
        assert differ[1] < 0.01 * len(EXPERT_LINEARS) * SIZE * HIDDEN // 16, differ


def assert_adjacent_codes(ours, theirs, what) -> int:
    """Codes equal, or one E2M1 step apart with the same sign (N3's ties); the count apart."""
    a, b = (np.stack([x & 0xF, x >> 4], -1).astype(np.int8) for x in (ours, theirs))
    apart = a != b
    magnitude_a, magnitude_b = a & 7, b & 7
    same_sign = ((a ^ b) & 8) == 0
    ok = (np.abs(magnitude_a - magnitude_b) <= 1) & (same_sign | (magnitude_a * magnitude_b == 0))
    assert np.all(ok | ~apart), what
    return int(apart.sum())


def assert_adjacent_scales(ours, theirs, what) -> int:
    """Block scales equal or adjacent E4M3 values; the count apart."""
    a, b = (np.asarray(x).view(np.uint8).astype(np.int16) for x in (ours, theirs))
    assert np.all(np.abs(a - b) <= 1), what
    return int((a != b).sum())


def test_weight_only_export(exports, source):
    """W4A16: no input_scale anywhere, ModelOpt's config for the algorithm, same weights."""
    ours = exports["W4A16_NVFP4/tensors"]
    assert not [name for name in ours if name.endswith("input_scale")]
    config = json.loads((exports["W4A16_NVFP4"] / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_algo"] == "W4A16_NVFP4"
    assert "input_activations" not in quant["config_groups"]["group_0"]
    assert quant["ignore"] == ["lm_head", "model.embed_tokens", *ROUTERS]
    w4a4 = exports["1x16/tensors"]
    for name, value in ours.items():
        assert_same_bits(value, w4a4[name], name)


# --- the MoE rules, asserted one by one ---------------------------------------------------------


def test_gate_and_up_share_weight_scale_2(exports, source):
    """(d) M2: gate and up of each expert have one weight_scale_2, the larger amax's; M3:
    each expert its own (down too)."""
    for flavour in ("1x16", "16x16", "W4A16_NVFP4"):
        ours = exports[f"{flavour}/tensors"]
        for i in range(LAYERS):
            per_expert = []
            for e in range(EXPERTS):
                parent = f"model.layers.{i}.mlp.experts.{e}"
                gate, up = (amax(source[f"{parent}.{p}.weight"]) for p in ("gate_proj", "up_proj"))
                assert gate != up  # the fixture's up rows are 0.75x: a real test
                expected = max(gate, up) * RCP2688
                for p in ("gate_proj", "up_proj"):
                    assert_same_bits(ours[f"{parent}.{p}.weight_scale_2"], expected, parent)
                down = amax(source[f"{parent}.down_proj.weight"]) * RCP2688
                assert_same_bits(ours[f"{parent}.down_proj.weight_scale_2"], down, parent)
                per_expert.append((float(expected), float(down)))
            assert len(set(per_expert)) == EXPERTS


def test_input_scale_per_layer_and_projection_kind(exports):
    """(d) M4: one input_scale per layer for all experts' gate and up, one for down: the max
    of the (E,) amaxes given (which differ between experts here), on every expert."""
    given = expert_input_amax()
    for flavour in ("1x16", "16x16"):
        ours = exports[f"{flavour}/tensors"]
        for i in range(LAYERS):
            gate_up = max(
                given[f"layers/{i}/mlp/experts/{p}"].max() for p in ("gate_proj", "up_proj")
            )
            down = given[f"layers/{i}/mlp/experts/down_proj"].max()
            assert given[f"layers/{i}/mlp/experts/up_proj"].max() < gate_up  # shared: real
            assert len(set(given[f"layers/{i}/mlp/experts/down_proj"])) == EXPERTS
            for e in range(EXPERTS):
                parent = f"model.layers.{i}.mlp.experts.{e}"
                for p, value in (("gate_proj", gate_up), ("up_proj", gate_up), ("down_proj", down)):
                    assert_same_bits(
                        ours[f"{parent}.{p}.input_scale"], np.float32(value) * RCP2688, parent
                    )


def test_input_amax_sources_for_experts(tmp_path, source, fixture_tensors):
    """A scalar per stacked layer, one expert by HF name, and (E,) `input_amax` leaves."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    given = {k: float(v.max()) for k, v in expert_input_amax().items()}  # scalars
    given["model.layers.0.mlp.experts.2.down_proj"] = 100.0  # one expert, raising the max
    hf.export_hf_checkpoint(
        tmp_path / "a",
        tree,
        name_map=hf.qwen3_moe_name_map(),
        config=model_config(),
        input_amax=given,
    )
    ours = hf.read_safetensors(tmp_path / "a" / "model.safetensors")
    for e in range(EXPERTS):
        scale = ours[f"model.layers.0.mlp.experts.{e}.down_proj.input_scale"]
        assert_same_bits(scale, np.float32(100.0) * RCP2688)
    # Recorded leaves (as nnx.Experts.input_amax): (E,) per stacked layer, one expert at 0.
    for path, value in expert_input_amax().items():
        leaf(tree, path)["input_amax"] = jnp.asarray(value).at[3].set(0.0)
    hf.export_hf_checkpoint(
        tmp_path / "b", tree, name_map=hf.qwen3_moe_name_map(), config=model_config()
    )
    ours = hf.read_safetensors(tmp_path / "b" / "model.safetensors")
    gate_up, down = LAYER_INPUT_AMAX[1]
    for p, value in (("up_proj", gate_up), ("down_proj", down)):
        scale = ours[f"model.layers.1.mlp.experts.3.{p}.input_scale"]
        assert_same_bits(scale, np.float32(value) * RCP2688, p)


def test_round_trip_of_our_own_export(tmp_path, exports):
    """(c) Our 16x16 export loads and exports again bit for bit (W4A4 and W4A16)."""
    for flavour in ("16x16", "W4A16_NVFP4"):
        tree = hf.load_hf_checkpoint(exports[flavour], name_map=hf.qwen3_moe_name_map())
        algo = "W4A16_NVFP4" if flavour == "W4A16_NVFP4" else "NVFP4"
        hf.export_hf_checkpoint(
            tmp_path / flavour,
            tree,
            name_map=hf.qwen3_moe_name_map(),
            quant_algo=algo,
            config=model_config(),
        )
        assert raw_tensors(tmp_path / flavour) == raw_tensors(exports[flavour])


def test_experts_kept_in_high_precision(tmp_path, source, fixture_tensors):
    """An MoE block excluded whole: bf16 per-expert weights, the block named in ignore, and
    loaded back as a float (E, in, out) stack."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    report = hf.export_hf_checkpoint(
        tmp_path / "x",
        tree,
        name_map=hf.qwen3_moe_name_map(),
        config=model_config(),
        input_amax=expert_input_amax(),
        exclude=(*hf.DEFAULT_EXCLUDE, "model.layers.1.mlp.experts"),
    )
    assert "model.layers.1.mlp.experts" in report.excluded
    ours = hf.read_safetensors(tmp_path / "x" / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.down_proj"
    assert f"{name}.weight_scale" not in ours and ours[f"{name}.weight"].dtype == ml_dtypes.bfloat16
    assert "model.layers.0.mlp.experts.2.down_proj.weight_scale" in ours
    loaded = hf.load_hf_checkpoint(tmp_path / "x", name_map=hf.qwen3_moe_name_map())
    stack = loaded["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"]
    assert_same_bits(stack, tree["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"])
    assert isinstance(loaded["layers"][0]["mlp"]["experts"]["down_proj"]["kernel"], NVFP4Array)


# --- following the model: nnx.Experts ----------------------------------------------------------


class Box(nnx.Module):
    def __init__(self, **children):
        for name, value in children.items():
            setattr(self, name, value)


def moe_model(source, recipes) -> nnx.Module:
    """The fixture's MoE blocks as nnx modules: a router, `nvfp4_jax.nnx.Experts` with the
    recipe of each layer (`recipes[i]`) and recorded (E,) input amaxes."""
    tree = flax_tree_from_hf({k: v for k, v in source.items() if ".mlp." in k})
    rngs = nnx.Rngs(0)
    layers = []
    for i in range(LAYERS):
        stacks = tree["layers"][i]["mlp"]["experts"]
        experts = {}
        for proj in PROJ:
            kernel = stacks[proj]["kernel"]
            layer = nvfp4_jax.nnx.Experts(*kernel.shape, recipe=recipes[i], rngs=rngs)
            layer.kernel[...] = kernel.astype(jnp.float32)
            recorded = expert_input_amax()[f"layers/{i}/mlp/experts/{proj}"]
            layer.input_amax[...] = jnp.asarray(recorded)
            experts[proj] = layer
        gate = Box(kernel=nnx.Param(tree["layers"][i]["mlp"]["gate"]["kernel"]))
        layers.append(Box(mlp=Box(gate=gate, experts=Box(**experts))))
    return Box(layers=nnx.List(layers))


def test_export_follows_the_experts_recipe(tmp_path, source):
    """nnx.Experts with a recipe: quantized, with its recorded (E,) input_amax; recipe=None
    beside NVFP4 layers: the whole block in bf16, named in ignore by its block name."""
    name_map, nvfp4 = hf.qwen3_moe_name_map(), nvfp4_jax.NVFP4Recipe()
    model = moe_model(source, (nvfp4, None))
    report = hf.export_hf_checkpoint(
        tmp_path / "m", model, name_map=name_map, config=model_config()
    )
    layer0 = [m for m in EXPERT_LINEARS if ".layers.0." in m]
    layer1 = [m for m in EXPERT_LINEARS if ".layers.1." in m]
    assert report.followed == "model" and sorted(report.quantized) == sorted(layer0)
    assert sorted(report.trained_high_precision) == sorted(layer1)
    assert report.excluded == (ROUTERS[0], "model.layers.1.mlp.experts", ROUTERS[1])
    ours = hf.read_safetensors(tmp_path / "m" / "model.safetensors")
    gate_up, _ = LAYER_INPUT_AMAX[0]
    scale = ours["model.layers.0.mlp.experts.1.up_proj.input_scale"]
    assert_same_bits(scale, np.float32(gate_up) * RCP2688)
    for module in layer1:
        assert_same_bits(ours[f"{module}.weight"], source[f"{module}.weight"], module)
    # The same decisions from the rules, given with a plain dict of the weights.
    rules = [nvfp4_jax.Rule("layers/1/", None), nvfp4_jax.Rule("experts", nvfp4)]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export_hf_checkpoint(
        tmp_path / "r",
        params,
        name_map=name_map,
        config=model_config(),
        rules=rules,
        input_amax={k: v for k, v in expert_input_amax().items() if "layers/0/" in k},
    )
    assert raw_tensors(tmp_path / "r") == raw_tensors(tmp_path / "m")
    # And from the QuantizeReport of quantize_model, which set the recipes of a bf16 model.
    model = moe_model(source, (None, None))
    report = nvfp4_jax.quantize_model(model, rules, rngs=nnx.Rngs(quantize=0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export_hf_checkpoint(
        tmp_path / "q",
        params,
        name_map=name_map,
        config=model_config(),
        rules=report,
        input_amax={k: v for k, v in expert_input_amax().items() if "layers/0/" in k},
    )
    assert raw_tensors(tmp_path / "q") == raw_tensors(tmp_path / "m")
    # A state does not say which recipe an Experts layer had.
    with pytest.raises(ValueError, match="pass the model"):
        hf.export_hf_checkpoint(
            tmp_path / "s", nnx.state(model), name_map=name_map, config=model_config()
        )
    # A model with no NVFP4 layer at all (trained in bf16) is quantized whole, as a dense one.
    report = hf.export_hf_checkpoint(
        tmp_path / "b", moe_model(source, (None, None)), name_map=name_map, config=model_config()
    )
    assert report.followed == "" and len(report.quantized) == len(EXPERT_LINEARS)


def test_error_router_quantization(tmp_path, source, fixture_tensors):
    """(e) A router in NVFP4, given to the export or found in a checkpoint."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    router = tree["layers"][0]["mlp"]["gate"]
    router["kernel"] = nvfp4_jax.quantize(router["kernel"], axis=0)
    with pytest.raises(ValueError, match=r"router model.layers.0.mlp.gate .*high precision"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=expert_input_amax(),
        )
    tensors = dict(fixture_tensors)
    for suffix, value in (
        ("weight", np.zeros((4, 64), np.uint8)),
        ("weight_scale", np.ones((4, 8), ml_dtypes.float8_e4m3fn)),
        ("weight_scale_2", np.float32(1)),
        ("input_scale", np.float32(1)),
    ):
        tensors[f"model.layers.0.mlp.gate.{suffix}"] = value
    config = json.loads((FIXTURE / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "model.embed_tokens"]
    directory = checkpoint_dir(tmp_path, tensors, config)
    with pytest.raises(ValueError, match=r"router model.layers.0.mlp.gate is stored in NVFP4"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())


def test_error_nan_in_an_experts_input_amax(tmp_path, source, fixture_tensors):
    """(e) An (E,) input amax with a NaN names the expert; a layer never calibrated too."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    given = expert_input_amax()
    given["layers/1/mlp/experts/down_proj"] = given["layers/1/mlp/experts/down_proj"].copy()
    given["layers/1/mlp/experts/down_proj"][2] = np.nan
    with pytest.raises(ValueError, match=r"nan.*model.layers.1.mlp.experts.2.down_proj"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=given,
        )
    given = expert_input_amax()
    given["layers/0/mlp/experts/up_proj"] = np.zeros(EXPERTS, np.float32)
    given["layers/0/mlp/experts/gate_proj"] = np.zeros(EXPERTS, np.float32)
    with pytest.raises(ValueError, match=r"never calibrated.*layers.0.mlp.experts"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=given,
        )
    given = {k: v for k, v in expert_input_amax().items() if "layers/1/mlp/experts/up" not in k}
    with pytest.raises(ValueError, match=r"no input amax for .*layers.1.mlp.experts"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=given,
        )
    with pytest.raises(ValueError, match=r"shape \(4,\), got \(3,\)"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax={**expert_input_amax(), "layers/0/mlp/experts/up_proj": np.ones(3)},
        )


def test_error_bad_moe_exports(tmp_path, source):
    name_map = hf.qwen3_moe_name_map()
    tree = flax_tree_from_hf(source)
    w4a16 = {"name_map": name_map, "quant_algo": "W4A16_NVFP4"}
    config = model_config()
    del config["num_local_experts"]
    with pytest.raises(ValueError, match="num_experts or num_local_experts"):
        hf.export_hf_checkpoint(tmp_path / "x", tree, config=config, **w4a16)
    with pytest.raises(ValueError, match="moe_intermediate_size=32"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, config={**model_config(), "moe_intermediate_size": 32}, **w4a16
        )
    with pytest.raises(ValueError, match="num_experts_per_tok from 1 to 4"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, config={**model_config(), "num_experts_per_tok": 5}, **w4a16
        )
    with pytest.raises(ValueError, match="half excluded"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            config=model_config(),
            exclude=(*hf.DEFAULT_EXCLUDE, "model.layers.0.mlp.experts.1.*"),
            **w4a16,
        )
    with pytest.raises(ValueError, match="experts rule: nvfp4_jax.hf.qwen3_moe_name_map"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, config=model_config(), quant_algo="W4A16_NVFP4"
        )
    flat = flax_tree_from_hf(source)
    flat["layers"][0]["mlp"]["experts"]["up_proj"]["kernel"] = jnp.zeros((HIDDEN, SIZE))
    with pytest.raises(ValueError, match=r"needs a stacked \(E, in, out\) kernel"):
        hf.export_hf_checkpoint(tmp_path / "x", flat, config=model_config(), **w4a16)
    assert not (tmp_path / "x").exists()
