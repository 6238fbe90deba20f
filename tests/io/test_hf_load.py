"""The import of a real ModelOpt checkpoint (nvfp4_jax/_src/io/hf/load/): every weight as
ModelOpt decodes it, the file's tensors and scales, weight-only, legacy, unquantized and
KV-cache checkpoints, loading onto a sharding (slices only), and the checkpoints it refuses.
The fixture and its helpers are hf_fixture.py's.
"""

from __future__ import annotations

import json
import math
import shutil

import hf_fixture
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits
from hf_fixture import (
    LAYERS,
    LINEARS,
    assert_same_but_zero_sign,
    copy_fixture,
    flax_tree_from_hf,
    headers,
    leaf,
    model_config,
    write_st,
)

from nvfp4_jax import hf
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.io.hf import safetensors_files

# The checkpoint conftest.py's `fixture_tensors` and `source` read.
FIXTURE, REFERENCE = hf_fixture.FIXTURE, hf_fixture.REFERENCE


# --- import ---------------------------------------------------------------------------------


def test_import_matches_modelopt_decode(impl, imported):
    """Every NVFP4 weight dequantizes to ModelOpt's own decode, bit for bit (sign of zero aside)."""
    reference = np.load(REFERENCE / "modelopt_dequant.npz")
    assert sorted(reference.files) == sorted(f"{m}.weight" for m in LINEARS)
    for module in LINEARS:
        q = leaf(imported, module)
        assert isinstance(q, NVFP4Array) and q.shape == reference[f"{module}.weight"].shape[::-1]
        got = np.asarray(impl.dequantize(q)).T
        assert_same_but_zero_sign(got, reference[f"{module}.weight"], module)


def test_import_holds_the_file_tensors(imported, fixture_tensors):
    for module in LINEARS:
        q = leaf(imported, module)
        assert (q.axis, q.block_2d, q.rht, q.dtype) == (-2, False, False, jnp.bfloat16)
        assert_same_bits(q.codes, fixture_tensors[f"{module}.weight"], module)
        assert_same_bits(
            q.scales.view(jnp.uint8), fixture_tensors[f"{module}.weight_scale"].view(np.uint8)
        )
        ws2 = fixture_tensors[f"{module}.weight_scale_2"]
        assert_same_bits(q.decode_scale, ws2, f"{module} decode_scale")
        assert_same_bits(q.global_scale, ws2, f"{module} global_scale")
        assert_same_bits(q.amax, ws2 * np.float32(2688), f"{module} amax")
        assert_same_bits(
            leaf(imported, module, "input_scale"), fixture_tensors[f"{module}.input_scale"]
        )
    assert_same_bits(imported["lm_head"]["kernel"], fixture_tensors["lm_head.weight"].T)
    assert_same_bits(
        imported["embed_tokens"]["embedding"], fixture_tensors["model.embed_tokens.weight"]
    )
    assert_same_bits(imported["norm"]["scale"], fixture_tensors["model.norm.weight"])
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected = fixture_tensors[f"model.layers.{i}.{norm}.weight"]
            assert_same_bits(imported["layers"][i][norm]["scale"], expected, norm)


def test_import_weight_only_and_legacy_configs(tmp_path, fixture_tensors):
    """W4A16 (ModelOpt's config of the same model; no input_scale) and a legacy-only config."""
    w4a16 = copy_fixture(tmp_path, "w4a16")
    for name in ("config.json", "hf_quant_config.json"):
        shutil.copy(REFERENCE / "w4a16_variant" / name, w4a16 / name)
    write_st(
        w4a16 / "model.safetensors",
        {k: v for k, v in fixture_tensors.items() if not k.endswith("input_scale")},
    )
    tree = hf.load_hf_checkpoint(w4a16)
    assert "input_scale" not in tree["layers"][0]["self_attn"]["q_proj"]
    assert_same_bits(leaf(tree, LINEARS[0]).codes, fixture_tensors[f"{LINEARS[0]}.weight"])
    legacy = copy_fixture(tmp_path, "legacy")
    (legacy / "config.json").write_text(json.dumps(model_config()))
    tree = hf.load_hf_checkpoint(legacy)
    assert_same_bits(
        leaf(tree, LINEARS[3], "input_scale"), fixture_tensors[f"{LINEARS[3]}.input_scale"]
    )


def test_import_unquantized_checkpoint(tmp_path, source):
    directory = tmp_path / "bf16"
    directory.mkdir()
    shutil.copy(REFERENCE / "source_weights_bf16.safetensors", directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(model_config()))
    tree = hf.load_hf_checkpoint(directory, dtype=jnp.float32)
    expected = flax_tree_from_hf(source)
    flat, _ = jax.tree_util.tree_flatten_with_path(expected)
    for path, value in flat:
        got = tree
        for key in path:
            got = got[key.key]
        assert_same_bits(got, np.asarray(value, np.float32), jax.tree_util.keystr(path))


def test_import_kv_cache_scales(tmp_path, fixture_tensors):
    """NVIDIA checkpoints often hold FP8 KV-cache scales: read beside the kernel, not exported."""
    directory = copy_fixture(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "type": "float",
        "num_bits": 8,
        "dynamic": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    tensors = dict(fixture_tensors)
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = np.float32(0.5)
    tensors["model.layers.0.self_attn.v_proj.v_scale"] = np.float32(0.25)
    write_st(directory / "model.safetensors", tensors)
    tree = hf.load_hf_checkpoint(directory)
    assert float(tree["layers"][0]["self_attn"]["k_proj"]["k_scale"]) == 0.5
    assert float(tree["layers"][0]["self_attn"]["v_proj"]["v_scale"]) == 0.25
    report = hf.export_hf_checkpoint(tmp_path / "out", tree, config=model_config())
    assert "layers/0/self_attn/k_proj/k_scale" in report.skipped
    assert not any("k_scale" in name for name in headers(tmp_path / "out"))


# --- loading onto devices ---------------------------------------------------------------------


def test_load_onto_a_sharding_reads_only_slices(monkeypatch, exports):
    devices = jax.devices("cpu")
    assert len(devices) == 8
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    reads = []
    original = safetensors_files.SafetensorsFile.read

    def spy(self, name, index=None):
        reads.append((name, index))
        return original(self, name, index)

    def rows(path, shape, dtype):
        spec = ("x", None) if len(shape) == 2 and shape[0] % 8 == 0 else ()
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

    plain = hf.load_hf_checkpoint(exports["NVFP4"])
    monkeypatch.setattr(safetensors_files.SafetensorsFile, "read", spy)
    tree = hf.load_hf_checkpoint(exports["sharded"], sharding=rows)
    jax.tree.map(lambda x, y: assert_same_bits(x, y), tree, plain)
    q = leaf(tree, "model.layers.0.mlp.gate_proj")
    assert q.codes.sharding.spec == jax.sharding.PartitionSpec("x", None)
    assert len({s.device for s in q.codes.addressable_shards}) == 8
    lm_head = tree["lm_head"]["kernel"]  # (hidden, vocab), transposed from (vocab, hidden)
    assert lm_head.shape == (128, 512) and lm_head.sharding.spec == jax.sharding.PartitionSpec(
        "x", None
    )
    shapes = {name: shape for name, (_, shape, _) in headers(exports["sharded"]).items()}
    indexes: dict[str, list] = {}
    for name, index in reads:
        indexes.setdefault(name, []).append(index)
    for name in (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.gate_proj.weight_scale",
        "lm_head.weight",
    ):
        # one read per device, each of the device's eighth only (lm_head: columns, transposed)
        assert len(indexes[name]) == 8, (name, indexes[name])
        for index in indexes[name]:
            count = math.prod(
                len(range(*s.indices(d))) for s, d in zip(index, shapes[name], strict=True)
            )
            assert count * 8 == math.prod(shapes[name]), (name, index)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = hf.load_hf_checkpoint(exports["NVFP4"], sharding=replicated)
    assert leaf(tree, LINEARS[0], "input_scale").sharding == replicated


def test_error_checkpoints_it_does_not_understand(tmp_path, fixture_tensors):
    directory = copy_fixture(tmp_path)
    config = json.loads((directory / "config.json").read_text())

    def with_quant(**changes):
        (directory / "config.json").write_text(
            json.dumps(
                {**config, "quantization_config": {**config["quantization_config"], **changes}}
            )
        )
        return directory

    with pytest.raises(ValueError, match="quant_algo 'FP8'"):
        hf.load_hf_checkpoint(with_quant(quant_algo="FP8"))
    with pytest.raises(ValueError, match="quant_method 'compressed-tensors'"):
        hf.load_hf_checkpoint(with_quant(quant_method="compressed-tensors"))
    with_quant()
    tensors = {
        k: v for k, v in fixture_tensors.items() if k != "model.layers.1.mlp.up_proj.input_scale"
    }
    write_st(directory / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj lacks \['input_scale'\]"):
        hf.load_hf_checkpoint(directory)
    tensors = dict(fixture_tensors)
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = tensors[
        "model.layers.0.mlp.up_proj.weight_scale"
    ][:, :4]
    write_st(directory / "model.safetensors", tensors)
    with pytest.raises(ValueError, match="up_proj: weight .* disagree"):
        hf.load_hf_checkpoint(directory)
    tensors = {
        k: v for k, v in fixture_tensors.items() if k != "model.layers.0.mlp.up_proj.weight_scale"
    }
    write_st(directory / "model.safetensors", tensors)
    with pytest.raises(ValueError, match="up_proj.input_scale belongs to no NVFP4 linear"):
        hf.load_hf_checkpoint(directory)
