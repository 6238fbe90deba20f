"""examples/generate.py: the cached decode equals lm_model's forward, flags, end to end."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import generate
from lm_model import LMConfig, TransformerLM

import nvfp4_jax

TINY = ["--width", "32", "--depth", "2", "--heads", "2"]


@pytest.fixture(scope="module")
def tiny():
    cfg = LMConfig(width=32, depth=2, heads=2)
    model = TransformerLM(cfg, nnx.Rngs(params=3))
    params, _ = generate._params_only(generate._plain(nnx.to_pure_dict(nnx.state(model))))
    return cfg, params


def _teacher_forced(model, tokens, prompt_len):
    """Cached logits of every position: prefill `prompt_len`, then one token per step."""
    cfg = model.cfg
    b, t = tokens.shape
    cache = generate.empty_cache(cfg, b, t)
    logits, cache = generate.forward_cached(model, cache, tokens[:, :prompt_len], jnp.int32(0))
    out = [logits]
    step = jax.jit(lambda c, tok, pos: generate.forward_cached(model, c, tok, pos))
    for pos in range(prompt_len, t):
        logits, cache = step(cache, tokens[:, pos : pos + 1], jnp.int32(pos))
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1))


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_cached_decode_equals_full_forward(tiny, precision):
    cfg, params = tiny
    tree = params if precision == "bf16" else generate.quantize_params(params)
    model = generate.build_model(cfg, tree)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    full = np.asarray(model(tokens))
    cached = _teacher_forced(model, tokens, prompt_len=5)
    scale = np.abs(full).max()
    # Equal up to bf16 rounding (attention over a longer, masked cache; other GEMM shapes).
    np.testing.assert_allclose(cached, full, atol=0.02 * scale, rtol=0)
    assert np.mean(cached.argmax(-1) == full.argmax(-1)) >= 0.9


def test_nvfp4_tree_is_frozen_weight_only(tiny):
    cfg, params = tiny
    model = generate.build_model(cfg, generate.quantize_params(params))
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, nvfp4_jax.nnx.Linear)
    assert attn.q_proj.activations == "high_precision"
    assert type(model.lm_head) is nnx.Linear and model.lm_head.kernel.dtype == jnp.bfloat16
    # q/k/v share their group's tensor amax, as the exporter writes them.
    amaxes = {
        float(getattr(attn, n).kernel.get_value().amax) for n in ("q_proj", "k_proj", "v_proj")
    }
    assert len(amaxes) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens", "0"], "--tokens"),
        (["--batch", "x"], "--batch"),
        (["--precision", "fp8"], "--precision"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--prompt", ""], "--prompt"),
        (["--width", "24"], "--width"),
        (["--width", "32", "--heads", "3"], "--width"),
        (["--run", "bf16"], "--run"),
        (["--checkpoint", "/nonexistent/x"], "--checkpoint"),
        (["--hf", "/nonexistent/x"], "--hf"),
        (["--hf", ".", "--checkpoint", "."], "not allowed with"),
        (["--hf", ".", "--width", "32"], "--width"),
    ],
)
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_hf_folder_without_config_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--hf", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "config.json" in capsys.readouterr().err


def test_main_end_to_end_and_deterministic(capsys):
    argv = [*TINY, "--tokens", "4", "--batch", "2", "--prompt", "ab"]
    first = generate.main(argv)
    out = capsys.readouterr().out
    for line in (
        "host: ",
        "kernel ISA",
        "[bf16] prefill",
        "[nvfp4] prefill",
        "tokens/s",
        "[nvfp4] text:",
        "nvfp4 vs bf16:",
    ):
        assert line in out
    assert first["bf16"]["tokens"].shape == (2, 4)
    assert 0 <= first["agreement"] <= 1
    second = generate.main([*argv, "--precision", "bf16"])
    np.testing.assert_array_equal(first["bf16"]["tokens"], second["bf16"]["tokens"])
    # Greedy decoding: the tokens are the argmax of the logits returned at each step.
    np.testing.assert_array_equal(first["nvfp4"]["tokens"], first["nvfp4"]["logits"].argmax(-1).T)


def test_sampling_is_seeded():
    argv = [*TINY, "--tokens", "2", "--precision", "bf16", "--temperature", "1.5"]
    a = generate.main([*argv, "--seed", "1"])["bf16"]["tokens"]
    b = generate.main([*argv, "--seed", "1"])["bf16"]["tokens"]
    np.testing.assert_array_equal(a, b)


def test_main_from_a_train_lm_nvfp4_checkpoint(tmp_path, capsys):
    """A train_lm NVFP4 run's checkpoint (saved untrained: no compile): its layers trained in
    NVFP4 are frozen, the ones its rules kept in bf16 (the last block, the head) stay bf16."""
    import train_lm  # noqa: PLC0415

    out = tmp_path / "run"
    flags = ["--recipe", "nvfp4", "--width", "32", "--depth", "2", "--heads", "2"]
    args = train_lm.parse_args([*flags, "--seq-len", "16", "--steps", "1", "--out", str(out)])
    model = train_lm.make_model(args, "nvfp4")
    optimizer = train_lm.make_optimizer(model, args)
    text = train_lm.load_text(None)
    checkpoints = train_lm.Checkpoints(train_lm.checkpoint_folder(args, "nvfp4"))
    checkpoints.save(1, model, optimizer, {}, train_lm.run_config(args, text))
    result = generate.main(["--checkpoint", str(out), "--tokens", "3", "--precision", "nvfp4"])
    printed = capsys.readouterr().out
    assert "step 1" in printed and "7 frozen NVFP4 linears" in printed  # layer 0's seven
    assert result["nvfp4"]["tokens"].shape == (1, 3)
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--checkpoint", str(out), "--run", "bf16"])
    assert exit_info.value.code == 2
    assert "a bf16 run" in capsys.readouterr().err


# --- mixture of experts: frozen NVFP4 experts ------------------------------------------------

MOE = dict(width=32, depth=2, heads=2, experts=4, top_k=2, expert_intermediate=32)


@pytest.fixture(scope="module")
def tiny_moe():
    cfg = LMConfig(**MOE)
    model = TransformerLM(cfg, nnx.Rngs(params=5))
    params, _ = generate._params_only(generate._plain(nnx.to_pure_dict(nnx.state(model))))
    return cfg, params


def test_moe_experts_freeze_as_nvfp4_and_decode_as_the_full_forward(tiny_moe):
    cfg, params = tiny_moe
    tree = generate.quantize_params(params)
    model = generate.build_model(cfg, tree)
    experts = model.layers[0].mlp.experts
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(experts, name)
        assert isinstance(layer, nvfp4_jax.nnx.Experts)
        assert isinstance(layer.kernel, nvfp4_jax.nnx.QuantizedKernel), name
        q = layer.kernel.get_value()
        assert q.shape == (
            cfg.experts,
            *np.shape(params["layers"][0]["mlp"]["experts"][name]["kernel"])[1:],
        )
        # One tensor amax per expert: each expert's own (gate and up share theirs).
        kernel = np.asarray(params["layers"][0]["mlp"]["experts"][name]["kernel"], np.float32)
        if name == "down_proj":
            np.testing.assert_array_equal(q.amax, np.abs(kernel).max(axis=(1, 2)))
    gate, up = (getattr(experts, n).kernel.get_value().amax for n in ("gate_proj", "up_proj"))
    np.testing.assert_array_equal(gate, up)
    # The cached decode through the frozen experts equals the full forward (as for linears).
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 10)), jnp.int32)
    full = np.asarray(model(tokens))
    cached = _teacher_forced(model, tokens, prompt_len=4)
    np.testing.assert_allclose(cached, full, atol=0.02 * np.abs(full).max(), rtol=0)
    # And NVFP4 stays close to bf16 (the same weights dequantized).
    bf16 = np.asarray(generate.build_model(cfg, generate.dequantize_params(tree))(tokens))
    np.testing.assert_allclose(full, bf16, atol=0.05 * np.abs(bf16).max(), rtol=0)


def test_moe_hf_export_loads_with_frozen_experts(tiny_moe, tmp_path):
    # The example's MoE exported as a Mixtral NVFP4 checkpoint: --hf loads its experts stacked
    # and frozen, bit for bit the weights quantize_params freezes from the same bf16 model.
    cfg, params = tiny_moe
    model = generate.build_model(cfg, params)
    out = tmp_path / "moe"
    nvfp4_jax.export_hf_checkpoint(
        out,
        model,
        name_map=nvfp4_jax.hf.mixtral_name_map(),
        quant_algo="W4A16_NVFP4",
        block_2d=False,  # 1x16 blocks, as quantize_params freezes them
        config=cfg.hf_config(),
    )
    args = generate.parse_args(["--hf", str(out)])
    loaded_cfg, trees, _ = generate.load_weights(args)
    assert loaded_cfg.experts == cfg.experts
    frozen = generate.build_model(loaded_cfg, trees["nvfp4"])
    ours = generate.quantize_params(params)
    for name in ("gate_proj", "up_proj", "down_proj"):
        got = getattr(frozen.layers[1].mlp.experts, name).kernel.get_value()
        want = ours["layers"][1]["mlp"]["experts"][name]["kernel"]
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
        np.testing.assert_array_equal(
            np.asarray(got.scales).view(np.uint8), np.asarray(want.scales).view(np.uint8)
        )
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (1, 6)), jnp.int32)
    assert np.isfinite(np.asarray(frozen(tokens))).all()
