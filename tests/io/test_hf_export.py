"""The export for engines (nvfp4_jax/_src/io/hf/export/): every requirement of the serving
contract as a test on an exported directory (configs, tensor names, dtypes and shapes, fused
groups' shared scales, input scales, excluded modules, ModelOpt's decode, Four Over Six,
shards and their index), the sources of the input amax, memory while writing, and the errors.
The fixture and its helpers are hf_fixture.py's; the exported directories conftest.py's
`exports`.
"""

from __future__ import annotations

import json
import os
import tracemalloc

import hf_fixture
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_bits
from hf_fixture import (
    ATTN,
    GROUPS,
    LAYERS,
    LINEARS,
    MLP,
    PLAIN,
    RCP2688,
    assert_same_but_zero_sign,
    flax_path,
    flax_tree_from_hf,
    headers,
    leaf,
    model_config,
    modelopt_decode,
    raw_tensors,
)

import nvfp4_jax
from nvfp4_jax import hf
from nvfp4_jax._src.io.hf import safetensors_files

# The checkpoint conftest.py's `fixture_tensors` and `source` read.
FIXTURE, REFERENCE = hf_fixture.FIXTURE, hf_fixture.REFERENCE


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


def test_error_bad_export_arguments(tmp_path):
    with pytest.raises(ValueError, match="quant_algo must be one of"):
        hf.export_hf_checkpoint(
            tmp_path / "x", small_tree(), quant_algo="FP8", config=model_config()
        )
    with pytest.raises(ValueError, match="max_shard_size"):
        hf.export_hf_checkpoint(
            tmp_path / "x", small_tree(), max_shard_size="lots", config=model_config()
        )
