"""KV-cache scales for serving: PTQ calibrates them, the export writes them as ModelOpt does.

`quantize_for_export(..., kv_cache=True)` records each attention's max |k| and |v| (the
k_proj and v_proj outputs); `export_hf_checkpoint(..., kv_cache_amax=...)` declares the
NVFP4 KV cache (`kv_cache_quant_algo` in hf_quant_config.json, `kv_cache_scheme` in
config.json) and writes `<attention>.k_proj.k_scale` / `.v_proj.v_scale` = f32(amax / 448),
F32 scalars; `load_hf_checkpoint` reads them back beside the kernels, and exporting what it
read writes the same bytes.
"""

from __future__ import annotations

import json
import pathlib
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_jax
from nvfp4_jax import kv_cache

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import lm_model

CFG = lm_model.LMConfig(width=64, depth=2, heads=2)


@pytest.fixture(scope="module")
def calibrated():
    model = lm_model.TransformerLM(CFG, nnx.Rngs(params=1))
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.integers(0, 256, (2, 24)), jnp.int32) for _ in range(2)]
    frozen, report = nvfp4_jax.quantize_for_export(model, batches, kv_cache=True)
    return model, batches, frozen, report


def _header(path: pathlib.Path) -> dict:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size])


def _tensor(path: pathlib.Path, name: str) -> np.ndarray:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8 : 8 + size])[name]
    begin, end = entry["data_offsets"]
    return np.frombuffer(data[8 + size + begin : 8 + size + end], np.float32)


def test_ptq_records_the_keys_and_values_amaxes(calibrated):
    """The amaxes are the max |k_proj(x)| and |v_proj(x)| over the calibration batches."""
    model, batches, _, report = calibrated
    assert sorted(report.kv_cache_amax) == ["layers/0/self_attn", "layers/1/self_attn"]
    seen = {"k": [], "v": []}

    def capture(module, x):
        attn = module.self_attn
        h = module.input_layernorm(x)
        seen["k"].append(float(jnp.max(jnp.abs(attn.k_proj(h).astype(jnp.float32)))))
        seen["v"].append(float(jnp.max(jnp.abs(attn.v_proj(h).astype(jnp.float32)))))

    for batch in batches:
        x = model.embed_tokens(batch)
        capture(model.layers[0], x)
    assert report.kv_cache_amax["layers/0/self_attn"] == (max(seen["k"]), max(seen["v"]))
    assert json.loads(report.to_json())["kv_cache_amax"]["layers/0/self_attn"][0] > 0


def test_export_writes_modelopts_kv_cache_scales(calibrated, tmp_path):
    """Declared as ModelOpt declares it; the scales F32 () at ModelOpt's names, amax / 448."""
    _, _, frozen, report = calibrated
    out = tmp_path / "export"
    nvfp4_jax.export_hf_checkpoint(
        out,
        nnx.state(frozen),
        config=CFG.hf_config(),
        quant_algo=report.quant_algo,
        kv_cache_amax=report.kv_cache_amax,
    )
    legacy = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert legacy["kv_cache_quant_algo"] == "NVFP4"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] == "NVFP4"
    header = _header(out / "model.safetensors")
    for i in range(CFG.depth):
        k_amax, v_amax = report.kv_cache_amax[f"layers/{i}/self_attn"]
        for name, amax in (("k_proj.k_scale", k_amax), ("v_proj.v_scale", v_amax)):
            full = f"model.layers.{i}.self_attn.{name}"
            assert header[full]["dtype"] == "F32" and header[full]["shape"] == []
            want = np.float32(amax) / np.float32(448)
            assert _tensor(out / "model.safetensors", full).tobytes() == want.tobytes()
            assert want == np.float32(kv_cache.scale_from_amax(amax))


def test_load_reads_them_back_and_export_writes_them_again(calibrated, tmp_path):
    _, _, frozen, report = calibrated
    first = tmp_path / "first"
    nvfp4_jax.export_hf_checkpoint(
        first,
        nnx.state(frozen),
        config=CFG.hf_config(),
        kv_cache_amax=report.kv_cache_amax,
        quant_algo=report.quant_algo,
    )
    tree = nvfp4_jax.load_hf_checkpoint(first)
    attn = tree["layers"][1]["self_attn"]
    assert float(attn["v_proj"]["v_scale"]) == float(
        np.float32(report.kv_cache_amax["layers/1/self_attn"][1]) / np.float32(448)
    )
    second = tmp_path / "second"
    nvfp4_jax.export_hf_checkpoint(
        second,
        tree,
        config=CFG.hf_config(),
        quant_algo=report.quant_algo,
        kv_cache_quant_algo="NVFP4",
    )
    a, b = _header(first / "model.safetensors"), _header(second / "model.safetensors")
    scales = sorted(n for n in a if n.endswith(("k_scale", "v_scale")))
    assert len(scales) == 2 * CFG.depth and scales == sorted(
        n for n in b if n.endswith(("k_scale", "v_scale"))
    )
    for name in scales:
        assert (
            _tensor(first / "model.safetensors", name).tobytes()
            == _tensor(second / "model.safetensors", name).tobytes()
        )
    # Without a KV-cache algorithm the scales the tree holds are left out, as before.
    third = tmp_path / "third"
    report3 = nvfp4_jax.export_hf_checkpoint(
        third, tree, config=CFG.hf_config(), quant_algo=report.quant_algo
    )
    assert not any(n.endswith("k_scale") for n in _header(third / "model.safetensors"))
    assert (
        json.loads((third / "hf_quant_config.json").read_text())["quantization"][
            "kv_cache_quant_algo"
        ]
        is None
    )
    assert report3 is not None


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        (dict(kv_cache_amax={"layers/0/self_attn": (0.0, 1.0)}), ValueError, "finite and positive"),
        (dict(kv_cache_amax={"layers/0/self_attn": (np.nan, 1.0)}), ValueError, "finite"),
        (dict(kv_cache_amax={"layers/0/mlp": (1.0, 1.0)}), ValueError, "holds no k_proj"),
        (dict(kv_cache_amax={"layers/0/self_attn": (1.0,)}), ValueError, r"\(k, v\)"),
        (dict(kv_cache_amax=[1.0]), TypeError, "must be a dict"),
        (dict(kv_cache_quant_algo="FP4"), ValueError, "kv_cache_quant_algo"),
    ],
)
def test_bad_kv_cache_arguments_are_named(calibrated, tmp_path, keywords, error, match):
    model = calibrated[0]
    with pytest.raises(error, match=match):
        nvfp4_jax.export_hf_checkpoint(
            tmp_path / "x",
            nnx.state(model),
            config=CFG.hf_config(),
            quant_algo="W4A16_NVFP4",
            **keywords,
        )
    assert not (tmp_path / "x").exists()


def test_a_hf_names_key_works_too(calibrated, tmp_path):
    _, _, frozen, _ = calibrated
    out = tmp_path / "by_hf_name"
    nvfp4_jax.export_hf_checkpoint(
        out,
        nnx.state(frozen),
        config=CFG.hf_config(),
        quant_algo="W4A16_NVFP4",
        kv_cache_amax={"model.layers.0.self_attn": (2.0, 3.0)},
    )
    got = _tensor(out / "model.safetensors", "model.layers.0.self_attn.v_proj.v_scale")
    assert got.tobytes() == (np.float32(3.0) / np.float32(448)).tobytes()
    assert jax.tree.leaves(nvfp4_jax.load_hf_checkpoint(out))
