"""The ModelOpt Llama checkpoint the Hugging Face tests read (`fixtures/modelopt_llama_nvfp4/`,
written by NVIDIA ModelOpt itself, see its README): its paths and linears, and the helpers that
read and write its files. Plain code: its fixtures (`input_amax`, `imported`, `exports`,
`flavour`) are in conftest.py.

Exported models are built from its `reference/source_weights_bf16.safetensors` (the bf16
weights ModelOpt quantized), turned into the Flax tree of the example Llama by hand here
(`flax_tree_from_hf`), independently of the name map under test. Files are read back with
the `safetensors` package where it can (headers, names, dtypes, shapes) and decoded with
ModelOpt's formula in NumPy (`modelopt_decode`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
from helpers import assert_same_bits

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
