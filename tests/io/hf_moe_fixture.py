"""The ModelOpt Qwen3-MoE checkpoint the mixture-of-experts tests read
(`fixtures/modelopt_qwen3moe_nvfp4/`, written by NVIDIA ModelOpt itself: a tiny Qwen3-MoE,
2 layers, 4 experts, top-2, hidden 128, moe_intermediate 64; see its README), and the helpers
that read and write its files. Plain code for test_hf_moe_*.py.

The Flax side is the layout of `nvfp4_jax.nnx.Experts` and the example model: per MoE block at
`layers/{i}/mlp`, the router `gate/kernel` (hidden, E) and one stacked kernel per projection,
`experts/{gate,up,down}_proj/kernel` (E, in, out). Trees are built from HF-named tensors by
hand here (`flax_tree_from_hf`), independently of the name maps under test; ModelOpt's encoder
and decoder are written out in NumPy (SERVING_FORMATS.md N3, T2).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from helpers import assert_same_bits
from hf_fixture import write_st

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "modelopt_qwen3moe_nvfp4"
REFERENCE = FIXTURE / "reference"
LAYERS, EXPERTS, HIDDEN, SIZE = 2, 4, 128, 64
PROJ = ("gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_LINEARS = [
    f"model.layers.{i}.mlp.experts.{e}.{p}"
    for i in range(LAYERS)
    for e in range(EXPERTS)
    for p in PROJ
]
ROUTERS = [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)]
# The activation amaxes ModelOpt calibrated, per layer: gate_up, down (fixture README).
LAYER_INPUT_AMAX = {0: (3.875, 2.375), 1: (4.1875, 1.5390625)}
RCP2688 = np.float32(1) / np.float32(2688)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
GRID = E2M1[:8]
MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


# --- helpers ----------------------------------------------------------------------------------


def modelopt_decode(weight, weight_scale, weight_scale_2) -> np.ndarray:
    """ModelOpt's NVFP4 decode: e2m1[code] * (f32(weight_scale) * weight_scale_2), (out, in)."""
    rows = weight.shape[0]
    codes = np.stack([weight & 0xF, weight >> 4], -1).reshape(rows, -1)
    factor = weight_scale.astype(np.float32) * np.float32(weight_scale_2)
    return (E2M1[codes].reshape(rows, -1, 16) * factor[..., None]).reshape(rows, -1)


def modelopt_encode(weight, amax) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """ModelOpt's NVFP4 quantization of an (out, in) weight in 1x16 blocks (N1, N3).

    weight_scale_2 = f32(amax / 2688); block scale fp8(clamp(block amax / (6 *
    weight_scale_2), 2^-9, 448)), 1.0 for a block of zeros; codes round x / (f32(scale) *
    weight_scale_2) to the nearest E2M1 value, ties to the even code.
    """
    w = np.asarray(weight, np.float32)
    rows, cols = w.shape
    ws2 = np.float32(amax) / np.float32(2688)
    blocks = w.reshape(rows, cols // 16, 16)
    block_amax = np.abs(blocks).max(-1)
    scale = np.clip(block_amax / (np.float32(6) * ws2), np.float32(2**-9), np.float32(448))
    scale = np.where(block_amax == 0, np.float32(1), scale).astype(ml_dtypes.float8_e4m3fn)
    y = (blocks / (scale.astype(np.float32) * ws2)[..., None]).astype(np.float32)
    distance = np.abs(np.abs(y)[..., None] - GRID)
    nearest = distance.argmin(-1)
    tie = (distance == distance.min(-1, keepdims=True)).sum(-1) > 1
    index = np.where(tie & (nearest % 2 == 1), nearest + 1, nearest)
    codes = (index | np.where(np.signbit(y), 8, 0)).astype(np.uint8).reshape(rows, cols)
    return (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8), scale, ws2


def assert_same_but_zero_sign(actual, expected, what=""):
    """Bit-equal f32 arrays once -0.0 is read as +0.0 (ModelOpt decodes code 0x8 as +0.0)."""
    assert_same_bits(
        np.asarray(actual, np.float32) + np.float32(0), np.asarray(expected) + np.float32(0), what
    )


def amax(x) -> np.float32:
    return np.float32(np.abs(np.asarray(x, np.float32)).max())


def expert_weight_amax(source, module: str) -> np.float32:
    """The amax ModelOpt quantized an expert's weight with: gate and up share the max (M2)."""
    parent, _, proj = module.rpartition(".")
    members = ("gate_proj", "up_proj") if proj != "down_proj" else ("down_proj",)
    return max(amax(source[f"{parent}.{p}.weight"]) for p in members)


# HF tensor name (after "model.layers.N.") -> (parent modules, Flax leaf name, transposed).
LAYER_TENSORS = (
    (r"(\w+layernorm)\.weight", (), "scale", False),
    (r"self_attn\.(\w_norm)\.weight", ("self_attn",), "scale", False),
    (r"self_attn\.(\w+)\.weight", ("self_attn",), "kernel", True),
    (r"mlp\.(gate)\.weight", ("mlp",), "kernel", True),
)
TOP_TENSORS = {
    "lm_head.weight": ("lm_head", "kernel", True),
    "model.embed_tokens.weight": ("embed_tokens", "embedding", False),
    "model.norm.weight": ("norm", "scale", False),
}


def flax_tree_from_hf(tensors: dict) -> dict:
    """The Flax tree of the MoE layout from HF-named (out, in) tensors, written out by hand."""
    tree: dict = {"layers": {i: {"self_attn": {}, "mlp": {"experts": {}}} for i in range(LAYERS)}}
    experts: dict = {}
    for name, value in tensors.items():
        value = jnp.asarray(value)
        if name in TOP_TENSORS:
            module, key, transposed = TOP_TENSORS[name]
            tree[module] = {key: value.T if transposed else value}
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = value.T
        else:
            place_layer_tensor(tree["layers"], name, value)
    for (i, proj), by_expert in experts.items():
        stack = jnp.stack([by_expert[e] for e in range(EXPERTS)])
        tree["layers"][i]["mlp"]["experts"][proj] = {"kernel": stack}
    return tree


def place_layer_tensor(layers: dict, name: str, value) -> None:
    for pattern, parents, key, transposed in LAYER_TENSORS:
        if m := re.fullmatch(r"model\.layers\.(\d+)\." + pattern, name):
            node = layers[int(m[1])]
            for parent in parents:
                node = node[parent]
            node[m[2]] = {key: value.T if transposed else value}
            return
    raise AssertionError(name)


def expert_input_amax() -> dict:
    """(E,) input amaxes per stacked layer, different for every expert, whose max over gate
    and up together, and over down, is ModelOpt's layer amax (M4); up's own max is less."""
    spread = {
        "gate_proj": np.array([1.0, 0.5, 0.75, 0.875], np.float32),
        "up_proj": np.array([0.25, 0.625, 0.875, 0.5], np.float32),
        "down_proj": np.array([0.5, 1.0, 0.25, 0.75], np.float32),
    }
    out = {}
    for i, (gate_up, down) in LAYER_INPUT_AMAX.items():
        for proj in PROJ:
            value = down if proj == "down_proj" else gate_up
            out[f"layers/{i}/mlp/experts/{proj}"] = np.roll(spread[proj], i) * np.float32(value)
    return out


def with_attention_scales(tree: dict, fixture_tensors: dict) -> dict:
    """The fixture's attention input scales as `input_scale` leaves (written as they are)."""
    for i in range(LAYERS):
        for name in ATTN:
            scale = fixture_tensors[f"model.layers.{i}.self_attn.{name}.input_scale"]
            tree["layers"][i]["self_attn"][name]["input_scale"] = jnp.asarray(scale)
    return tree


def model_config() -> dict:
    config = json.loads((FIXTURE / "config.json").read_text())
    del config["quantization_config"]
    return config


def checkpoint_dir(tmp_path: Path, tensors: dict, config: dict, name="ckpt") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    write_st(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def to_mixtral_name(name: str) -> str:
    name = re.sub(
        r"\.mlp\.experts\.(\d+)\.(\w+)\.", lambda m: f".mlp.experts.{m[1]}.{MIXTRAL[m[2]]}.", name
    )
    return name.replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(
        ".mlp.experts.", ".block_sparse_moe.experts."
    )


def mixtral_config(config: dict) -> dict:
    config = {k: v for k, v in config.items() if k != "moe_intermediate_size"}
    config |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    config["intermediate_size"] = SIZE
    return config


def leaf(tree, path: str):
    node = tree
    for key in path.split("/"):
        node = node[int(key) if key.isdigit() else key]
    return node
