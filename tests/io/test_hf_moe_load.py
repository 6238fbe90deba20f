"""Mixture-of-experts checkpoints in ModelOpt's NVFP4 layout, read (SERVING_FORMATS.md 5;
nvfp4_jax/_src/io/hf/load/, its experts in load/experts.py): ModelOpt's Qwen3-MoE checkpoint
imported as ModelOpt decodes it, exported again to the same bytes (Qwen3 and Mixtral names),
loaded onto a sharding, and the expert stacks it refuses. The fixture and its helpers are
hf_moe_fixture.py's.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits
from hf_fixture import assert_same_config_meaning, raw_tensors
from hf_moe_fixture import (
    ATTN,
    EXPERT_LINEARS,
    EXPERTS,
    FIXTURE,
    HIDDEN,
    LAYERS,
    PROJ,
    REFERENCE,
    SIZE,
    assert_same_but_zero_sign,
    checkpoint_dir,
    mixtral_config,
    model_config,
    to_mixtral_name,
    write_st,
)

import nvfp4_jax
from nvfp4_jax import hf
from nvfp4_jax._src.core.array import NVFP4Array


@pytest.fixture(scope="module")
def imported():
    return hf.load_hf_checkpoint(FIXTURE, name_map=hf.qwen3_moe_name_map())


# --- import -----------------------------------------------------------------------------------


def test_import_matches_modelopt_decode(imported, fixture_tensors):
    """(a) Every expert's weight dequantizes to ModelOpt's own decode, bit for bit."""
    reference = np.load(REFERENCE / "modelopt_dequant.npz")
    for i in range(LAYERS):
        mlp = imported["layers"][i]["mlp"]
        assert set(mlp) == {"gate", "experts"}
        for proj in PROJ:
            q = mlp["experts"][proj]["kernel"]
            shape = (EXPERTS, SIZE, HIDDEN) if proj == "down_proj" else (EXPERTS, HIDDEN, SIZE)
            assert isinstance(q, NVFP4Array) and q.shape == shape
            assert (q.axis, q.block_2d, q.rht, q.dtype) == (-2, False, False, jnp.bfloat16)
            assert q.amax.shape == q.decode_scale.shape == (EXPERTS,)
            dequantized = np.asarray(nvfp4_jax.dequantize(q))
            for e in range(EXPERTS):
                module = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                expected = reference[f"{module}.weight"]
                assert_same_but_zero_sign(dequantized[e].T, expected, module)
                assert_same_bits(q.codes[e], fixture_tensors[f"{module}.weight"], module)
                ws2 = fixture_tensors[f"{module}.weight_scale_2"]
                assert_same_bits(q.decode_scale[e], ws2, module)
                assert_same_bits(q.amax[e], ws2 * np.float32(2688), module)
                assert_same_bits(
                    mlp["experts"][proj]["input_scale"][e],
                    fixture_tensors[f"{module}.input_scale"],
                    module,
                )
        router = fixture_tensors[f"model.layers.{i}.mlp.gate.weight"]
        assert_same_bits(mlp["gate"]["kernel"], router.T, "router")
    # The attention linears of the same checkpoint load as in the dense case.
    q = imported["layers"][0]["self_attn"]["q_proj"]["kernel"]
    expected = reference["model.layers.0.self_attn.q_proj.weight"]
    assert_same_but_zero_sign(np.asarray(nvfp4_jax.dequantize(q)).T, expected)


# --- round trips --------------------------------------------------------------------------------


def test_round_trip_qwen3_moe(tmp_path, imported):
    """(c) Import ModelOpt's checkpoint, export it again: the same bytes, the same configs."""
    report = hf.export_hf_checkpoint(
        tmp_path / "rt", imported, name_map=hf.qwen3_moe_name_map(), config=model_config()
    )
    assert len(report.quantized) == len(EXPERT_LINEARS) + LAYERS * len(ATTN)
    assert raw_tensors(tmp_path / "rt") == raw_tensors(FIXTURE)
    assert_same_config_meaning(tmp_path / "rt", FIXTURE)
    again = hf.load_hf_checkpoint(tmp_path / "rt", name_map=hf.qwen3_moe_name_map())
    jax.tree.map(assert_same_bits, again, imported)


def test_round_trip_mixtral_names(tmp_path, imported, fixture_tensors):
    """(c) The fixture under Mixtral's names loads into the same Flax tree and exports back."""
    tensors = {to_mixtral_name(k): v for k, v in fixture_tensors.items()}
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale_2" in tensors
    config = json.loads((FIXTURE / "config.json").read_text())
    ignore = [to_mixtral_name(f"{m}.").rstrip(".") for m in config["quantization_config"]["ignore"]]
    config["quantization_config"]["ignore"] = ignore
    config = mixtral_config(config)
    directory = checkpoint_dir(tmp_path, tensors, config, "mixtral")
    loaded = hf.load_hf_checkpoint(directory, name_map=hf.mixtral_name_map())
    jax.tree.map(assert_same_bits, loaded, imported)
    model = {k: v for k, v in config.items() if k != "quantization_config"}
    hf.export_hf_checkpoint(tmp_path / "rt", loaded, name_map=hf.mixtral_name_map(), config=model)
    assert raw_tensors(tmp_path / "rt") == raw_tensors(directory)
    written = json.loads((tmp_path / "rt" / "config.json").read_text())["quantization_config"]
    assert written["ignore"] == sorted(ignore)


def test_load_experts_onto_a_sharding(imported):
    """A NamedSharding applies to the (E, in, out) stack as the Flax tree holds it: experts
    split across devices (each device reads its experts only), or `in` split (the stored
    (E, out, in/2) codes take the spec's last two entries swapped)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
    name_map = hf.qwen3_moe_name_map()
    for spec, stored in (
        (("x",), ("x", None, None)),
        ((None, "x"), (None, None, "x")),
    ):
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        tree = hf.load_hf_checkpoint(FIXTURE, name_map=name_map, sharding=sharding)
        jax.tree.map(assert_same_bits, tree, imported)
        q = tree["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"]
        assert q.codes.sharding.spec == jax.sharding.PartitionSpec(*stored)
        assert len({s.device for s in q.codes.addressable_shards}) == 4
        if spec == ("x",):
            assert q.decode_scale.sharding.spec == jax.sharding.PartitionSpec("x")
            shard = next(iter(q.codes.addressable_shards))
            assert shard.data.shape == (1, HIDDEN, SIZE // 2)


def test_error_hostile_expert_tensors(tmp_path, fixture_tensors):
    """The per-tensor checks of a dense linear apply to every expert."""
    module = "model.layers.0.mlp.experts.1.up_proj"
    config = json.loads((FIXTURE / "config.json").read_text())
    tensors = dict(fixture_tensors)
    scales = tensors[f"{module}.weight_scale"].copy()
    scales.view(np.uint8)[3, 2] = 0x7F
    tensors[f"{module}.weight_scale"] = scales
    directory = checkpoint_dir(tmp_path, tensors, config, "nan_scale")
    with pytest.raises(ValueError, match=rf"{module}.weight_scale .*NaN or negative block"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
    tensors = dict(fixture_tensors)
    tensors[f"{module}.weight_scale_2"] = np.float32(-1)
    directory = checkpoint_dir(tmp_path, tensors, config, "negative")
    with pytest.raises(ValueError, match=rf"{module}.weight_scale_2 .*finite and >= 0"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
    tensors = {k: v for k, v in fixture_tensors.items() if k != f"{module}.input_scale"}
    directory = checkpoint_dir(tmp_path, tensors, config, "no_input_scale")
    with pytest.raises(ValueError, match=rf"{module} lacks \['input_scale'\]"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
    config["num_local_experts"] = "4"
    directory = checkpoint_dir(tmp_path, fixture_tensors, config, "bad_count")
    with pytest.raises(ValueError, match="num_local_experts must be a positive integer"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())


# --- errors -----------------------------------------------------------------------------------


def test_error_missing_expert(tmp_path, fixture_tensors):
    """(e) A checkpoint lacking an expert: named, with the layer."""
    tensors = {
        k: v for k, v in fixture_tensors.items() if ".layers.1.mlp.experts.2.up_proj" not in k
    }
    config = json.loads((FIXTURE / "config.json").read_text())
    directory = checkpoint_dir(tmp_path, tensors, config)
    with pytest.raises(
        ValueError, match=r"layers/1/mlp/experts/up_proj.*experts \[2\] are missing"
    ):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
    # Without an expert count in the config, a gap is found all the same (the last one is not).
    del config["num_local_experts"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"experts \[2\] are missing"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
    # A hostile index: reported at once, not counted out one by one.
    far = {k.replace(".experts.2.", ".experts.999999999."): v for k, v in fixture_tensors.items()}
    (directory / "model.safetensors").unlink()
    write_st(directory / "model.safetensors", far)
    with pytest.raises(ValueError, match=r"\[2, 4, 5, .*, 12\] are missing \(999999996 in all\)"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
    config["num_local_experts"] = 4
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\[2\] are missing and experts \[999999999\] lie"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())


def test_error_mismatched_expert_shapes(tmp_path, source, fixture_tensors):
    """(e) Experts of one projection stored with different shapes: bf16 or NVFP4."""
    tensors = dict(source)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    tensors[name] = tensors[name][:, :48]
    directory = checkpoint_dir(tmp_path, tensors, model_config())
    with pytest.raises(ValueError, match=r"experts of layers/0/mlp/experts/down_proj/kernel dis"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
    tensors = dict(fixture_tensors)
    module = "model.layers.1.mlp.experts.3.gate_proj"
    tensors[f"{module}.weight"] = tensors[f"{module}.weight"][:, :32]
    tensors[f"{module}.weight_scale"] = tensors[f"{module}.weight_scale"][:, :4]
    config = json.loads((FIXTURE / "config.json").read_text())
    directory = checkpoint_dir(tmp_path, tensors, config, "nvfp4")
    with pytest.raises(ValueError, match=r"experts.3.gate_proj.weight is U8 \(64, 32\)"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())


def test_error_experts_partly_quantized(tmp_path, fixture_tensors, source):
    tensors = {k: v for k, v in fixture_tensors.items() if ".mlp.experts.3.gate_proj." not in k}
    tensors["model.layers.0.mlp.experts.3.gate_proj.weight"] = source[
        "model.layers.0.mlp.experts.3.gate_proj.weight"
    ]
    tensors["model.layers.1.mlp.experts.3.gate_proj.weight"] = source[
        "model.layers.1.mlp.experts.3.gate_proj.weight"
    ]
    config = json.loads((FIXTURE / "config.json").read_text())
    directory = checkpoint_dir(tmp_path, tensors, config)
    with pytest.raises(ValueError, match=r"partly in NVFP4 \(experts \[0, 1, 2\]\)"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())
