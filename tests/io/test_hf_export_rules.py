"""Train -> serve with rules: the exporter follows the model's own precision decisions.

The example (examples/train_lm.py) keeps its last block and the output head in bf16 by rules
(`nvfp4_jax.quantize_model`). An export of that model must write those layers in bf16 (W4A16
and W4A4 alike), keep a fused group (q/k/v, gate/up) whole in high precision when part of it
is, name every module a W4A4 export lacks an input amax for (with the remedy), export into a
folder `save_pretrained` left (config and tokenizer only) without `force=True`, and can write
a byte-level tokenizer for the example's byte vocabulary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_jax
from nvfp4_jax import hf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import lm_model  # noqa: E402
import train_lm  # noqa: E402

ARGV = ["--width", "64", "--depth", "2", "--heads", "4", "--steps", "2", "--seq-len", "32"]
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def linears(layer: int) -> list[str]:
    return [f"model.layers.{layer}.self_attn.{n}" for n in ATTN] + [
        f"model.layers.{layer}.mlp.{n}" for n in MLP
    ]


def dtypes(directory: Path) -> dict[str, str]:
    """`{tensor: safetensors dtype}` of the export (one file)."""
    return {k: str(v.dtype) for k, v in hf.read_safetensors(directory / hf.WEIGHTS_NAME).items()}


@pytest.fixture(scope="module")
def example():
    """The example's NVFP4 model, its default rules applied, trained two steps.

    Returns (args, model, QuantizeReport, a calibrated copy of the model).
    """
    args = train_lm.parse_args(ARGV)
    model = lm_model.TransformerLM(train_lm.model_config(args, "nvfp4"), nnx.Rngs(params=0))
    report = nvfp4_jax.quantize_model(model, train_lm.model_rules(args), rngs=nnx.Rngs(quantize=1))
    # The example's default: every linear in NVFP4 but the last block's and the head's.
    assert args.bf16_last == 2
    assert sorted(report.paths("high_precision")) == sorted(
        [*(f"layers/1/self_attn/{n}" for n in ATTN), *(f"layers/1/mlp/{n}" for n in MLP), "lm_head"]
    )
    train, _ = train_lm.split_text(train_lm.load_text(None), args.seq_len)
    optimizer = train_lm.make_optimizer(model, args)
    for step in range(args.steps):
        train_lm.train_step(model, optimizer, train_lm.batch_at(train, step, 4, args.seq_len, 0))
    calibrated = nnx.clone(model)
    nvfp4_jax.nnx.calibrate(calibrated)
    nnx.jit(lambda m, x: m(x))(calibrated, train_lm.batch_at(train, 99, 4, args.seq_len, 0))
    nvfp4_jax.nnx.calibrate(calibrated, False)
    return args, model, report, calibrated


@pytest.mark.slow
@pytest.mark.parametrize("given", ["state", "model", "report", "rules"])
def test_w4a16_export_follows_the_model(tmp_path, example, given):
    """W4A16: the layers trained in bf16 are written in bf16, whatever form the model is in."""
    args, model, report, _ = example
    cfg = train_lm.model_config(args, "nvfp4")
    params, kwargs = nnx.state(model), {}
    if given == "model":
        params = model
    elif given == "report":
        params, kwargs = nnx.to_pure_dict(nnx.state(model, nnx.Param)), {"rules": report}
    elif given == "rules":
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        kwargs = {"rules": train_lm.model_rules(args)}
    out = tmp_path / given
    result = hf.export_hf_checkpoint(
        out, params, quant_algo="W4A16_NVFP4", config=cfg.hf_config(), **kwargs
    )
    assert result.quantized == tuple(sorted(linears(0)))
    assert sorted(result.trained_high_precision) == sorted([*linears(1), "lm_head"])
    assert result.excluded == tuple(sorted([*linears(1), "lm_head", "model.embed_tokens"]))
    assert result.group_high_precision == ()
    found = dtypes(out)
    for module in linears(0):
        assert found[f"{module}.weight"] == "uint8", module
    for module in [*linears(1), "lm_head"]:
        assert found[f"{module}.weight"] == "bfloat16", module
        assert f"{module}.weight_scale" not in found, module
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == list(result.excluded)
    # What was written in bf16 is the trained bf16 weight itself.
    kernel = model.layers[1].mlp.down_proj.kernel[...]
    written = hf.read_safetensors(out / hf.WEIGHTS_NAME)["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(written, np.asarray(kernel.astype(jnp.bfloat16)).T)


@pytest.mark.slow
def test_w4a4_export_of_the_calibrated_model_and_back(tmp_path, example):
    """W4A4 needs input amaxes only where the model computed in NVFP4, and loads back."""
    args, _, _, calibrated = example
    cfg = train_lm.model_config(args, "nvfp4")
    result = hf.export_hf_checkpoint(tmp_path / "w4a4", calibrated, config=cfg.hf_config())
    assert result.quant_algo == "NVFP4" and result.quantized == tuple(sorted(linears(0)))
    tensors = hf.read_safetensors(tmp_path / "w4a4" / hf.WEIGHTS_NAME)
    for module in linears(0):
        scale = float(tensors[f"{module}.input_scale"])
        assert np.isfinite(scale) and scale > 0, module
    assert not [k for k in tensors if k.startswith("model.layers.1.") and "scale" in k]
    served = lm_model.from_params(
        cfg, hf.load_hf_checkpoint(tmp_path / "w4a4"), activations="nvfp4"
    )
    assert isinstance(served.layers[0].mlp.up_proj, nvfp4_jax.nnx.Linear)
    assert type(served.layers[1].mlp.up_proj) is nnx.Linear
    logits = nnx.jit(lambda m, x: m(x))(served, jnp.arange(16, dtype=jnp.int32)[None])
    assert np.isfinite(np.asarray(logits)).all()


def test_w4a4_error_names_every_module_and_the_remedy(tmp_path, example):
    """Not calibrated: one error naming every NVFP4 module and what to do."""
    args, model, _, _ = example
    config = train_lm.model_config(args, "nvfp4").hf_config()
    with pytest.raises(ValueError) as error:
        hf.export_hf_checkpoint(tmp_path / "x", model, config=config)
    message = str(error.value)
    assert (
        "['model.layers.0.mlp.{down,gate,up}_proj', 'model.layers.0.self_attn.{k,o,q,v}_proj']"
        in message
    ), message
    assert "nvfp4_jax.nnx.calibrate(model)" in message and "W4A16_NVFP4" in message, message
    assert "layers.1" not in message, message  # trained in bf16: no amax needed
    # A tree without any amax: every quantized linear of both layers, in one message.
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with pytest.raises(ValueError, match="no input amax for") as error:
        hf.export_hf_checkpoint(tmp_path / "x", params, config=config)
    assert (
        "['model.layers.{0,1}.mlp.{down,gate,up}_proj', 'model.layers.{0,1}.self_attn.{k,o,q,v}"
        "_proj']" in str(error.value)
    ), error.value


def test_a_partly_high_precision_fused_group_is_kept_whole(tmp_path, example):
    args, model, _, calibrated = example
    config = train_lm.model_config(args, "nvfp4").hf_config()
    rules = [
        nvfp4_jax.Rule("^layers/0/self_attn/k_proj$", None),
        nvfp4_jax.Rule("^layers/0/mlp/up_proj$", None),
        *train_lm.model_rules(args),
    ]
    result = hf.export_hf_checkpoint(tmp_path / "g", calibrated, rules=rules, config=config)
    kept = ("mlp.gate_proj", "self_attn.q_proj", "self_attn.v_proj")
    assert result.group_high_precision == tuple(f"model.layers.0.{m}" for m in kept)
    assert result.quantized == ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj")
    found = dtypes(tmp_path / "g")
    for name in ("q_proj", "k_proj", "v_proj"):
        assert found[f"model.layers.0.self_attn.{name}.weight"] == "bfloat16", name
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"} <= set(result.excluded)
    # A report from the model's own quantize_model works the same way.
    model2 = lm_model.TransformerLM(train_lm.model_config(args, "nvfp4"), nnx.Rngs(params=0))
    report = nvfp4_jax.quantize_model(model2, rules)
    result = hf.export_hf_checkpoint(
        tmp_path / "r", model2, rules=report, config=config, quant_algo="W4A16_NVFP4"
    )
    assert result.group_high_precision == tuple(f"model.layers.0.{m}" for m in kept)


def test_rules_must_cover_the_exported_linears(tmp_path, example):
    args, model, report, _ = example
    config = train_lm.model_config(args, "nvfp4").hf_config()
    partial = type(report)({p: d for p, d in report.layers.items() if "layers/0/" not in p})
    with pytest.raises(
        ValueError, match=r"no decision for .*layers/0/mlp/down_proj.*layers/0/self_attn/v_proj"
    ):
        hf.export_hf_checkpoint(
            tmp_path / "x", model, rules=partial, config=config, quant_algo="W4A16_NVFP4"
        )
    with pytest.raises(TypeError, match="QuantizeReport .* or a sequence of Rule"):
        hf.export_hf_checkpoint(tmp_path / "x", model, rules="lm_head", config=config)


SAVE_PRETRAINED = {
    "generation_config.json": "{}",
    "tokenizer.json": '{"model": {}}',
    "tokenizer_config.json": "{}",
    "special_tokens_map.json": "{}",
    "tokenizer.model": "sentencepiece",
    "vocab.json": "{}",
    "merges.txt": "#version: 0.2",
    "chat_template.jinja": "{{ messages }}",
}


def test_export_into_a_save_pretrained_folder_needs_no_force(tmp_path, example):
    args, model, _, _ = example
    config = train_lm.model_config(args, "nvfp4").hf_config()
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for name, text in SAVE_PRETRAINED.items():
        (folder / name).write_text(text)
    hf.export_hf_checkpoint(folder, model, quant_algo="W4A16_NVFP4")  # its config.json
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*SAVE_PRETRAINED, "config.json", "hf_quant_config.json", "model.safetensors"]
    )
    for name, text in SAVE_PRETRAINED.items():
        assert (folder / name).read_text() == text, name
    written = json.loads((folder / "config.json").read_text())
    assert written["quantization_config"]["quant_algo"] == "W4A16_NVFP4"
    # Weights there: replacing them still needs force=True.
    with pytest.raises(FileExistsError, match=r"model.safetensors.*force=True"):
        hf.export_hf_checkpoint(folder, model, quant_algo="W4A16_NVFP4")
    hf.export_hf_checkpoint(folder, model, quant_algo="W4A16_NVFP4", force=True)
    assert (folder / "tokenizer.model").read_text() == "sentencepiece"
    for name in (hf.INDEX_NAME, hf.QUANT_CONFIG_NAME, "model-00001-of-00002.safetensors"):
        other = tmp_path / name.replace(".", "_")
        other.mkdir()
        (other / "config.json").write_text(json.dumps(config))
        (other / name).write_text("{}")
        with pytest.raises(FileExistsError, match="force=True"):
            hf.export_hf_checkpoint(other, model, quant_algo="W4A16_NVFP4")


def gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte -> printable character table (what ByteLevel tokenizers use), inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def test_byte_level_tokenizer(tmp_path, example):
    """tokenizer="bytes": token i is byte i, for engines that read tokenizer.json."""
    args, model, _, _ = example
    config = train_lm.model_config(args, "nvfp4").hf_config()
    folder = tmp_path / "bytes"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")  # replaced: the argument asks for bytes
    hf.export_hf_checkpoint(
        folder, model, quant_algo="W4A16_NVFP4", config=config, tokenizer="bytes"
    )
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    assert tokenizer["model"]["type"] == "BPE" and tokenizer["model"]["merges"] == []
    assert tokenizer["model"]["vocab"] == gpt2_bytes()
    assert tokenizer["pre_tokenizer"]["type"] == tokenizer["decoder"]["type"] == "ByteLevel"
    assert tokenizer["added_tokens"] == []
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert settings["model_max_length"] == config["max_position_embeddings"]
    with pytest.raises(ValueError, match="tokenizer='bytes' needs vocab_size >= 256.* 64"):
        hf.export_hf_checkpoint(
            tmp_path / "y",
            model,
            quant_algo="W4A16_NVFP4",
            config={**config, "vocab_size": 64},
            tokenizer="bytes",
        )
    with pytest.raises(ValueError, match="tokenizer must be None or 'bytes'"):
        hf.export_hf_checkpoint(tmp_path / "z", model, config=config, tokenizer="gpt2")


@pytest.mark.parametrize("given", ["model", "report", "rules", "state", "none"])
def test_export_quantizes_the_weights_as_the_forward_pass_did(tmp_path, example, given):
    """The example trains with Four Over Six on its weights (M = 256): given the model, its
    QuantizeReport or its rules, the export writes the kernels the forward pass multiplied
    (`four_over_six="model"`, the default); a bare state carries no recipe (plain NVFP4), and
    `four_over_six=None` asks for plain NVFP4."""
    args, model, report, _ = example
    cfg = train_lm.model_config(args, "nvfp4")
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params, kwargs = {
        "model": (model, {}),
        "report": (pure, {"rules": report}),
        "rules": (pure, {"rules": train_lm.model_rules(args)}),
        "state": (nnx.state(model), {}),
        "none": (model, {"four_over_six": None}),
    }[given]
    out = tmp_path / given
    hf.export_hf_checkpoint(out, params, quant_algo="W4A16_NVFP4", config=cfg.hf_config(), **kwargs)
    tensors = hf.read_safetensors(out / hf.WEIGHTS_NAME)
    follows = given in ("model", "report", "rules")
    assert model.layers[0].mlp.up_proj.recipe.weight_four_over_six == "mse"
    for name in ("gate_proj", "up_proj"):
        layer = getattr(model.layers[0].mlp, name)
        members = [model.layers[0].mlp.gate_proj, model.layers[0].mlp.up_proj]
        amax = max(float(jnp.max(jnp.abs(m.kernel[...].astype(jnp.float32)))) for m in members)
        flags = {"four_over_six": "mse", "four_over_six_e4m3_max": 256} if follows else {}
        q = nvfp4_jax.quantize(
            layer.kernel[...], axis=0, block_2d=True, amax=jnp.float32(amax), **flags
        )
        module = f"model.layers.0.mlp.{name}"
        np.testing.assert_array_equal(
            tensors[f"{module}.weight_scale_2"], np.asarray(q.global_scale)
        )
        loaded = hf.load_hf_checkpoint(out)["layers"][0]["mlp"][name]["kernel"]
        np.testing.assert_array_equal(
            np.asarray(nvfp4_jax.dequantize(loaded)), np.asarray(nvfp4_jax.dequantize(q))
        )
    if follows:
        scale = float(tensors["model.layers.0.mlp.up_proj.weight_scale_2"])
        assert scale == pytest.approx(amax / 1536, rel=1e-6)
