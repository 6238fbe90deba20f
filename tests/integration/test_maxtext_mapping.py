"""MaxText's tree <-> Hugging Face NVFP4, without MaxText: the mapping on synthetic trees.

`nvfp4_jax._src.integrations.maxtext_names` maps MaxText's parameter tree (as MaxText 0.2.5
stores it; the shapes below were read off its own checkpoints) to the HF-named Flax tree the
exporter writes, and back; `maxtext_plan` decides each linear's precision from the
launcher's rules, quantizes with the training recipe's weight settings and reuses a released
checkpoint's bytes. These tests need no MaxText (configs are `SimpleNamespace`s with its
field names) and run with the rest of the suite; `test_maxtext_export.py` runs the same on
trained MaxText checkpoints in MaxText's environment.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from types import SimpleNamespace

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors

import nvfp4_jax
from nvfp4_jax._src.integrations import maxtext_names as names
from nvfp4_jax._src.integrations import maxtext_plan as plan
from nvfp4_jax._src.integrations.maxtext_export import write_export
from nvfp4_jax.maxtext import rules_from_config
from nvfp4_jax.rules import Rule

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "modelopt_llama_nvfp4"
BF16 = ml_dtypes.bfloat16

FIELDS = dict(
    num_decoder_layers=2,
    emb_dim=64,
    num_query_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=32,
    moe_mlp_dim=32,
    vocab_size=64,
    scan_layers=True,
    param_scan_axis=1,
    num_experts=1,
    num_experts_per_tok=0,
    logits_via_embedding=False,
    normalize_embedding_logits=True,
    mlp_activations=["silu", "linear"],
    max_target_length=32,
    rope_max_timescale=10000,
    normalization_layer_epsilon=1e-5,
    model_name="default",
    quantize_mtp=False,
)
MOE = dict(num_experts=4, num_experts_per_tok=2)


def config(block: str = "llama2", **fields) -> SimpleNamespace:
    values = dict(FIELDS, decoder_block=block)
    if block.startswith("qwen3"):
        values["use_qk_norm"] = True
    if block in ("mixtral", "qwen3_moe"):
        values.update(MOE)
    values.update(fields)
    return SimpleNamespace(**values)


# The leaves of MaxText 0.2.5's tree, as its checkpoints hold them (scan_layers=True,
# param_scan_axis=1): read off checkpoints its trainer wrote for these configs.
SCANNED_SHAPES = {
    "llama2": {
        "decoder/layers/self_attention/query/kernel": (64, 2, 4, 16),
        "decoder/layers/self_attention/key/kernel": (64, 2, 2, 16),
        "decoder/layers/self_attention/out/kernel": (4, 2, 16, 64),
        "decoder/layers/mlp/wi_0/kernel": (64, 2, 32),
        "decoder/layers/mlp/wo/kernel": (32, 2, 64),
        "decoder/layers/pre_self_attention_layer_norm/scale": (64, 2),
        "decoder/logits_dense/kernel": (64, 64),
        "token_embedder/embedding": (64, 64),
    },
    "qwen3_moe": {
        "decoder/layers/moe_block/gate/kernel": (64, 2, 4),
        "decoder/layers/moe_block/wi_0": (4, 2, 64, 32),
        "decoder/layers/moe_block/wo": (4, 2, 32, 64),
        "decoder/layers/self_attention/query_norm/scale": (16, 2),
    },
}


def random_params(spec: names.ModelSpec, seed: int = 0) -> dict:
    """A MaxText tree of the spec's shapes: f32 weights of varied scales (amaxes differ)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for index, (path, shape) in enumerate(sorted(names.expected_shapes(spec).items())):
        scale = 0.05 * (1 + index % 5)
        flat[path] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return names.nested(flat)


def flat(tree, prefix=()):
    out = {}
    for key, value in tree.items():
        path = (*prefix, key)
        out.update(flat(value, path) if isinstance(value, dict) else {path: value})
    return out


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --- the spec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block, expected", list(SCANNED_SHAPES.items()))
def test_the_tree_is_maxtexts(block, expected):
    shapes = names.expected_shapes(names.model_spec(config(block)))
    shapes = {"/".join(path): shape for path, shape in shapes.items()}
    for path, shape in expected.items():
        assert shapes[path] == shape, path


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"decoder_block": "gemma2"}, "decoder_block='gemma2'"),
        ({"fused_qkv": True}, "fused_qkv=True"),
        ({"final_logits_soft_cap": 30.0}, "final_logits_soft_cap=30.0"),
        ({"mlp_activations": ["gelu", "linear"]}, "mlp_activations"),
        ({"use_qk_norm": True}, "use_qk_norm=True: LlamaForCausalLM has no q/k norms"),
        ({"num_experts": 8}, "num_experts=8: decoder_block=llama2 is a dense family"),
        ({"rope_type": "yarn"}, "rope_type='yarn'"),
        ({"logits_via_embedding": True}, "normalize_embedding_logits=True"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ],
)
def test_settings_hf_cannot_compute_are_refused_by_name(fields, message):
    values = dict(fields)
    block = values.pop("decoder_block", "llama2")
    with pytest.raises(ValueError, match=re.escape(message)):
        names.model_spec(config(block, **values))


def test_qwen3_needs_its_qk_norms():
    with pytest.raises(ValueError, match="use_qk_norm=False: Qwen3ForCausalLM normalizes"):
        names.model_spec(config("qwen3", use_qk_norm=False))


def test_hf_configs_of_the_families():
    llama = names.hf_config(names.model_spec(config("llama2")))
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["head_dim"] == 16
    assert llama["num_key_value_heads"] == 2 and "rope_scaling" not in llama
    llama31 = names.hf_config(names.model_spec(config("llama2", model_name="llama3.1-8b")))
    assert llama31["rope_scaling"]["rope_type"] == "llama3"
    mixtral = names.hf_config(names.model_spec(config("mixtral")))
    assert (mixtral["num_local_experts"], mixtral["intermediate_size"]) == (4, 32)
    moe = names.hf_config(names.model_spec(config("qwen3_moe")))
    # MaxText softmaxes the top-k logits: the top-k probabilities renormalized.
    assert moe["norm_topk_prob"] is True and moe["moe_intermediate_size"] == 32
    tied = names.model_spec(
        config("qwen3", logits_via_embedding=True, normalize_embedding_logits=False)
    )
    assert names.hf_config(tied)["tie_word_embeddings"] is True
    assert "lm_head/kernel" not in {e.hf for e in names.entries(tied)}


# --- the arrays --------------------------------------------------------------------------------


def test_the_layouts_by_hand():
    """Each HF tensor from MaxText's leaves, written out here without the module's tables."""
    spec = names.model_spec(config("mixtral"))
    params = random_params(spec)
    layers = params["decoder"]["layers"]
    hf = {
        e.hf: names.to_hf(e, names.layer_of(names.leaf(params, e.maxtext), e, spec), spec)
        for e in names.entries(spec)
    }
    for i in range(2):
        query = layers["self_attention"]["query"]["kernel"][:, i]  # (D, H, E)
        assert same_bits(
            hf[f"layers/{i}/self_attn/q_proj/kernel"], query.reshape(64, 64) * np.float32(4)
        )
        out = layers["self_attention"]["out"]["kernel"][:, i]  # (H, E, D)
        assert same_bits(hf[f"layers/{i}/self_attn/o_proj/kernel"], out.reshape(64, 64))
        key = layers["self_attention"]["key"]["kernel"][:, i]
        assert same_bits(hf[f"layers/{i}/self_attn/k_proj/kernel"], key.reshape(64, 32))
        moe = layers["MoeBlock_0"]
        assert same_bits(hf[f"layers/{i}/mlp/experts/up_proj/kernel"], moe["wi_1"][:, i])
        assert same_bits(hf[f"layers/{i}/mlp/experts/down_proj/kernel"], moe["wo"][:, i])
        assert same_bits(hf[f"layers/{i}/mlp/gate/kernel"], moe["gate"]["kernel"][:, i])
        norm = layers["post_self_attention_layer_norm"]["scale"][:, i]
        assert same_bits(hf[f"layers/{i}/post_attention_layernorm/scale"], norm)
    assert same_bits(hf["lm_head/kernel"], params["decoder"]["logits_dense"]["kernel"])


def test_llama31_rope_rows_are_evens_then_odds():
    spec = names.model_spec(
        config("llama2", model_name="llama3.1-8b", head_dim=4, num_query_heads=16)
    )
    entry = next(e for e in names.entries(spec) if e.hf == "layers/0/self_attn/q_proj/kernel")
    kernel = np.arange(64 * 16 * 4, dtype=np.float32).reshape(64, 16, 4)
    hf = names.to_hf(entry, kernel, spec)
    # sqrt(4) = 2; each head's (d0, d1, d2, d3) -> (d0, d2, d1, d3)
    assert same_bits(hf, (kernel[:, :, [0, 2, 1, 3]] * np.float32(2)).reshape(64, 64))
    assert same_bits(names.to_maxtext(entry, hf, kernel.shape, np.float32), kernel)


@pytest.mark.parametrize("block", sorted(names.FAMILIES))
@pytest.mark.parametrize("scan", ["scan_axis1", "scan_axis0", "unscanned"])
def test_maxtext_to_hf_and_back_is_the_identity(block, scan):
    fields = {
        "scan_layers": scan != "unscanned",
        "param_scan_axis": 0 if scan == "scan_axis0" else 1,
    }
    spec = names.model_spec(config(block, head_dim=64, num_query_heads=2, num_kv_heads=1, **fields))
    params = random_params(spec)
    hf_flat = {
        e.hf: names.to_hf(e, names.layer_of(names.leaf(params, e.maxtext), e, spec), spec)
        for e in names.entries(spec)
    }
    back = plan.to_maxtext_tree(hf_flat, spec)  # sqrt(64) = 8: exact both ways
    assert flat(back).keys() == flat(params).keys()
    assert all(same_bits(flat(back)[k], v) for k, v in flat(params).items())
    unscanned = names.model_spec(
        config(block, head_dim=64, num_query_heads=2, num_kv_heads=1, scan_layers=False)
    )
    restacked = names.restack(names.restack(params, spec, unscanned), unscanned, spec)
    assert all(same_bits(flat(restacked)[k], v) for k, v in flat(params).items())


def test_an_hf_tree_of_another_model_is_refused_by_name():
    spec = names.model_spec(config("llama2"))
    params = random_params(spec)
    hf_flat = {
        e.hf: names.to_hf(e, names.layer_of(names.leaf(params, e.maxtext), e, spec), spec)
        for e in names.entries(spec)
    }
    missing = {k: v for k, v in hf_flat.items() if k != "layers/1/mlp/up_proj/kernel"}
    with pytest.raises(ValueError, match="no layers/1/mlp/up_proj/kernel"):
        plan.to_maxtext_tree(missing, spec)
    wrong = dict(hf_flat, **{"layers/0/mlp/up_proj/kernel": np.zeros((64, 48), np.float32)})
    with pytest.raises(ValueError, match=r"layers/0/mlp/up_proj/kernel is \(64, 48\)"):
        plan.to_maxtext_tree(wrong, spec)
    extra = dict(hf_flat, **{"layers/0/mlp/experts/up_proj/kernel": np.zeros((4, 64, 32))})
    with pytest.raises(ValueError, match="has no place for"):
        plan.to_maxtext_tree(extra, spec)


# --- precision and quantization ---------------------------------------------------------------


def test_precisions_follow_the_launchers_rules():
    spec = names.model_spec(config("mixtral", scan_layers=False, mlp_dim=24))
    keep = [Rule("layers_1/self_attention/key", None)]
    decisions = plan.precisions(spec, rules_from_config(config(), rules=keep))
    nvfp4 = sorted(k for k, d in decisions.items() if d.recipe is not None)
    assert nvfp4 == sorted(
        f"layers/0/self_attn/{p}/kernel" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ) + ["layers/1/self_attn/o_proj/kernel"]
    # q and v of layer 1 were NVFP4 in training, but k was not: the fused group goes whole.
    assert (
        "trained in high precision (the rules)"
        in decisions["layers/1/self_attn/k_proj/kernel"].reason
    )
    assert (
        "in a set with layers/1/self_attn/k_proj"
        in decisions["layers/1/self_attn/q_proj/kernel"].reason
    )
    # F = 24 cannot be blocked by 16: the experts trained in high precision (and the router).
    assert "K=64 and N=24" in decisions["layers/0/mlp/experts/gate_proj/kernel"].reason
    assert decisions["layers/0/mlp/gate/kernel"].recipe is None
    assert decisions["lm_head/kernel"].recipe is None


def test_a_fused_group_trained_with_different_weight_settings_is_refused():
    spec = names.model_spec(config("llama2", scan_layers=False))
    fos = nvfp4_jax.NVFP4Recipe(weight_four_over_six="mae")
    rules = rules_from_config(config(), rules=[Rule("layers_0/mlp/wi_1", fos)])
    with pytest.raises(ValueError, match="different weight settings"):
        plan.precisions(spec, rules)


def weight_spec(recipe):
    return recipe.spec("weight", "fprop")


def test_nvfp4_weights_are_the_training_forwards_where_the_amax_is_the_groups():
    recipe = nvfp4_jax.NVFP4Recipe()
    spec = names.model_spec(config("mixtral"))
    params = random_params(spec, seed=3)
    decisions = plan.precisions(spec, rules_from_config(config(), recipe))
    tree, result = plan.hf_params(params, spec, decisions)
    layers = params["decoder"]["layers"]
    from nvfp4_jax._src.core.ops import quantize_with_spec  # noqa: PLC0415

    def q(x, amax=None):
        return quantize_with_spec(jnp.asarray(x), weight_spec(recipe), amax=amax)

    for i in range(2):
        xs = {
            "q_proj": (
                layers["self_attention"]["query"]["kernel"][:, i].astype(BF16).reshape(64, 64),
                4.0,
            ),
            "k_proj": (
                layers["self_attention"]["key"]["kernel"][:, i].astype(BF16).reshape(64, 32),
                1.0,
            ),
            "v_proj": (
                layers["self_attention"]["value"]["kernel"][:, i].astype(BF16).reshape(64, 32),
                1.0,
            ),
        }
        hf_x = {
            n: x.astype(np.float32) * np.float32(c) if c != 1 else x for n, (x, c) in xs.items()
        }
        group = max(float(np.max(np.abs(np.asarray(x, np.float32)))) for x in hf_x.values())
        for n, (x, c) in xs.items():
            got = tree[f"layers/{i}/self_attn/{n}/kernel"]
            want = q(hf_x[n], jnp.float32(group))
            assert same_bits(got.codes, want.codes) and same_bits(got.scales, want.scales), n
            own = float(np.max(np.abs(np.asarray(hf_x[n], np.float32))))
            module = f"layers/{i}/self_attn/{n}"
            assert (module in result.training_exact) == (own == group), module
            if own == group:  # the training forward's quantization of bf16(kernel), own amax
                training = q(x)
                assert same_bits(got.codes, training.codes) and same_bits(
                    got.scales, training.scales
                )
                assert np.float32(got.global_scale) == np.float32(
                    training.global_scale
                ) * np.float32(c)
            else:
                assert result.requantized[module] == "quantized with its fused group's larger amax"
        # Experts: each its own tensor; gate and up of one expert share the larger amax (M2).
        moe = layers["MoeBlock_0"]
        gate, up, down = (moe[n][:, i].astype(BF16) for n in ("wi_0", "wi_1", "wo"))
        got_up = tree[f"layers/{i}/mlp/experts/up_proj/kernel"]
        got_down = tree[f"layers/{i}/mlp/experts/down_proj/kernel"]
        for e in range(4):
            shared = max(
                np.max(np.abs(gate[e].astype(np.float32))), np.max(np.abs(up[e].astype(np.float32)))
            )
            want = q(up[e], jnp.float32(shared))
            assert same_bits(got_up.codes[e], want.codes) and same_bits(
                got_up.scales[e], want.scales
            )
            assert same_bits(got_down.codes[e], q(down[e]).codes)
            assert f"layers/{i}/mlp/experts/down_proj[{e}]" in result.training_exact
        assert tree[f"layers/{i}/mlp/gate/kernel"].dtype == BF16  # the router: bf16
    assert tree["lm_head/kernel"].dtype == BF16 and "lm_head" in result.high_precision


def test_a_query_scale_that_is_no_power_of_two_is_reported():
    spec = names.model_spec(config("llama2", head_dim=32, num_query_heads=2))
    params = random_params(spec)
    decisions = plan.precisions(spec, rules_from_config(config()))
    _, result = plan.hf_params(params, spec, decisions)
    assert "sqrt(head_dim) = 5.65685" in result.requantized["layers/0/self_attn/q_proj"]


# --- the whole export and the released checkpoint's bytes ---------------------------------------


def raw_tensors(directory: pathlib.Path) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            out[name] = (entry["dtype"], tuple(entry["shape"]), bytes(entry["data"]))
    return out


def fixture_spec() -> names.ModelSpec:
    """The MaxText config of the ModelOpt Llama fixture (hidden 128, head_dim 32, ...)."""
    fields = dict(
        emb_dim=128,
        num_query_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mlp_dim=256,
        vocab_size=512,
        normalization_layer_epsilon=1e-6,
        max_target_length=256,
    )
    return names.model_spec(config("llama2", **fields))


def test_import_then_export_returns_the_released_bytes(tmp_path):
    """The ModelOpt fixture into MaxText's tree (dequantized), and back with base=: its bytes."""
    spec = fixture_spec()
    released = names.flat_hf(nvfp4_jax.load_hf_checkpoint(FIXTURE))
    params = plan.to_maxtext_tree(released, spec)
    q = params["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert q.dtype == np.float32 and q.shape == (128, 2, 4, 32)
    # The master weights are the released values: ModelOpt's decode, divided by sqrt(32).
    decode = dict(np.load(FIXTURE / "reference" / "modelopt_dequant.npz"))
    q0 = decode["model.layers.0.self_attn.q_proj.weight"].T.reshape(128, 4, 32)
    np.testing.assert_array_equal(np.abs(q[:, 0]), np.abs(q0 / np.float32(math.sqrt(32))))
    decisions = plan.precisions(spec, rules_from_config(config()))
    result = write_export(tmp_path / "out", params, spec, decisions, base=FIXTURE)
    assert raw_tensors(tmp_path / "out") == raw_tensors(FIXTURE)
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    theirs = json.loads((FIXTURE / "config.json").read_text())
    qa, qb = ours.pop("quantization_config"), theirs.pop("quantization_config")
    assert ours == theirs
    assert {k: v for k, v in qa.items() if k != "producer"} == {
        k: v for k, v in qb.items() if k != "producer"
    }
    assert len(result.from_base) == len(names.entries(spec)) and not result.requantized
    assert (tmp_path / "out" / "generation_config.json").is_file()  # the released extras


def test_a_fine_tuned_group_is_quantized_again_and_the_rest_kept(tmp_path):
    spec = fixture_spec()
    released = names.flat_hf(nvfp4_jax.load_hf_checkpoint(FIXTURE))
    params = plan.to_maxtext_tree(released, spec)
    params["decoder"]["layers"]["mlp"]["wi_1"]["kernel"][:, 1] *= np.float32(1.01)  # "trained"
    decisions = plan.precisions(spec, rules_from_config(config()))
    result = write_export(
        tmp_path / "out", params, spec, decisions, base=FIXTURE, quant_algo="W4A16_NVFP4"
    )
    ours, theirs = raw_tensors(tmp_path / "out"), raw_tensors(FIXTURE)
    changed = sorted(k for k in ours if ours[k] != theirs[k])
    assert changed and all(
        k.startswith(("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"))
        for k in changed
    )
    assert not [k for k in ours if k.endswith("input_scale")]
    assert set(result.requantized) | set(result.training_exact) == {
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    }


def test_w4a4_without_activation_amaxes_names_the_weight_only_option(tmp_path):
    spec = names.model_spec(config("llama2"))
    decisions = plan.precisions(spec, rules_from_config(config()))
    with pytest.raises(ValueError, match="calibration_batches=N .* quant_algo='W4A16_NVFP4'"):
        write_export(tmp_path / "out", random_params(spec), spec, decisions)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_recorded_amaxes_become_input_scales_shared_in_fused_groups(tmp_path):
    spec = names.model_spec(config("mixtral", scan_layers=False))
    decisions = plan.precisions(spec, rules_from_config(config()))
    recorded = {}
    for i in range(2):
        for n, amax in (("query", 3.0), ("key", 5.0), ("value", 4.0), ("out", 7.0)):
            recorded[f"decoder/layers_{i}/self_attention/{n}/kernel"] = np.float32(amax + i)
        for n, amax in enumerate((2.0, 2.0, 9.0)):  # RoutedMoE's ragged_dots: wi_0, wi_1, wo
            recorded[f"decoder/layers_{i}/MoeBlock_0/ragged_dot{n}"] = np.float32(amax + i)
    write_export(tmp_path / "out", random_params(spec), spec, decisions, recorded_amaxes=recorded)
    tensors = nvfp4_jax.hf.read_safetensors(tmp_path / "out" / "model.safetensors")
    rcp = np.float32(1) / np.float32(2688)
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj"):  # the group's max: key's
            assert tensors[f"model.layers.{i}.self_attn.{p}.input_scale"] == np.float32(5 + i) * rcp
        assert tensors[f"model.layers.{i}.self_attn.o_proj.input_scale"] == np.float32(7 + i) * rcp
        for e in range(4):
            block = f"model.layers.{i}.block_sparse_moe.experts.{e}"
            assert tensors[f"{block}.w1.input_scale"] == np.float32(2 + i) * rcp
            assert tensors[f"{block}.w2.input_scale"] == np.float32(9 + i) * rcp


def test_nothing_is_written_to_a_folder_that_holds_files(tmp_path):
    spec = names.model_spec(config("llama2"))
    decisions = plan.precisions(spec, rules_from_config(config()))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        write_export(out, random_params(spec), spec, decisions, quant_algo="W4A16_NVFP4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_export_loads_as_the_trained_weights(tmp_path):
    """load_hf_checkpoint of the export holds the plan's NVFP4Arrays bit for bit."""
    spec = names.model_spec(config("qwen3_moe"))
    params = random_params(spec, seed=5)
    decisions = plan.precisions(spec, rules_from_config(config()))
    tree, _ = plan.hf_params(params, spec, decisions)
    write_export(tmp_path / "out", params, spec, decisions, quant_algo="W4A16_NVFP4")
    loaded = names.flat_hf(
        nvfp4_jax.load_hf_checkpoint(tmp_path / "out", name_map=nvfp4_jax.hf.qwen3_moe_name_map())
    )
    for path, value in tree.items():
        got = loaded[path]
        if nvfp4_jax.is_nvfp4_array(value):
            assert same_bits(got.codes, value.codes) and same_bits(got.scales, value.scales), path
            assert same_bits(np.asarray(got.global_scale), np.asarray(value.global_scale)), path
        else:
            assert same_bits(np.asarray(got), np.asarray(value)), path


def test_experts_trained_in_bf16_are_written_whole_in_bf16(tmp_path):
    """F = 24 cannot be blocked by 16: the experts trained in bf16, exported as one bf16 block."""
    spec = names.model_spec(config("mixtral", mlp_dim=24))
    decisions = plan.precisions(spec, rules_from_config(config()))
    result = write_export(
        tmp_path / "out", random_params(spec), spec, decisions, quant_algo="W4A16_NVFP4"
    )
    assert not [m for m in result.nvfp4 if "experts" in m]
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.block_sparse_moe.experts" in quant["ignore"]  # the block, by name
    loaded = nvfp4_jax.load_hf_checkpoint(
        tmp_path / "out", name_map=nvfp4_jax.hf.mixtral_name_map()
    )
    experts = loaded["layers"][0]["mlp"]["experts"]["up_proj"]["kernel"]
    assert not nvfp4_jax.is_nvfp4_array(experts) and experts.shape == (4, 64, 24)


def test_four_over_six_weights_export_as_trained(tmp_path):
    """A recipe with weight Four Over Six: the export quantizes with it, and writes plain NVFP4
    whose decode is the 4/6 weight (docs/NUMERICS.md section 13)."""
    recipe = nvfp4_jax.NVFP4Recipe(weight_four_over_six="mae")
    spec = names.model_spec(config("llama2"))
    params = random_params(spec, seed=7)
    decisions = plan.precisions(spec, rules_from_config(config(), recipe))
    tree, result = plan.hf_params(params, spec, decisions)
    from nvfp4_jax._src.core.ops import quantize_with_spec  # noqa: PLC0415

    down = params["decoder"]["layers"]["mlp"]["wo"]["kernel"][:, 1].astype(BF16)
    want = quantize_with_spec(jnp.asarray(down), recipe.spec("weight", "fprop"))
    got = tree["layers/1/mlp/down_proj/kernel"]
    assert same_bits(got.codes, want.codes) and same_bits(got.scales, want.scales)
    assert "layers/1/mlp/down_proj" in result.training_exact
    write_export(tmp_path / "out", params, spec, decisions, quant_algo="W4A16_NVFP4")
    loaded = nvfp4_jax.load_hf_checkpoint(tmp_path / "out")
    back = loaded["layers"][1]["mlp"]["down_proj"]["kernel"]
    np.testing.assert_array_equal(
        np.abs(np.asarray(nvfp4_jax.dequantize(back, jnp.float32))),
        np.abs(np.asarray(nvfp4_jax.dequantize(want, jnp.float32))),
    )
