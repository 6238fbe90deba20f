"""Mixture-of-experts checkpoints in ModelOpt's NVFP4 layout, both ways (SERVING_FORMATS.md 5).

The fixture `fixtures/modelopt_qwen3moe_nvfp4/` was written by NVIDIA ModelOpt itself (a tiny
Qwen3-MoE: 2 layers, 4 experts, top-2, hidden 128, moe_intermediate 64; see its README). The
Flax side is the layout of `nvfp4_jax.nnx.Experts` and the example model: per MoE block at
`layers/{i}/mlp`, the router `gate/kernel` (hidden, E) and one stacked kernel per projection,
`experts/{gate,up,down}_proj/kernel` (E, in, out). Trees are built from HF-named tensors by
hand here, independently of the name maps under test; ModelOpt's encoder and decoder are
written out in NumPy (SERVING_FORMATS.md N3, T2) and checked against the fixture's bytes.
"""

from __future__ import annotations

import json
import re
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


def checkpoint_dir(tmp_path: Path, tensors: dict, config: dict, name="ckpt") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    write_st(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


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


@pytest.fixture(scope="module")
def imported():
    return hf.load_hf_checkpoint(FIXTURE, name_map=hf.qwen3_moe_name_map())


@pytest.fixture(scope="module")
def exports(tmp_path_factory, source, fixture_tensors) -> dict:
    """The source exported W4A4 with 1x16 blocks (ModelOpt's), with 16x16, and as W4A16."""
    root = tmp_path_factory.mktemp("moe_exports")
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    out = {}
    for flavour, kwargs in {
        "1x16": {"block_2d": False, "input_amax": expert_input_amax()},
        "16x16": {"block_2d": True, "input_amax": expert_input_amax()},
        "W4A16_NVFP4": {"block_2d": False, "quant_algo": "W4A16_NVFP4"},
    }.items():
        if flavour == "W4A16_NVFP4":
            tree = flax_tree_from_hf(source)
        out[flavour + "/report"] = hf.export_hf_checkpoint(
            root / flavour,
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            **kwargs,
        )
        out[flavour] = root / flavour
        out[flavour + "/tensors"] = hf.read_safetensors(root / flavour / "model.safetensors")
    return out


# --- the name maps ----------------------------------------------------------------------------


def test_moe_name_maps_both_ways():
    qwen, mixtral = hf.qwen3_moe_name_map(), nvfp4_jax.mixtral_name_map()
    assert nvfp4_jax.qwen3_moe_name_map().rules == qwen.rules
    experts = "layers/1/mlp/experts/up_proj/kernel"
    assert qwen.to_hf(experts) == ("model.layers.1.mlp.experts.{expert}.up_proj.weight", "experts")
    assert mixtral.to_hf(experts) == (
        "model.layers.1.block_sparse_moe.experts.{expert}.w3.weight",
        "experts",
    )
    assert hf.NameMap.expert_names(qwen.to_hf(experts)[0], 2) == [
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.up_proj.weight",
    ]
    for name_map, name in (
        (qwen, "model.layers.1.mlp.experts.12.up_proj.weight"),
        (mixtral, "model.layers.1.block_sparse_moe.experts.12.w3.weight"),
    ):
        assert name_map.to_flax(name, 2) == (experts, "experts")
        assert name_map.expert_of(name, 2) == 12
    for name_map, router in (
        (qwen, "model.layers.0.mlp.gate"),
        (mixtral, "model.layers.0.block_sparse_moe.gate"),
    ):
        assert name_map.to_hf("layers/0/mlp/gate/kernel") == (f"{router}.weight", "router")
        assert name_map.to_flax(f"{router}.weight", 2) == ("layers/0/mlp/gate/kernel", "router")
        assert name_map.expert_of(f"{router}.weight", 2) is None
    # The rest is Llama's: attention, Qwen3's q_norm/k_norm, dense MLPs (mlp_only_layers).
    assert qwen.to_hf("layers/0/self_attn/q_norm/scale") == (
        "model.layers.0.self_attn.q_norm.weight",
        "norm",
    )
    assert mixtral.to_hf("layers/3/mlp/gate_proj/kernel") == (
        "model.layers.3.mlp.gate_proj.weight",
        "linear",
    )
    assert ("w1", "w3") in hf.DEFAULT_FUSED_GROUPS


def test_experts_rules_are_checked():
    with pytest.raises(ValueError, match=r"\.\{expert\}\."):
        hf.NameRule("e/{p}/kernel", "experts.{p}.weight", "experts")
    with pytest.raises(ValueError, match="must not hold"):
        hf.NameRule("e/{expert}/kernel", "m.experts.{expert}.weight", "experts")
    with pytest.raises(ValueError, match="must end in '.weight'"):
        hf.NameRule("r/kernel", "m.r.w", "router")
    with pytest.raises(ValueError, match="same fields"):
        hf.NameRule("e/{p}/kernel", "m.experts.{expert}.{q}.weight", "experts")
    custom = hf.NameMap([("moe/{i}/w_in", "h.{i}.moe.experts.{expert}.fc1.weight", "experts")])
    assert custom.to_flax("h.2.moe.experts.7.fc1.weight") == ("moe/2/w_in", "experts")
    assert custom.to_flax("h.2.moe.experts.07.fc1.weight") is None  # one spelling per index
    # A field merely named "expert" in another kind is an ordinary field.
    plain = hf.NameMap([("x/{expert}/kernel", "m.{expert}.weight", "linear")])
    assert plain.to_flax("m.abc.weight") == ("x/abc/kernel", "linear")


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


# --- export, against ModelOpt ---------------------------------------------------------------


def test_modelopt_encoder_reproduces_the_fixture(source, fixture_tensors):
    """ModelOpt's bytes are its encoder on the source with M2's and M3's amaxes: the rules."""
    for module in EXPERT_LINEARS:
        weight = source[f"{module}.weight"]
        codes, scales, ws2 = modelopt_encode(weight, expert_weight_amax(source, module))
        assert_same_bits(codes, fixture_tensors[f"{module}.weight"], module)
        assert_same_bits(
            scales.view(np.uint8), fixture_tensors[f"{module}.weight_scale"].view(np.uint8)
        )
        assert_same_bits(ws2, fixture_tensors[f"{module}.weight_scale_2"], module)


@pytest.mark.parametrize("flavour", ["1x16", "16x16"])
def test_export_writes_what_modelopt_writes(exports, flavour, source, fixture_tensors):
    """(b) The source exported with ModelOpt's settings: ModelOpt's tensors and configs.

    Names, dtypes and shapes are the fixture's, exactly. Every expert is quantized with the
    amax ModelOpt used (its weight_scale_2 is f32(amax / 2688) of ours, N1); the input
    scales are ModelOpt's bytes; the router is ModelOpt's bf16. With 1x16 blocks the codes
    and block scales are ModelOpt's except at N3's ties (adjacent values, < 1%), and
    ModelOpt's decode of every expert is our dequantize of it (T2).
    """
    ours = exports[f"{flavour}/tensors"]
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {
        k: (v.dtype, v.shape) for k, v in fixture_tensors.items()
    }
    assert_same_config_meaning(exports[flavour], FIXTURE)
    assert exports[f"{flavour}/report"].excluded == ("lm_head", "model.embed_tokens", *ROUTERS)
    for router in ROUTERS:
        assert_same_bits(ours[f"{router}.weight"], fixture_tensors[f"{router}.weight"], router)
    differ = [0, 0]
    for module in EXPERT_LINEARS:
        weight_amax = expert_weight_amax(source, module)
        ws2 = ours[f"{module}.weight_scale_2"]
        assert_same_bits(ws2, weight_amax * RCP2688, module)
        assert_same_bits(
            weight_amax / np.float32(2688), fixture_tensors[f"{module}.weight_scale_2"], module
        )
        assert_same_bits(
            ours[f"{module}.input_scale"], fixture_tensors[f"{module}.input_scale"], module
        )
        kernel = jnp.asarray(source[f"{module}.weight"]).T
        q = nvfp4_jax.quantize(
            kernel, axis=0, block_2d=flavour == "16x16", amax=jnp.float32(weight_amax)
        )
        parts = (ours[f"{module}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2"))
        decoded = modelopt_decode(*parts)
        assert_same_but_zero_sign(decoded, np.asarray(nvfp4_jax.dequantize(q)).T, module)
        if flavour == "1x16":
            differ[0] += assert_adjacent_codes(
                ours[f"{module}.weight"], fixture_tensors[f"{module}.weight"], module
            )
            differ[1] += assert_adjacent_scales(
                ours[f"{module}.weight_scale"], fixture_tensors[f"{module}.weight_scale"], module
            )
    if flavour == "1x16":
        assert differ[0] < 0.01 * len(EXPERT_LINEARS) * SIZE * HIDDEN, differ
        assert differ[1] < 0.01 * len(EXPERT_LINEARS) * SIZE * HIDDEN // 16, differ


def assert_adjacent_codes(ours, theirs, what) -> int:
    """Codes equal, or one E2M1 step apart with the same sign (N3's ties); the count apart."""
    a, b = (np.stack([x & 0xF, x >> 4], -1).astype(np.int8) for x in (ours, theirs))
    apart = a != b
    magnitude_a, magnitude_b = a & 7, b & 7
    same_sign = ((a ^ b) & 8) == 0
    ok = (np.abs(magnitude_a - magnitude_b) <= 1) & (same_sign | (magnitude_a * magnitude_b == 0))
    assert np.all(ok | ~apart), what
    return int(apart.sum())


def assert_adjacent_scales(ours, theirs, what) -> int:
    """Block scales equal or adjacent E4M3 values; the count apart."""
    a, b = (np.asarray(x).view(np.uint8).astype(np.int16) for x in (ours, theirs))
    assert np.all(np.abs(a - b) <= 1), what
    return int((a != b).sum())


def test_weight_only_export(exports, source):
    """W4A16: no input_scale anywhere, ModelOpt's config for the algorithm, same weights."""
    ours = exports["W4A16_NVFP4/tensors"]
    assert not [name for name in ours if name.endswith("input_scale")]
    config = json.loads((exports["W4A16_NVFP4"] / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_algo"] == "W4A16_NVFP4"
    assert "input_activations" not in quant["config_groups"]["group_0"]
    assert quant["ignore"] == ["lm_head", "model.embed_tokens", *ROUTERS]
    w4a4 = exports["1x16/tensors"]
    for name, value in ours.items():
        assert_same_bits(value, w4a4[name], name)


# --- the MoE rules, asserted one by one ---------------------------------------------------------


def test_gate_and_up_share_weight_scale_2(exports, source):
    """(d) M2: gate and up of each expert have one weight_scale_2, the larger amax's; M3:
    each expert its own (down too)."""
    for flavour in ("1x16", "16x16", "W4A16_NVFP4"):
        ours = exports[f"{flavour}/tensors"]
        for i in range(LAYERS):
            per_expert = []
            for e in range(EXPERTS):
                parent = f"model.layers.{i}.mlp.experts.{e}"
                gate, up = (amax(source[f"{parent}.{p}.weight"]) for p in ("gate_proj", "up_proj"))
                assert gate != up  # the fixture's up rows are 0.75x: a real test
                expected = max(gate, up) * RCP2688
                for p in ("gate_proj", "up_proj"):
                    assert_same_bits(ours[f"{parent}.{p}.weight_scale_2"], expected, parent)
                down = amax(source[f"{parent}.down_proj.weight"]) * RCP2688
                assert_same_bits(ours[f"{parent}.down_proj.weight_scale_2"], down, parent)
                per_expert.append((float(expected), float(down)))
            assert len(set(per_expert)) == EXPERTS


def test_input_scale_per_layer_and_projection_kind(exports):
    """(d) M4: one input_scale per layer for all experts' gate and up, one for down: the max
    of the (E,) amaxes given (which differ between experts here), on every expert."""
    given = expert_input_amax()
    for flavour in ("1x16", "16x16"):
        ours = exports[f"{flavour}/tensors"]
        for i in range(LAYERS):
            gate_up = max(
                given[f"layers/{i}/mlp/experts/{p}"].max() for p in ("gate_proj", "up_proj")
            )
            down = given[f"layers/{i}/mlp/experts/down_proj"].max()
            assert given[f"layers/{i}/mlp/experts/up_proj"].max() < gate_up  # shared: real
            assert len(set(given[f"layers/{i}/mlp/experts/down_proj"])) == EXPERTS
            for e in range(EXPERTS):
                parent = f"model.layers.{i}.mlp.experts.{e}"
                for p, value in (("gate_proj", gate_up), ("up_proj", gate_up), ("down_proj", down)):
                    assert_same_bits(
                        ours[f"{parent}.{p}.input_scale"], np.float32(value) * RCP2688, parent
                    )


def test_input_amax_sources_for_experts(tmp_path, source, fixture_tensors):
    """A scalar per stacked layer, one expert by HF name, and (E,) `input_amax` leaves."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    given = {k: float(v.max()) for k, v in expert_input_amax().items()}  # scalars
    given["model.layers.0.mlp.experts.2.down_proj"] = 100.0  # one expert, raising the max
    hf.export_hf_checkpoint(
        tmp_path / "a",
        tree,
        name_map=hf.qwen3_moe_name_map(),
        config=model_config(),
        input_amax=given,
    )
    ours = hf.read_safetensors(tmp_path / "a" / "model.safetensors")
    for e in range(EXPERTS):
        scale = ours[f"model.layers.0.mlp.experts.{e}.down_proj.input_scale"]
        assert_same_bits(scale, np.float32(100.0) * RCP2688)
    # Recorded leaves (as nnx.Experts.input_amax): (E,) per stacked layer, one expert at 0.
    for path, value in expert_input_amax().items():
        leaf(tree, path)["input_amax"] = jnp.asarray(value).at[3].set(0.0)
    hf.export_hf_checkpoint(
        tmp_path / "b", tree, name_map=hf.qwen3_moe_name_map(), config=model_config()
    )
    ours = hf.read_safetensors(tmp_path / "b" / "model.safetensors")
    gate_up, down = LAYER_INPUT_AMAX[1]
    for p, value in (("up_proj", gate_up), ("down_proj", down)):
        scale = ours[f"model.layers.1.mlp.experts.3.{p}.input_scale"]
        assert_same_bits(scale, np.float32(value) * RCP2688, p)


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


def test_round_trip_of_our_own_export(tmp_path, exports):
    """(c) Our 16x16 export loads and exports again bit for bit (W4A4 and W4A16)."""
    for flavour in ("16x16", "W4A16_NVFP4"):
        tree = hf.load_hf_checkpoint(exports[flavour], name_map=hf.qwen3_moe_name_map())
        algo = "W4A16_NVFP4" if flavour == "W4A16_NVFP4" else "NVFP4"
        hf.export_hf_checkpoint(
            tmp_path / flavour,
            tree,
            name_map=hf.qwen3_moe_name_map(),
            quant_algo=algo,
            config=model_config(),
        )
        assert raw_tensors(tmp_path / flavour) == raw_tensors(exports[flavour])


def test_experts_kept_in_high_precision(tmp_path, source, fixture_tensors):
    """An MoE block excluded whole: bf16 per-expert weights, the block named in ignore, and
    loaded back as a float (E, in, out) stack."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    report = hf.export_hf_checkpoint(
        tmp_path / "x",
        tree,
        name_map=hf.qwen3_moe_name_map(),
        config=model_config(),
        input_amax=expert_input_amax(),
        exclude=(*hf.DEFAULT_EXCLUDE, "model.layers.1.mlp.experts"),
    )
    assert "model.layers.1.mlp.experts" in report.excluded
    ours = hf.read_safetensors(tmp_path / "x" / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.down_proj"
    assert f"{name}.weight_scale" not in ours and ours[f"{name}.weight"].dtype == ml_dtypes.bfloat16
    assert "model.layers.0.mlp.experts.2.down_proj.weight_scale" in ours
    loaded = hf.load_hf_checkpoint(tmp_path / "x", name_map=hf.qwen3_moe_name_map())
    stack = loaded["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"]
    assert_same_bits(stack, tree["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"])
    assert isinstance(loaded["layers"][0]["mlp"]["experts"]["down_proj"]["kernel"], NVFP4Array)


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


# --- following the model: nnx.Experts ----------------------------------------------------------


class Box(nnx.Module):
    def __init__(self, **children):
        for name, value in children.items():
            setattr(self, name, value)


def moe_model(source, recipes) -> nnx.Module:
    """The fixture's MoE blocks as nnx modules: a router, `nvfp4_jax.nnx.Experts` with the
    recipe of each layer (`recipes[i]`) and recorded (E,) input amaxes."""
    tree = flax_tree_from_hf({k: v for k, v in source.items() if ".mlp." in k})
    rngs = nnx.Rngs(0)
    layers = []
    for i in range(LAYERS):
        stacks = tree["layers"][i]["mlp"]["experts"]
        experts = {}
        for proj in PROJ:
            kernel = stacks[proj]["kernel"]
            layer = nvfp4_jax.nnx.Experts(*kernel.shape, recipe=recipes[i], rngs=rngs)
            layer.kernel[...] = kernel.astype(jnp.float32)
            recorded = expert_input_amax()[f"layers/{i}/mlp/experts/{proj}"]
            layer.input_amax[...] = jnp.asarray(recorded)
            experts[proj] = layer
        gate = Box(kernel=nnx.Param(tree["layers"][i]["mlp"]["gate"]["kernel"]))
        layers.append(Box(mlp=Box(gate=gate, experts=Box(**experts))))
    return Box(layers=nnx.List(layers))


def test_export_follows_the_experts_recipe(tmp_path, source):
    """nnx.Experts with a recipe: quantized, with its recorded (E,) input_amax; recipe=None
    beside NVFP4 layers: the whole block in bf16, named in ignore by its block name."""
    name_map, nvfp4 = hf.qwen3_moe_name_map(), nvfp4_jax.NVFP4Recipe()
    model = moe_model(source, (nvfp4, None))
    report = hf.export_hf_checkpoint(
        tmp_path / "m", model, name_map=name_map, config=model_config()
    )
    layer0 = [m for m in EXPERT_LINEARS if ".layers.0." in m]
    layer1 = [m for m in EXPERT_LINEARS if ".layers.1." in m]
    assert report.followed == "model" and sorted(report.quantized) == sorted(layer0)
    assert sorted(report.trained_high_precision) == sorted(layer1)
    assert report.excluded == (ROUTERS[0], "model.layers.1.mlp.experts", ROUTERS[1])
    ours = hf.read_safetensors(tmp_path / "m" / "model.safetensors")
    gate_up, _ = LAYER_INPUT_AMAX[0]
    scale = ours["model.layers.0.mlp.experts.1.up_proj.input_scale"]
    assert_same_bits(scale, np.float32(gate_up) * RCP2688)
    for module in layer1:
        assert_same_bits(ours[f"{module}.weight"], source[f"{module}.weight"], module)
    # The same decisions from the rules, given with a plain dict of the weights.
    rules = [nvfp4_jax.Rule("layers/1/", None), nvfp4_jax.Rule("experts", nvfp4)]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export_hf_checkpoint(
        tmp_path / "r",
        params,
        name_map=name_map,
        config=model_config(),
        rules=rules,
        input_amax={k: v for k, v in expert_input_amax().items() if "layers/0/" in k},
    )
    assert raw_tensors(tmp_path / "r") == raw_tensors(tmp_path / "m")
    # And from the QuantizeReport of quantize_model, which set the recipes of a bf16 model.
    model = moe_model(source, (None, None))
    report = nvfp4_jax.quantize_model(model, rules, rngs=nnx.Rngs(quantize=0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export_hf_checkpoint(
        tmp_path / "q",
        params,
        name_map=name_map,
        config=model_config(),
        rules=report,
        input_amax={k: v for k, v in expert_input_amax().items() if "layers/0/" in k},
    )
    assert raw_tensors(tmp_path / "q") == raw_tensors(tmp_path / "m")
    # A state does not say which recipe an Experts layer had.
    with pytest.raises(ValueError, match="pass the model"):
        hf.export_hf_checkpoint(
            tmp_path / "s", nnx.state(model), name_map=name_map, config=model_config()
        )
    # A model with no NVFP4 layer at all (trained in bf16) is quantized whole, as a dense one.
    report = hf.export_hf_checkpoint(
        tmp_path / "b", moe_model(source, (None, None)), name_map=name_map, config=model_config()
    )
    assert report.followed == "" and len(report.quantized) == len(EXPERT_LINEARS)


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


def test_error_router_quantization(tmp_path, source, fixture_tensors):
    """(e) A router in NVFP4, given to the export or found in a checkpoint."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    router = tree["layers"][0]["mlp"]["gate"]
    router["kernel"] = nvfp4_jax.quantize(router["kernel"], axis=0)
    with pytest.raises(ValueError, match=r"router model.layers.0.mlp.gate .*high precision"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=expert_input_amax(),
        )
    tensors = dict(fixture_tensors)
    for suffix, value in (
        ("weight", np.zeros((4, 64), np.uint8)),
        ("weight_scale", np.ones((4, 8), ml_dtypes.float8_e4m3fn)),
        ("weight_scale_2", np.float32(1)),
        ("input_scale", np.float32(1)),
    ):
        tensors[f"model.layers.0.mlp.gate.{suffix}"] = value
    config = json.loads((FIXTURE / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "model.embed_tokens"]
    directory = checkpoint_dir(tmp_path, tensors, config)
    with pytest.raises(ValueError, match=r"router model.layers.0.mlp.gate is stored in NVFP4"):
        hf.load_hf_checkpoint(directory, name_map=hf.qwen3_moe_name_map())


def test_error_nan_in_an_experts_input_amax(tmp_path, source, fixture_tensors):
    """(e) An (E,) input amax with a NaN names the expert; a layer never calibrated too."""
    tree = with_attention_scales(flax_tree_from_hf(source), fixture_tensors)
    given = expert_input_amax()
    given["layers/1/mlp/experts/down_proj"] = given["layers/1/mlp/experts/down_proj"].copy()
    given["layers/1/mlp/experts/down_proj"][2] = np.nan
    with pytest.raises(ValueError, match=r"nan.*model.layers.1.mlp.experts.2.down_proj"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=given,
        )
    given = expert_input_amax()
    given["layers/0/mlp/experts/up_proj"] = np.zeros(EXPERTS, np.float32)
    given["layers/0/mlp/experts/gate_proj"] = np.zeros(EXPERTS, np.float32)
    with pytest.raises(ValueError, match=r"never calibrated.*layers.0.mlp.experts"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=given,
        )
    given = {k: v for k, v in expert_input_amax().items() if "layers/1/mlp/experts/up" not in k}
    with pytest.raises(ValueError, match=r"no input amax for .*layers.1.mlp.experts"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax=given,
        )
    with pytest.raises(ValueError, match=r"shape \(4,\), got \(3,\)"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            name_map=hf.qwen3_moe_name_map(),
            config=model_config(),
            input_amax={**expert_input_amax(), "layers/0/mlp/experts/up_proj": np.ones(3)},
        )


def test_error_bad_moe_exports(tmp_path, source):
    name_map = hf.qwen3_moe_name_map()
    tree = flax_tree_from_hf(source)
    w4a16 = {"name_map": name_map, "quant_algo": "W4A16_NVFP4"}
    config = model_config()
    del config["num_local_experts"]
    with pytest.raises(ValueError, match="num_experts or num_local_experts"):
        hf.export_hf_checkpoint(tmp_path / "x", tree, config=config, **w4a16)
    with pytest.raises(ValueError, match="moe_intermediate_size=32"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, config={**model_config(), "moe_intermediate_size": 32}, **w4a16
        )
    with pytest.raises(ValueError, match="num_experts_per_tok from 1 to 4"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, config={**model_config(), "num_experts_per_tok": 5}, **w4a16
        )
    with pytest.raises(ValueError, match="half excluded"):
        hf.export_hf_checkpoint(
            tmp_path / "x",
            tree,
            config=model_config(),
            exclude=(*hf.DEFAULT_EXCLUDE, "model.layers.0.mlp.experts.1.*"),
            **w4a16,
        )
    with pytest.raises(ValueError, match="experts rule: nvfp4_jax.hf.qwen3_moe_name_map"):
        hf.export_hf_checkpoint(
            tmp_path / "x", tree, config=model_config(), quant_algo="W4A16_NVFP4"
        )
    flat = flax_tree_from_hf(source)
    flat["layers"][0]["mlp"]["experts"]["up_proj"]["kernel"] = jnp.zeros((HIDDEN, SIZE))
    with pytest.raises(ValueError, match=r"needs a stacked \(E, in, out\) kernel"):
        hf.export_hf_checkpoint(tmp_path / "x", flat, config=model_config(), **w4a16)
    assert not (tmp_path / "x").exists()
