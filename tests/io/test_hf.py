"""The Hugging Face / ModelOpt NVFP4 bridge: import of a real ModelOpt checkpoint, export for
engines, and every requirement of the serving contract as a test on an exported directory.

The fixture `fixtures/modelopt_llama_nvfp4/` was written by NVIDIA ModelOpt itself (see its
README). Exported models are built from its `reference/source_weights_bf16.safetensors` (the
bf16 weights ModelOpt quantized), turned into the Flax tree of the example Llama by hand here,
independently of the name map under test. Files are read back with the `safetensors` package
where it can (headers, names, dtypes, shapes) and decoded with ModelOpt's formula in NumPy.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
from flax import nnx
from helpers import assert_same_bits

import nvfp4_jax
from nvfp4_jax import hf
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.io.hf import safetensors_files

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "modelopt_llama_nvfp4"
REFERENCE = FIXTURE / "reference"
LAYERS = 2
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEARS = [
    f"model.layers.{i}.{block}.{name}"
    for i in range(LAYERS)
    for block, names in (("self_attn", ATTN), ("mlp", MLP))
    for name in names
]
GROUPS = [
    [f"model.layers.{i}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
    for i in range(LAYERS)
] + [[f"model.layers.{i}.mlp.{n}" for n in ("gate_proj", "up_proj")] for i in range(LAYERS)]
PLAIN = [
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.norm.weight",
    *[
        f"model.layers.{i}.{n}.weight"
        for i in range(LAYERS)
        for n in ("input_layernorm", "post_attention_layernorm")
    ],
]
RCP2688 = np.float32(1) / np.float32(2688)
# ModelOpt's E2M1 decode table: code 0x8 decodes as +0.0.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# --- helpers ----------------------------------------------------------------------------------


def modelopt_decode(weight, weight_scale, weight_scale_2) -> np.ndarray:
    """ModelOpt's NVFP4 decode in NumPy: e2m1[code] * (f32(weight_scale) * weight_scale_2)."""
    rows = weight.shape[0]
    codes = np.stack([weight & 0xF, weight >> 4], -1).reshape(rows, -1)
    factor = weight_scale.astype(np.float32) * np.float32(weight_scale_2)
    return (E2M1[codes].reshape(rows, -1, 16) * factor[..., None]).reshape(rows, -1)


def assert_same_but_zero_sign(actual, expected, what=""):
    """Bit-equal f32 arrays once -0.0 is read as +0.0 (ModelOpt decodes code 0x8 as +0.0)."""
    assert_same_bits(
        np.asarray(actual, np.float32) + np.float32(0), np.asarray(expected) + np.float32(0), what
    )


def flax_tree_from_hf(tensors: dict) -> dict:
    """The example Llama's Flax tree from HF-named (out, in) tensors, written out by hand."""
    tree: dict = {"layers": {i: {"self_attn": {}, "mlp": {}} for i in range(LAYERS)}}
    for name, value in tensors.items():
        value = jnp.asarray(value)
        if name == "lm_head.weight":
            tree["lm_head"] = {"kernel": value.T}
        elif name == "model.embed_tokens.weight":
            tree["embed_tokens"] = {"embedding": value}
        elif name == "model.norm.weight":
            tree["norm"] = {"scale": value}
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.(\w+layernorm)\.weight", name):
            tree["layers"][int(m[1])][m[2]] = {"scale": value}
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight", name)
            tree["layers"][int(m[1])][m[2]][m[3]] = {"kernel": value.T}
    return tree


def flax_path(module: str) -> str:
    """`model.layers.0.self_attn.q_proj` -> `layers/0/self_attn/q_proj`."""
    return module.removeprefix("model.").replace(".", "/")


def leaf(tree, module: str, name: str = "kernel"):
    node = tree
    for key in flax_path(module).split("/"):
        node = node[int(key) if key.isdigit() else key]
    return node[name]


def headers(directory: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """`{tensor: (dtype, shape, file)}` over the top-level safetensors files (safetensors' view)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safetensors.safe_open(path, "np") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                s = f.get_slice(name)
                assert name not in out, name
                out[name] = (s.get_dtype(), tuple(s.get_shape()), path.name)
    return out


def raw_tensors(directory: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """`{tensor: (dtype, shape, bytes)}` read with `safetensors.deserialize` (raw bytes)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            out[name] = (entry["dtype"], tuple(entry["shape"]), bytes(entry["data"]))
    return out


def write_st(path: Path, tensors: dict) -> None:
    """A safetensors file through the `safetensors` package (raw bytes: float8 included)."""
    names = {np.dtype(np.uint8): "uint8", np.dtype(np.float32): "float32"}
    names[np.dtype(ml_dtypes.bfloat16)] = "bfloat16"
    names[np.dtype(ml_dtypes.float8_e4m3fn)] = "float8_e4m3fn"
    arrays = {name: np.array(value, order="C") for name, value in tensors.items()}  # kept alive
    specs = {
        name: safetensors.TensorSpec(
            dtype=names[a.dtype], shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for name, a in arrays.items()
    }
    path.write_bytes(safetensors.serialize(specs, metadata={"format": "pt"}))
    del arrays


def model_config() -> dict:
    config = json.loads((FIXTURE / "config.json").read_text())
    del config["quantization_config"]
    return config


def copy_fixture(tmp_path: Path, name="ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURE, target, ignore=shutil.ignore_patterns("reference", "README.md"))
    for path in target.iterdir():
        path.chmod(0o644)
    return target


@pytest.fixture(scope="module")
def input_amax(fixture_tensors) -> dict:
    """Recorded activation amaxes by HF module name (ModelOpt's, times 2688)."""
    return {m: float(fixture_tensors[f"{m}.input_scale"]) * 2688.0 for m in LINEARS}


@pytest.fixture(scope="module")
def imported():
    return hf.load_hf_checkpoint(FIXTURE)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, source, input_amax) -> dict[str, Path]:
    """The source model exported W4A4 and W4A16 (one file), and W4A4 sharded."""
    root = tmp_path_factory.mktemp("exports")
    tree = flax_tree_from_hf(source)
    out = {}
    for flavour, kwargs in {
        "NVFP4": {"input_amax": input_amax},
        "W4A16_NVFP4": {},
        "sharded": {"input_amax": input_amax, "max_shard_size": 100_000},
    }.items():
        algo = "NVFP4" if flavour == "sharded" else flavour
        report = hf.export_hf_checkpoint(
            root / flavour, tree, quant_algo=algo, config=model_config(), **kwargs
        )
        out[flavour] = root / flavour
        out[flavour + "/report"] = report
    return out


@pytest.fixture(params=["NVFP4", "W4A16_NVFP4"])
def flavour(request) -> str:
    return request.param


# --- the name map ---------------------------------------------------------------------------


def test_llama_name_map_both_ways():
    nm = hf.llama_name_map()
    cases = {
        "layers/3/self_attn/q_proj/kernel": ("model.layers.3.self_attn.q_proj.weight", "linear", 2),
        "layers/3/mlp/down_proj/kernel": ("model.layers.3.mlp.down_proj.weight", "linear", 2),
        "layers/3/input_layernorm/scale": ("model.layers.3.input_layernorm.weight", "norm", 1),
        "layers/0/self_attn/q_norm/scale": ("model.layers.0.self_attn.q_norm.weight", "norm", 1),
        "layers/0/self_attn/q_proj/bias": ("model.layers.0.self_attn.q_proj.bias", "plain", 1),
        "norm/scale": ("model.norm.weight", "norm", 1),
        "embed_tokens/embedding": ("model.embed_tokens.weight", "embedding", 2),
        "lm_head/kernel": ("lm_head.weight", "linear", 2),
    }
    for path, (name, kind, ndim) in cases.items():
        assert nm.to_hf(path) == (name, kind), path
        assert nm.to_flax(name, ndim) == (path, kind), name
    assert nm.to_hf("rngs/quantize/count") is None
    assert nm.to_flax("model.layers.0.mlp.up_proj.weight_scale", 2) is None


def test_name_rules_are_checked():
    with pytest.raises(ValueError, match="same fields"):
        hf.NameRule("{a}/kernel", "model.{b}.weight", "linear")
    with pytest.raises(ValueError, match="kind"):
        hf.NameRule("x", "y", "conv")
    with pytest.raises(ValueError, match="end in '.weight'"):
        hf.NameRule("x/kernel", "x.w", "linear")
    custom = hf.NameMap([("blocks/{i}/attn/{p}/w", "transformer.h.{i}.attn.{p}.weight", "linear")])
    assert custom.to_hf("blocks/2/attn/c_attn/w") == (
        "transformer.h.2.attn.c_attn.weight",
        "linear",
    )
    assert custom.to_flax("transformer.h.2.attn.c_attn.weight") == (
        "blocks/2/attn/c_attn/w",
        "linear",
    )


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


# --- round trip -------------------------------------------------------------------------------


def test_round_trip_keeps_every_tensor_and_config(tmp_path, imported):
    """Import ModelOpt's checkpoint, export it (W4A4, its own input scales): the same bytes."""
    report = hf.export_hf_checkpoint(tmp_path / "rt", imported, config=model_config())
    assert sorted(report.quantized) == sorted(LINEARS)
    assert raw_tensors(tmp_path / "rt") == raw_tensors(FIXTURE)
    assert_same_config_meaning(tmp_path / "rt", FIXTURE)


def test_round_trip_as_weight_only(tmp_path, imported):
    hf.export_hf_checkpoint(
        tmp_path / "rt", imported, quant_algo="W4A16_NVFP4", config=model_config()
    )
    expected = {k: v for k, v in raw_tensors(FIXTURE).items() if not k.endswith(".input_scale")}
    assert raw_tensors(tmp_path / "rt") == expected
    assert_same_config_meaning(tmp_path / "rt", REFERENCE / "w4a16_variant")


def assert_same_config_meaning(ours: Path, theirs: Path) -> None:
    """config.json and hf_quant_config.json say the same as ModelOpt's, the producer aside."""
    a, b = (json.loads((d / "config.json").read_text()) for d in (ours, theirs))
    qa, qb = a.pop("quantization_config"), b.pop("quantization_config")
    assert a == b
    for q in (qa, qb):
        assert set(q.pop("producer")) >= {"name", "version"}
    assert qa == qb
    la, lb = (json.loads((d / "hf_quant_config.json").read_text()) for d in (ours, theirs))
    assert la["quantization"] == lb["quantization"]
    assert la["producer"]["name"] == lb["producer"]["name"] == "modelopt"


# --- the serving contract, on exported directories --------------------------------------------


def expected_quantization_config(algo: str) -> dict:
    nvfp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"weights": nvfp4, "targets": ["Linear"]}
    if algo == "NVFP4":
        group["input_activations"] = nvfp4
    return {
        "quant_method": "modelopt",
        "quant_algo": algo,
        "ignore": ["lm_head", "model.embed_tokens"],
        "config_groups": {"group_0": group},
    }


def test_config_json_carries_the_quantization_config(exports, flavour):
    config = json.loads((exports[flavour] / "config.json").read_text())
    quant = config.pop("quantization_config")
    producer = quant.pop("producer")
    assert producer == {"name": "nvfp4_jax", "version": nvfp4_jax.__version__}
    assert quant == expected_quantization_config(flavour)
    assert config == model_config()  # the model config, merged, unchanged


def test_legacy_hf_quant_config_is_complete(exports, flavour):
    legacy = json.loads((exports[flavour] / "hf_quant_config.json").read_text())
    assert legacy["producer"]["name"] == "modelopt"  # the only name vLLM's legacy path reads
    assert legacy["producer"]["exported_by"]["name"] == "nvfp4_jax"
    assert legacy["quantization"] == {
        "quant_algo": flavour,
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.embed_tokens"],
    }


def test_tensor_names_dtypes_shapes(exports, flavour, source):
    found = headers(exports[flavour])
    expected = {}
    for module in LINEARS:
        out, k = source[f"{module}.weight"].shape
        expected[f"{module}.weight"] = ("U8", (out, k // 2))
        expected[f"{module}.weight_scale"] = ("F8_E4M3", (out, k // 16))
        expected[f"{module}.weight_scale_2"] = ("F32", ())
        if flavour == "NVFP4":
            expected[f"{module}.input_scale"] = ("F32", ())
    for name in PLAIN:
        expected[name] = ("BF16", source[name].shape)
    # Exactly these: no unloadable extra tensor (e.g. weight_scale_swizzled), nothing missing.
    assert {name: (dtype, shape) for name, (dtype, shape, _) in found.items()} == expected
    assert sorted(os.listdir(exports[flavour])) == [
        "config.json",
        "hf_quant_config.json",
        "model.safetensors",
    ]


def test_fused_groups_share_their_scales(exports, flavour, source, input_amax):
    tensors = hf.read_safetensors(exports[flavour] / "model.safetensors")
    for group in GROUPS:
        amaxes = [np.abs(source[f"{m}.weight"].astype(np.float32)).max() for m in group]
        assert len(set(amaxes)) == len(amaxes)  # the fixture's members differ: a real test
        for module in group:
            assert_same_bits(
                tensors[f"{module}.weight_scale_2"], np.float32(max(amaxes)) * RCP2688, module
            )
            if flavour == "NVFP4":
                expected = np.float32(max(input_amax[m] for m in group)) * RCP2688
                assert_same_bits(tensors[f"{module}.input_scale"], expected, module)


def test_input_scale_on_every_quantized_linear(exports, input_amax):
    tensors = hf.read_safetensors(exports["NVFP4"] / "model.safetensors")
    grouped = {m for group in GROUPS for m in group}
    for module in LINEARS:
        assert tensors[f"{module}.input_scale"] > 0
        if module not in grouped:
            assert_same_bits(
                tensors[f"{module}.input_scale"], np.float32(input_amax[module]) * RCP2688
            )
    weight_only = hf.read_safetensors(exports["W4A16_NVFP4"] / "model.safetensors")
    assert not [name for name in weight_only if name.endswith("input_scale")]


def test_excluded_modules_are_listed_and_high_precision(exports, flavour, source):
    tensors = hf.read_safetensors(exports[flavour] / "model.safetensors")
    report = exports[flavour + "/report"]
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        assert_same_bits(tensors[name], source[name], name)
        assert f"{name.removesuffix('.weight')}.weight_scale" not in tensors
    assert report.excluded == ("lm_head", "model.embed_tokens")
    assert sorted(report.quantized) == sorted(LINEARS)


def test_modelopt_decode_of_the_export_equals_dequantize(exports, flavour, source):
    """ModelOpt's formula on the file == nvfp4_jax.dequantize of what we quantized, bit for bit."""
    tensors = hf.read_safetensors(exports[flavour] / "model.safetensors")
    group_of = {m: group for group in GROUPS for m in group}
    for module in LINEARS:
        members = group_of.get(module, [module])
        amax = max(np.abs(source[f"{m}.weight"].astype(np.float32)).max() for m in members)
        kernel = jnp.asarray(source[f"{module}.weight"]).T
        q = nvfp4_jax.quantize(kernel, axis=0, block_2d=True, amax=jnp.float32(amax))
        decoded = modelopt_decode(
            *(tensors[f"{module}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2"))
        )
        assert_same_but_zero_sign(decoded, np.asarray(nvfp4_jax.dequantize(q)).T, module)


@pytest.mark.parametrize("mode, e4m3_max", [("mse", 256), ("mae", 448)])
def test_four_over_six_export_is_plain_nvfp4_that_engines_decode(tmp_path, source, mode, e4m3_max):
    """`four_over_six=`: each kernel quantized with 4/6 at its group's amax; the files are
    ModelOpt NVFP4 (the decode scale `amax / (6M)` as weight_scale_2), ModelOpt's formula and
    `load_hf_checkpoint` give exactly the 4/6 values."""
    hf.export_hf_checkpoint(
        tmp_path / "fos", flax_tree_from_hf(source), quant_algo="W4A16_NVFP4",
        config=model_config(), four_over_six=mode, four_over_six_e4m3_max=e4m3_max,
    )  # fmt: skip
    tensors = hf.read_safetensors(tmp_path / "fos" / "model.safetensors")
    loaded = hf.load_hf_checkpoint(tmp_path / "fos")
    group_of = {m: group for group in GROUPS for m in group}
    changed = 0
    for module in LINEARS:
        members = group_of.get(module, [module])
        amax = max(np.abs(source[f"{m}.weight"].astype(np.float32)).max() for m in members)
        kernel = jnp.asarray(source[f"{module}.weight"]).T
        flags = dict(axis=0, block_2d=True, amax=jnp.float32(amax))
        q = nvfp4_jax.quantize(kernel, four_over_six=mode, four_over_six_e4m3_max=e4m3_max, **flags)
        scale_2 = tensors[f"{module}.weight_scale_2"]
        assert_same_bits(scale_2, np.float32(amax) * (np.float32(1) / np.float32(6 * e4m3_max)))
        decoded = modelopt_decode(
            *(tensors[f"{module}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2"))
        )
        assert_same_but_zero_sign(decoded, np.asarray(nvfp4_jax.dequantize(q)).T, module)
        assert_same_but_zero_sign(
            nvfp4_jax.dequantize(leaf(loaded, module)), nvfp4_jax.dequantize(q), module
        )
        plain = nvfp4_jax.quantize(kernel, **flags)
        changed += not np.array_equal(np.asarray(plain.scales), np.asarray(q.scales))
    assert changed  # some blocks chose map-to-4: the option took effect
    with pytest.raises(ValueError, match="four_over_six"):
        hf.export_hf_checkpoint(tmp_path / "bad", flax_tree_from_hf(source),
                                config=model_config(), four_over_six="max")  # fmt: skip


def test_sharded_layout_and_index(exports):
    directory = exports["sharded"]
    report = exports["sharded/report"]
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert list(report.files) == files and not (directory / "model.safetensors").exists()
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    found = headers(directory)
    assert index["weight_map"] == {name: file for name, (_, _, file) in found.items()}
    tensors = raw_tensors(directory)
    assert index["metadata"]["total_size"] == sum(len(data) for _, _, data in tensors.values())
    assert tensors == raw_tensors(exports["NVFP4"])  # the same tensors as one file
    for file in files:  # at most max_shard_size, unless one tensor alone is larger
        held = [len(tensors[k][2]) for k, v in found.items() if v[2] == file]
        assert sum(held) <= 100_000 or len(held) == 1, (file, held)
    a, b = hf.load_hf_checkpoint(directory), hf.load_hf_checkpoint(exports["NVFP4"])
    jax.tree.map(lambda x, y: assert_same_bits(x, y), a, b)


# --- sources of the input amax ----------------------------------------------------------------


class Recorded(nnx.Variable):
    """A recorded activation amax, as the layers' calibration mode keeps it (not a Param)."""


class Proj(nnx.Module):
    def __init__(self, kernel, amax):
        self.kernel = nnx.Param(kernel)
        self.input_amax = Recorded(jnp.float32(amax))


class Box(nnx.Module):
    def __init__(self, **params):
        for name, value in params.items():
            setattr(self, name, value)


def nnx_llama(source, input_amax) -> nnx.Module:
    """An nnx model with the example's paths, recorded amaxes and an rng stream."""
    tree = flax_tree_from_hf(source)

    def layer(i):
        def proj(block, name):
            return Proj(
                tree["layers"][i][block][name]["kernel"],
                input_amax[f"model.layers.{i}.{block}.{name}"],
            )

        norms = {
            n: Box(scale=nnx.Param(tree["layers"][i][n]["scale"]))
            for n in ("input_layernorm", "post_attention_layernorm")
        }
        return Box(
            self_attn=Box(**{n: proj("self_attn", n) for n in ATTN}),
            mlp=Box(**{n: proj("mlp", n) for n in MLP}),
            **norms,
        )

    return Box(
        embed_tokens=Box(embedding=nnx.Param(tree["embed_tokens"]["embedding"])),
        layers=nnx.List([layer(i) for i in range(LAYERS)]),
        norm=Box(scale=nnx.Param(tree["norm"]["scale"])),
        lm_head=Proj(tree["lm_head"]["kernel"], 0.0),  # excluded: its amax is not used
        rngs=nnx.Rngs(quantize=0),
    )


def test_export_of_a_whole_nnx_state(tmp_path, exports, source, input_amax):
    """`nnx.state(model)`: Params are the weights, recorded input_amax variables the amaxes."""
    model = nnx_llama(source, input_amax)
    report = hf.export_hf_checkpoint(tmp_path / "nnx", nnx.state(model), config=model_config())
    assert raw_tensors(tmp_path / "nnx") == raw_tensors(exports["NVFP4"])
    assert set(report.skipped) == {"rngs/quantize/count", "rngs/quantize/key"}


def test_input_amax_by_flax_path_overrides(tmp_path, source, input_amax):
    tree = flax_tree_from_hf(source)
    by_path = {flax_path(m): a for m, a in input_amax.items()}
    by_path["layers/0/mlp/down_proj"] = 3.0
    hf.export_hf_checkpoint(tmp_path / "p", tree, input_amax=by_path, config=model_config())
    tensors = hf.read_safetensors(tmp_path / "p" / "model.safetensors")
    assert_same_bits(tensors["model.layers.0.mlp.down_proj.input_scale"], np.float32(3.0) * RCP2688)


def test_export_of_params_sharded_over_devices(tmp_path, exports, source, input_amax):
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))

    def put(a):
        spec = ("x", None) if a.ndim == 2 else ()
        return jax.device_put(
            a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        )

    tree = jax.tree.map(put, flax_tree_from_hf(source))
    hf.export_hf_checkpoint(tmp_path / "s", tree, input_amax=input_amax, config=model_config())
    assert raw_tensors(tmp_path / "s") == raw_tensors(exports["NVFP4"])


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


# --- memory -----------------------------------------------------------------------------------


def test_export_memory_stays_about_one_layer(monkeypatch, tmp_path):
    """Host allocations (tracemalloc) and live JAX buffers stay near one module while writing."""
    layers, hidden, inter, vocab = 8, 256, 512, 512
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16))

    def layer():
        return {
            "self_attn": {n: {"kernel": w(hidden, hidden)} for n in ATTN},
            "mlp": {
                "gate_proj": {"kernel": w(hidden, inter)},
                "up_proj": {"kernel": w(hidden, inter)},
                "down_proj": {"kernel": w(inter, hidden)},
            },
            "input_layernorm": {"scale": w(hidden)},
            "post_attention_layernorm": {"scale": w(hidden)},
        }

    tree = {
        "embed_tokens": {"embedding": w(vocab, hidden)},
        "layers": {i: layer() for i in range(layers)},
        "norm": {"scale": w(hidden)},
        "lm_head": {"kernel": w(hidden, vocab)},
    }
    config = {
        **model_config(),
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
    }
    # Once untraced, so that JAX's compilation caches (Python objects) are warm.
    hf.export_hf_checkpoint(tmp_path / "warm", tree, quant_algo="W4A16_NVFP4", config=config)
    baseline = sum(a.nbytes for a in jax.live_arrays())
    samples = []
    original = safetensors_files._write_array

    def sample(file, name, array, dtype, shape):
        live = sum(a.nbytes for a in jax.live_arrays()) - baseline
        samples.append((tracemalloc.get_traced_memory()[0], live))
        return original(file, name, array, dtype, shape)

    monkeypatch.setattr(safetensors_files, "_write_array", sample)
    tracemalloc.start()
    try:
        report = hf.export_hf_checkpoint(
            tmp_path / "big", tree, quant_algo="W4A16_NVFP4", config=config
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    largest_tensor = vocab * hidden * 2  # lm_head / embedding in bf16
    one_layer = report.total_size // layers
    assert report.total_size > 3_000_000 and len(samples) == 3 + 2 * layers + 7 * 3 * layers
    # Host: about one layer (the transposed copy of lm_head and bookkeeping), not the model.
    assert peak < max(2 * largest_tensor, one_layer) + 200_000 < report.total_size / 4, (
        peak,
        report.total_size,
    )
    # Device: the quantized tensors of one module at a time.
    assert max(live for _, live in samples) < one_layer, (max(samples), one_layer)


# --- errors -----------------------------------------------------------------------------------


def small_tree():
    return {"layers": {0: {"mlp": {"down_proj": {"kernel": jnp.ones((32, 32), jnp.bfloat16)}}}}}


def test_error_two_leaves_on_one_hf_name(tmp_path):
    tree = small_tree()
    tree["layers.0"] = {"mlp": {"down_proj": {"kernel": jnp.ones((32, 32))}}}
    with pytest.raises(ValueError, match=r"\['layers'\]\[0\].*\['layers.0'\].*both map to"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, quant_algo="W4A16_NVFP4", config=model_config()
        )
    tree = small_tree()
    tree["layers/0/mlp/down_proj"] = {"kernel": jnp.ones((32, 32))}
    with pytest.raises(ValueError, match="same path 'layers/0/mlp/down_proj/kernel'"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, quant_algo="W4A16_NVFP4", config=model_config()
        )
    assert not (tmp_path / "x").exists()


def test_error_unmappable_leaf_unless_skipped(tmp_path):
    tree = small_tree()
    tree["rope"] = {"inv_freq": jnp.ones(8)}
    with pytest.raises(ValueError, match="'rope/inv_freq'\\) matches no rule"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, quant_algo="W4A16_NVFP4", config=model_config()
        )
    report = hf.export_hf_checkpoint(
        tmp_path / "x", tree, quant_algo="W4A16_NVFP4", config=model_config(), skip=["rope/.*"]
    )
    assert report.skipped == ("rope/inv_freq",)


def test_error_w4a4_without_input_amax(tmp_path, source, input_amax):
    tree = flax_tree_from_hf(source)
    with pytest.raises(ValueError, match="no input amax for .*layers.0.mlp.down_proj"):
        partial = {m: a for m, a in input_amax.items() if m != "model.layers.0.mlp.down_proj"}
        hf.export_hf_checkpoint(tmp_path / "x", tree, input_amax=partial, config=model_config())
    with pytest.raises(
        ValueError, match=r"no input amax for \['model.layers.1.self_attn.k_proj'\]"
    ):
        partial = {m: a for m, a in input_amax.items() if m != "model.layers.1.self_attn.k_proj"}
        hf.export_hf_checkpoint(tmp_path / "x", tree, input_amax=partial, config=model_config())
    with pytest.raises(ValueError, match="positive, finite"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, input_amax={**input_amax, LINEARS[0]: 0.0}, config=model_config()
        )
    with pytest.raises(ValueError, match="no linear of the model"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            input_amax={**input_amax, "layers/9/x": 1.0},
            config=model_config(),
        )
    with pytest.raises(ValueError, match="W4A4"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            quant_algo="W4A16_NVFP4",
            input_amax=input_amax,
            config=model_config(),
        )


def test_error_half_excluded_fused_group(tmp_path, source):
    tree = flax_tree_from_hf(source)
    with pytest.raises(ValueError, match="half excluded.*k_proj"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            quant_algo="W4A16_NVFP4",
            config=model_config(),
            exclude=(*hf.DEFAULT_EXCLUDE, "model.layers.0.self_attn.k_proj"),
        )
    report = hf.export_hf_checkpoint(
        tmp_path / "x",
        tree,
        quant_algo="W4A16_NVFP4",
        config=model_config(),
        exclude=(*hf.DEFAULT_EXCLUDE, "model.layers.0.self_attn.[qkv]_proj"),
    )
    assert "model.layers.0.self_attn.v_proj" in report.excluded
    assert headers(tmp_path / "x")["model.layers.0.self_attn.q_proj.weight"][:2] == (
        "BF16",
        (128, 128),
    )


def test_error_missing_model_config(tmp_path):
    with pytest.raises(ValueError, match="architectures.*num_attention_heads.*num_key_value_heads"):
        hf.export_hf_checkpoint(tmp_path / "x", small_tree(), quant_algo="W4A16_NVFP4")
    config = model_config()
    del config["num_key_value_heads"]
    with pytest.raises(ValueError, match=r"lacks \['num_key_value_heads'\]"):
        hf.export_hf_checkpoint(
            tmp_path / "x", small_tree(), quant_algo="W4A16_NVFP4", config=config
        )


def test_error_kernel_that_cannot_be_quantized(tmp_path):
    tree = {"layers": {0: {"mlp": {"down_proj": {"kernel": jnp.ones((40, 32))}}}}}
    with pytest.raises(ValueError, match="down_proj.*add it to exclude="):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, quant_algo="W4A16_NVFP4", config=model_config()
        )


def test_existing_directory_needs_force_and_failures_leave_it(monkeypatch, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")
    (target / "old-00001-of-00002.safetensors").write_bytes(b"junk")
    (target / "config.json").write_text(json.dumps(model_config()))
    with pytest.raises(FileExistsError, match="not empty"):
        hf.export_hf_checkpoint(target, small_tree(), quant_algo="W4A16_NVFP4")

    def boom(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors_files, "_write_array", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        hf.export_hf_checkpoint(target, small_tree(), quant_algo="W4A16_NVFP4", force=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left
    assert sorted(os.listdir(target)) == [
        "config.json",
        "old-00001-of-00002.safetensors",
        "tokenizer.json",
    ]
    monkeypatch.undo()
    hf.export_hf_checkpoint(
        target, small_tree(), quant_algo="W4A16_NVFP4", force=True
    )  # its config.json
    assert sorted(os.listdir(target)) == [
        "config.json",
        "hf_quant_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


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


def test_error_bad_export_arguments(tmp_path):
    with pytest.raises(ValueError, match="quant_algo must be one of"):
        hf.export_hf_checkpoint(
            tmp_path / "x", small_tree(), quant_algo="FP8", config=model_config()
        )
    with pytest.raises(ValueError, match="max_shard_size"):
        hf.export_hf_checkpoint(
            tmp_path / "x", small_tree(), max_shard_size="lots", config=model_config()
        )


# --- the example model ------------------------------------------------------------------------


def test_example_llama_exports_and_loads_back(tmp_path):
    """examples/lm_model.py: calibrate, export nnx.state(model), load, rebuild, export again."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import lm_model  # noqa: PLC0415  (examples/ is on the path only now)

    recipe = nvfp4_jax.NVFP4Recipe(stochastic_rounding=False)
    cfg = lm_model.LMConfig(vocab=64, width=64, depth=1, heads=4, recipe=recipe)
    model = lm_model.TransformerLM(cfg, nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab)
    assert nvfp4_jax.nnx.calibrate(model) == 8  # 7 linears and the head
    nnx.jit(lambda m, x: m(x))(model, tokens)
    nvfp4_jax.nnx.calibrate(model, False)
    kwargs = {"config": cfg.hf_config(), "exclude": ("model.embed_tokens",)}  # lm_head in NVFP4
    first = hf.export_hf_checkpoint(tmp_path / "a", nnx.state(model), **kwargs)
    assert len(first.quantized) == 8 and first.excluded == ("model.embed_tokens",)
    # Without SR the layers hold no rng key: no leaf of the state is left out of the export.
    assert first.skipped == (), first.skipped
    served = lm_model.from_params(cfg, hf.load_hf_checkpoint(tmp_path / "a"), activations="nvfp4")
    assert np.isfinite(np.asarray(nnx.jit(lambda m, x: m(x))(served, tokens))).all()
    hf.export_hf_checkpoint(tmp_path / "b", nnx.state(served), **kwargs)
    a, b = raw_tensors(tmp_path / "a"), raw_tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("input_scale"):  # the layer keeps input_scale * 2688: within an ulp
            x, y = (np.frombuffer(t[name][2], np.float32)[0] for t in (a, b))
            assert abs(x - y) <= np.spacing(x), name
        else:
            assert a[name] == b[name], name
