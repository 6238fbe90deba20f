"""examples/generate.py: the cached decode equals lm_model's forward, flags, end to end.

* the NVFP4 weights are what `export_hf_checkpoint` writes, bit for bit (16x16 blocks, the
  fused groups' amaxes, a train_lm NVFP4 run's rules and weight Four Over Six);
* `--hf` folders the library writes: Llama's attention and MLP biases and tied embeddings
  decode with them; a config.json setting the model does not compute (rope scaling, a
  sliding window, qk-norm, ...) or weights its config's model lacks exit 2 naming it;
* the host line's kernel ISA is `nvfp4_jax.kernels.cpu_isa()`'s.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import generate
import lm_model
from lm_model import LMConfig, TransformerLM

import nvfp4_jax

TINY = ["--width", "32", "--depth", "2", "--heads", "2"]


def _params(model) -> dict:
    """A model's parameters as nested dicts of arrays (what generate decodes)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _nvfp4_leaves(tree) -> dict:
    """`{path: NVFP4Array}` of a tree."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=nvfp4_jax.is_nvfp4_array)[0]
    return {
        jax.tree_util.keystr(path): leaf for path, leaf in flat if nvfp4_jax.is_nvfp4_array(leaf)
    }


def _assert_same_nvfp4(got: dict, want: dict) -> None:
    """The same NVFP4 kernels at the same paths: codes, block scales and decode scales."""
    got, want = _nvfp4_leaves(got), _nvfp4_leaves(want)
    assert sorted(got) == sorted(want)
    for path, q in want.items():
        for field in ("codes", "scales", "global_scale"):
            a, b = np.asarray(getattr(got[path], field)), np.asarray(getattr(q, field))
            assert a.shape == b.shape and a.tobytes() == b.tobytes(), f"{path} {field}"


def _exported(folder, model_or_params, cfg: LMConfig, **options) -> dict:
    """What `export_hf_checkpoint` writes (weight-only), as `load_hf_checkpoint` reads it."""
    name_map = nvfp4_jax.hf.mixtral_name_map() if cfg.experts else None
    nvfp4_jax.export_hf_checkpoint(
        folder,
        model_or_params,
        name_map=name_map,
        quant_algo="W4A16_NVFP4",
        config=cfg.hf_config(),
        **options,
    )
    return nvfp4_jax.load_hf_checkpoint(folder, name_map=name_map)


@pytest.fixture(scope="module")
def tiny():
    cfg = LMConfig(width=32, depth=2, heads=2)
    model = TransformerLM(cfg, nnx.Rngs(params=3))
    return cfg, _params(model)


def _teacher_forced(model, tokens, prompt_len, kv_cache="bf16", scales=None):
    """Cached logits of every position: prefill `prompt_len`, then one token per step (an
    NVFP4 cache's scales `scales`, or calibrated by the prefill)."""
    cfg = model.cfg
    b, t = tokens.shape
    cache = generate.empty_cache(cfg, b, t, kv_cache, scales)
    calibrate = kv_cache != "bf16" and scales is None
    logits, cache = generate.forward_cached(
        model, cache, tokens[:, :prompt_len], jnp.int32(0), calibrate
    )
    out = [logits]
    step = jax.jit(lambda c, tok, pos: generate.forward_cached(model, c, tok, pos))
    for pos in range(prompt_len, t):
        logits, cache = step(cache, tokens[:, pos : pos + 1], jnp.int32(pos))
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1))


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_cached_decode_equals_full_forward(tiny, precision):
    cfg, params = tiny
    tree = params if precision == "bf16" else generate.export_nvfp4(cfg, params)
    model = generate.build_model(cfg, tree)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    full = np.asarray(model(tokens))
    cached = _teacher_forced(model, tokens, prompt_len=5)
    scale = np.abs(full).max()
    # Equal up to bf16 rounding (attention over a longer, masked cache; other GEMM shapes).
    np.testing.assert_allclose(cached, full, atol=0.02 * scale, rtol=0)
    assert np.mean(cached.argmax(-1) == full.argmax(-1)) >= 0.9


@pytest.mark.parametrize("kv_cache", ["nvfp4", "nvfp4_4over6"])
def test_nvfp4_kv_cache_steps_equal_its_prefill(kv_cache):
    """With the NVFP4 cache, a prefill then one token per step (the native attention) gives
    the logits of one prefill of every token (the attention over the dequantized cache), up
    to bf16 rounding; and mostly the bf16 cache's greedy tokens (a random model: its logits
    move by about 20% in norm under the cache's quantization, as under fake quantization of
    k and v alone)."""
    cfg = LMConfig(width=128, depth=2, heads=2)  # head size 64: V scales swizzled
    assert generate.kv_config(cfg, kv_cache).scale_swizzle == "v"
    model = generate.build_model(cfg, _params(TransformerLM(cfg, nnx.Rngs(params=5))))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 40)), jnp.int32)
    scales = [(0.01, 0.005)] * cfg.depth
    stepped = _teacher_forced(model, tokens, prompt_len=24, kv_cache=kv_cache, scales=scales)
    cache = generate.empty_cache(cfg, 2, 40, kv_cache, scales)
    whole = np.asarray(generate.forward_cached(model, cache, tokens, jnp.int32(0))[0])
    np.testing.assert_allclose(stepped, whole, atol=0.02 * np.abs(whole).max(), rtol=0)
    bf16 = _teacher_forced(model, tokens, prompt_len=24)
    calibrated = _teacher_forced(model, tokens, prompt_len=24, kv_cache=kv_cache)
    assert np.mean(calibrated.argmax(-1) == bf16.argmax(-1)) >= 0.6


def test_nvfp4_tree_is_frozen_weight_only(tiny):
    cfg, params = tiny
    model = generate.build_model(cfg, generate.export_nvfp4(cfg, params))
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, nvfp4_jax.nnx.Linear)
    assert attn.q_proj.activations == "high_precision"
    assert type(model.lm_head) is nnx.Linear and model.lm_head.kernel.dtype == jnp.bfloat16
    # q/k/v share their group's tensor amax, as the exporter writes them.
    amaxes = {
        float(getattr(attn, n).kernel.get_value().amax) for n in ("q_proj", "k_proj", "v_proj")
    }
    assert len(amaxes) == 1


def test_nvfp4_weights_are_what_the_exporter_writes(tmp_path):
    # The random model's NVFP4 weights: bit for bit export_hf_checkpoint's defaults (16x16
    # blocks, the fused groups' amaxes), not a quantization of the example's own.
    args = generate.parse_args([*TINY, "--seed", "4"])
    cfg, trees, _ = generate.load_weights(args)
    model = TransformerLM(cfg, nnx.Rngs(params=4))
    _assert_same_nvfp4(trees["nvfp4"], _exported(tmp_path / "export", model, cfg))
    # The high-precision tensors are the bf16 run's own (the head, embeddings, norms).
    np.testing.assert_array_equal(trees["nvfp4"]["norm"]["scale"], trees["bf16"]["norm"]["scale"])


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


def test_main_with_the_nvfp4_kv_cache(capsys):
    """`--kv-cache nvfp4` decodes both precisions with the NVFP4 cache and says so."""
    result = generate.main([*TINY, "--tokens", "3", "--kv-cache", "nvfp4", "--prompt", "abc"])
    out = capsys.readouterr().out
    assert "KV cache: nvfp4 (vLLM's --kv-cache-dtype nvfp4" in out
    assert result["nvfp4"]["tokens"].shape == (1, 3)
    np.testing.assert_array_equal(result["nvfp4"]["tokens"], result["nvfp4"]["logits"].argmax(-1).T)
    with pytest.raises(SystemExit):
        generate.main([*TINY, "--kv-cache", "fp8"])


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
    config = train_lm.saved_config(train_lm.run_config(args, text), "nvfp4", args)
    checkpoints.save(1, model, optimizer, {}, config)
    result = generate.main(["--checkpoint", str(out), "--tokens", "3", "--precision", "nvfp4"])
    printed = capsys.readouterr().out
    assert "step 1" in printed and "7 frozen NVFP4 linears" in printed  # layer 0's seven
    assert result["nvfp4"]["tokens"].shape == (1, 3)
    # Its NVFP4 weights are what the exporter writes for the trained model: its layers in
    # NVFP4 only, each with the run's weight Four Over Six (the default recipe's "mse").
    assert train_lm.nvfp4_recipe(args).weight_four_over_six == "mse"
    cfg, trees, _ = generate.load_weights(generate.parse_args(["--checkpoint", str(out)]))
    _assert_same_nvfp4(trees["nvfp4"], _exported(tmp_path / "export", model, cfg))
    # A checkpoint saved before train_lm saved its rules: the rules its flags make.
    old = train_lm.Checkpoints(tmp_path / "old")
    old.save(1, model, optimizer, {}, train_lm.run_config(args, text))
    _, old_trees, _ = generate.load_weights(generate.parse_args(["--checkpoint", str(old.folder)]))
    _assert_same_nvfp4(old_trees["nvfp4"], trees["nvfp4"])
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
    return cfg, _params(model)


def test_moe_experts_freeze_as_nvfp4_and_decode_as_the_full_forward(tiny_moe):
    cfg, params = tiny_moe
    tree = generate.export_nvfp4(cfg, params)
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
        # One tensor amax per expert: each expert's own (gate and up share theirs); read back
        # from the checkpoint's decode scale (amax / 2688), so to an f32 rounding.
        kernel = np.asarray(params["layers"][0]["mlp"]["experts"][name]["kernel"], np.float32)
        if name == "down_proj":
            np.testing.assert_allclose(q.amax, np.abs(kernel).max(axis=(1, 2)), rtol=1e-6)
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
    # The example's MoE exported as a Mixtral NVFP4 checkpoint (the exporter's defaults): its
    # NVFP4 run decodes with exactly those weights, and --hf loads them stacked and frozen.
    cfg, params = tiny_moe
    exported = _exported(tmp_path / "moe", TransformerLM(cfg, nnx.Rngs(params=5)), cfg)
    _assert_same_nvfp4(generate.export_nvfp4(cfg, params), exported)
    loaded_cfg, trees, _ = generate.load_weights(
        generate.parse_args(["--hf", str(tmp_path / "moe")])
    )
    assert loaded_cfg.experts == cfg.experts
    _assert_same_nvfp4(trees["nvfp4"], exported)
    frozen = generate.build_model(loaded_cfg, trees["nvfp4"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(
            getattr(frozen.layers[1].mlp.experts, name).kernel, nvfp4_jax.nnx.QuantizedKernel
        )
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (1, 6)), jnp.int32)
    assert np.isfinite(np.asarray(frozen(tokens))).all()


# --- Hugging Face folders: biases, tied embeddings, settings the model does not compute -------


def _at(tree: dict, path: tuple):
    """The node of a loaded tree at a module path (layer indices as ints or strings)."""
    for key in path:
        tree = tree[key] if key in tree else tree[str(key)]
    return tree


def _reference_logits(model: TransformerLM, tree: dict, tokens: jax.Array) -> np.ndarray:
    """f32 logits of `tokens` by the original model (Flax's own layers, biases included)
    holding a loaded checkpoint's weights (NVFP4 ones dequantized), its head computed here:
    `lm_head`'s kernel, or with tied embeddings the embedding table transposed."""
    ref = nnx.clone(model)
    for path, variable in list(nnx.iter_graph(ref)):
        if isinstance(variable, nnx.Param) and path[0] != "lm_head":
            value = _at(tree, path)
            if nvfp4_jax.is_nvfp4_array(value):
                value = nvfp4_jax.dequantize(value, jnp.float32)
            variable.set_value(jnp.asarray(value, jnp.float32))
    x = ref.embed_tokens(tokens)
    for layer in ref.layers:
        x, _ = layer(x)
    head = tree["lm_head"]["kernel"] if "lm_head" in tree else tree["embed_tokens"]["embedding"].T
    return np.asarray(ref.norm(x).astype(jnp.float32) @ jnp.asarray(head, jnp.float32))


def _with_random_biases(model: TransformerLM, seed: int) -> TransformerLM:
    # nnx.Linear's biases start at zeros: random ones, large enough to move the logits.
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and module.bias is not None:
            module.bias[...] = jnp.asarray(rng.normal(0, 0.5, module.bias.shape), jnp.float32)
    return model


def _decodes_as_the_reference(folder, model, precision: str, capsys) -> tuple:
    """Checks that generate --hf's prefill logits (the prompt's last position) equal the
    reference's to bf16 rounding; returns (the loaded tree, the prompt, the logits, the
    tolerance)."""
    prompt = "a Llama"
    result = generate.main(
        ["--hf", str(folder), "--tokens", "2", "--precision", precision, "--prompt", prompt]
    )
    assert "[" + precision + "] text:" in capsys.readouterr().out
    got = result[precision]["logits"][0]  # (batch, vocab) at the prompt's last position
    tree = nvfp4_jax.load_hf_checkpoint(folder)
    tokens = jnp.asarray(np.frombuffer(prompt.encode(), np.uint8)[None], jnp.int32)
    want = _reference_logits(model, tree, tokens)[:, -1]
    atol = 0.02 * np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    return tree, tokens, got, atol


BIASED = dict(width=32, depth=2, heads=2, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """A Llama with attention and MLP biases exported as an NVFP4 Hugging Face folder."""
    cfg = LMConfig(**BIASED)
    model = _with_random_biases(TransformerLM(cfg, nnx.Rngs(params=6)), seed=6)
    folder = tmp_path_factory.mktemp("biased") / "hf"
    nvfp4_jax.export_hf_checkpoint(folder, model, quant_algo="W4A16_NVFP4", config=cfg.hf_config())
    return model, folder


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_hf_llama_with_biases_decodes_with_them(biased, precision, capsys):
    model, folder = biased
    tree, tokens, got, atol = _decodes_as_the_reference(folder, model, precision, capsys)
    # Without its biases the model computes other logits: the check above sees them.
    unbiased = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if path[-1].key == "bias" else x,
        tree,
        is_leaf=nvfp4_jax.is_nvfp4_array,
    )
    assert np.abs(got - _reference_logits(model, unbiased, tokens)[:, -1]).max() > 10 * atol


def test_hf_weights_the_config_does_not_make_exit_2(biased, tmp_path, capsys):
    # attention_bias: true puts a bias on o_proj too (Hugging Face's Llama): a folder without
    # it is refused, naming it, and so is a bias its config has no place for.
    model, _ = biased
    params = _params(model)
    for layer in params["layers"].values():
        del layer["self_attn"]["o_proj"]["bias"]
    biases = LMConfig(**BIASED).hf_config()
    for name, config in (("o_proj", biases), ("k_proj", biases | {"attention_bias": False})):
        folder = tmp_path / name
        nvfp4_jax.export_hf_checkpoint(folder, params, quant_algo="W4A16_NVFP4", config=config)
        for precision in ("nvfp4", "bf16"):
            with pytest.raises(SystemExit) as exit_info:
                generate.main(["--hf", str(folder), "--tokens", "1", "--precision", precision])
            assert exit_info.value.code == 2
            assert f"layers/0/self_attn/{name}/bias" in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_hf_llama_with_tied_embeddings_decodes(tmp_path, precision, capsys):
    # No lm_head.weight: the head is the embedding table, transposed (Hugging Face's tying).
    cfg = LMConfig(width=32, depth=2, heads=2, tie_word_embeddings=True)
    model = TransformerLM(cfg, nnx.Rngs(params=7))
    assert model.lm_head is None
    folder = tmp_path / "tied"
    nvfp4_jax.export_hf_checkpoint(folder, model, quant_algo="W4A16_NVFP4", config=cfg.hf_config())
    assert "lm_head.weight" not in nvfp4_jax.hf.read_safetensors(folder / "model.safetensors")
    _decodes_as_the_reference(folder, model, precision, capsys)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama exported as an NVFP4 Hugging Face folder."""
    cfg = LMConfig(width=32, depth=1, heads=2)
    folder = tmp_path_factory.mktemp("llama") / "hf"
    model = TransformerLM(cfg, nnx.Rngs(params=8))
    nvfp4_jax.export_hf_checkpoint(folder, model, quant_algo="W4A16_NVFP4", config=cfg.hf_config())
    return folder


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "original_max_position": 64}),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
        (
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        ),
        ("sliding_window", 16),
        ("use_qk_norm", True),
        ("no_rope_layers", [0]),
        ("hidden_act", "gelu"),
        ("head_dim", 8),
        ("mlp_bias", "yes"),
        ("model_type", "qwen3"),
        ("architectures", ["Qwen3ForCausalLM"]),
        ("num_local_experts", 4),
    ],
)
def test_hf_config_settings_the_model_does_not_compute_exit_2(
    llama_folder, tmp_path, key, value, capsys
):
    # Never decoded as if the setting were absent: refused, naming the key.
    folder = tmp_path / "hf"
    shutil.copytree(llama_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--hf", str(folder), "--tokens", "1", "--precision", "bf16"])
    assert exit_info.value.code == 2
    assert f"config.json key {key!r}" in capsys.readouterr().err


def test_hf_config_round_trips_and_refuses_what_mixtral_lacks():
    for cfg in (
        LMConfig(**BIASED),
        LMConfig(width=32, heads=2, tie_word_embeddings=True),
        LMConfig(width=32, heads=2, experts=4),
    ):
        loaded = LMConfig.from_hf_config(cfg.hf_config(), intermediate=cfg.intermediate)
        assert loaded == cfg
    moe = LMConfig(width=32, heads=2, experts=4).hf_config()
    with pytest.raises(ValueError, match="'attention_bias'.*MixtralForCausalLM has no"):
        LMConfig.from_hf_config(moe | {"attention_bias": True})
    with pytest.raises(ValueError, match="key 'model_type' \\(= 'gemma'\\)"):
        LMConfig.from_hf_config(moe | {"model_type": "gemma"})


# --- lm_model.from_params: the tree is the config's model, whole --------------------------------


def test_from_params_refuses_a_tree_that_is_not_the_configs_model(tiny):
    cfg, params = tiny
    tied = lm_model.from_params(
        LMConfig(width=32, depth=2, heads=2, tie_word_embeddings=True),
        {k: v for k, v in params.items() if k != "lm_head"},
    )
    x = jnp.ones((1, 3, 32), jnp.float32)
    want = x @ jnp.asarray(params["embed_tokens"]["embedding"]).T
    np.testing.assert_allclose(tied.head(x), want, rtol=1e-6)
    with pytest.raises(ValueError, match="lm_head/kernel: the model has no module lm_head"):
        lm_model.from_params(LMConfig(width=32, depth=2, heads=2, tie_word_embeddings=True), params)
    with pytest.raises(ValueError, match="the tree lacks parameters .* lm_head/kernel"):
        lm_model.from_params(cfg, {k: v for k, v in params.items() if k != "lm_head"})
    wrong = jax.tree.map(lambda x: x, params)
    wrong["norm"]["scale"] = np.ones(16, np.float32)
    with pytest.raises(ValueError, match=r"norm/scale is \(16,\), the model's is \(32,\)"):
        lm_model.from_params(cfg, wrong)
    extra = jax.tree.map(lambda x: x, params)
    extra["layers"][0]["self_attn"]["q_proj"]["bias"] = np.ones(32, np.float32)
    with pytest.raises(ValueError, match="q_proj/bias: the model has no such parameter"):
        lm_model.from_params(cfg, extra)


# --- the host line -----------------------------------------------------------------------------


def test_host_line_reports_the_native_cpu_isa(monkeypatch):
    isa = nvfp4_jax.kernels.cpu_isa()
    assert f"kernel ISA {isa if isa is not None else 'none'}" in generate.host_line()
    monkeypatch.setattr(nvfp4_jax.kernels, "cpu_isa", lambda: None)
    monkeypatch.setattr(nvfp4_jax.kernels, "unavailable_reason", lambda platform=None: "why")
    assert "kernel ISA none (no native CPU kernels: why)" in generate.host_line()

    def broken():
        raise RuntimeError("the ISA query failed")

    monkeypatch.setattr(nvfp4_jax.kernels, "cpu_isa", broken)
    with pytest.raises(RuntimeError, match="the ISA query failed"):  # not swallowed
        generate.host_line()
