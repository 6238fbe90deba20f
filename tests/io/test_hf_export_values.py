"""What `export_hf_checkpoint` writes, `load_hf_checkpoint` reads back: the values checked.

The importer refuses a checkpoint whose `weight_scale_2` is NaN, infinite or negative, whose
block scales hold E4M3 NaN or negative bytes, whose `input_scale` is not positive and finite,
whose tensor kept in high precision is not a float (unless its kind is "plain"), or whose
`config.json` is not strict JSON. The exporter takes such values from what it is given (an
`NVFP4Array` kernel, a stack of them, a frozen layer's `input_scale`, the config), so it must
refuse each one, naming the module and the tensor, before anything is written: every case
here either raises at export, leaving no folder behind, or loads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax
from nvfp4_jax import hf

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures"
RCP2688 = np.float32(1) / np.float32(2688)
MODULE = "model.layers.0.mlp.down_proj"
# E4M3 bytes: +0, the least subnormal, 448, NaN, -0, -448, NaN with the sign bit.
SCALE_BYTES = (0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFE, 0xFF)
F32_MAX = float(np.finfo(np.float32).max)
HOSTILE = (math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 1e-45, 1e-30, F32_MAX)


def config(name: str = "modelopt_llama_nvfp4") -> dict:
    value = json.loads((FIXTURE / name / "config.json").read_text())
    del value["quantization_config"]
    return value


def kernel(seed: int = 0, shape=(64, 32)) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def with_scale_byte(q, index, byte: int):
    """`q` with the block scale at `index` replaced by the E4M3 byte `byte`."""
    bits = jax.lax.bitcast_convert_type(q.scales, jnp.uint8).at[index].set(byte)
    return dataclasses.replace(q, scales=jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn))


def load_refuses(decode_scales, scale_bytes) -> bool:
    """The importer's rule: a `weight_scale_2` not finite and >= 0, a block scale byte >= 0x7F."""
    d = np.asarray(decode_scales, np.float32)
    return bool(not np.all(np.isfinite(d) & (d >= 0)) or np.max(scale_bytes) >= 0x7F)


def decode_and_bytes(q) -> tuple[np.ndarray, np.ndarray]:
    """What the exporter writes of `q`: its decode scales and its block scales' bytes."""
    return np.asarray(q.global_scale), np.asarray(q.scales).view(np.uint8)


def assert_written_or_refused(tmp_path, tree, refused: bool, match: str, **kwargs):
    """Export `tree`: refused with a ValueError matching `match` and nothing left, or loads."""
    target = tmp_path / "ckpt"
    if refused:
        with pytest.raises(ValueError, match=match):
            hf.export_hf_checkpoint(target, tree, **kwargs)
        assert os.listdir(tmp_path) == []  # no folder, no temporary sibling
        return
    hf.export_hf_checkpoint(target, tree, **kwargs)
    hf.load_hf_checkpoint(target, name_map=kwargs.get("name_map"))


def one_linear(q) -> dict:
    return {"layers": {0: {"mlp": {"down_proj": {"kernel": q}}}}}


# --- an NVFP4Array kernel ---------------------------------------------------------------------


def nvfp4_cases():
    """(id, a changed `NVFP4Array`) for every hostile value of every part export writes."""
    q = nvfp4_jax.quantize(kernel(), axis=0)
    yield "as_quantized", q
    yield "from_nan_input", nvfp4_jax.quantize(kernel().at[3, 1].set(jnp.nan), axis=0)
    yield "from_inf_input", nvfp4_jax.quantize(kernel().at[3, 1].set(jnp.inf), axis=0)
    for value in HOSTILE:
        yield f"amax={value}", dataclasses.replace(q, amax=jnp.float32(value))
        yield f"decode_scale={value}", dataclasses.replace(q, decode_scale=jnp.float32(value))
    for byte in SCALE_BYTES:
        yield f"scale_byte={byte:#04x}", with_scale_byte(q, (5, 1), byte)


# (A decode scale above f32 max / 2688 loads as an infinite amax, `weight_scale_2 * 2688`.)
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("case", list(nvfp4_cases()), ids=lambda c: c[0])
def test_an_nvfp4_kernel_is_written_only_as_load_accepts_it(tmp_path, case):
    _, q = case
    d, scale_bytes = decode_and_bytes(q)
    refused = load_refuses(d, scale_bytes)
    tensor = "weight_scale_2" if load_refuses(d, [0]) else "weight_scale"
    assert_written_or_refused(
        tmp_path,
        one_linear(q),
        refused,
        match=rf"{MODULE} .*{tensor}\b",
        quant_algo="W4A16_NVFP4",
        config=config(),
    )


def test_a_fused_group_sharing_a_nan_decode_scale_is_refused(tmp_path):
    """Members with equal (NaN) decode scales pass the group's equality check, not this one."""
    qs = {
        name: nvfp4_jax.quantize(kernel(i, (64, 64)).at[0, 0].set(jnp.nan), axis=0)
        for i, name in enumerate(("q_proj", "k_proj", "v_proj"))
    }
    tree = {"layers": {0: {"self_attn": {n: {"kernel": q} for n, q in qs.items()}}}}
    with pytest.raises(ValueError, match=r"self_attn.\{[qkv,]+\}_proj.*weight_scale_2"):
        hf.export_hf_checkpoint(tmp_path / "x", tree, quant_algo="W4A16_NVFP4", config=config())
    assert os.listdir(tmp_path) == []


def test_an_nvfp4_kernel_with_parts_of_the_wrong_dtype_is_refused(tmp_path):
    q = nvfp4_jax.quantize(kernel(), axis=0)
    bad = dataclasses.replace(q, scales=jax.lax.bitcast_convert_type(q.scales, jnp.uint8))
    with pytest.raises(TypeError, match=r"layers'\]\[0\].*down_proj.*scales must be float8"):
        hf.export_hf_checkpoint(
            tmp_path / "x", one_linear(bad), quant_algo="W4A16_NVFP4", config=config()
        )
    assert os.listdir(tmp_path) == []


# --- a stack of experts -----------------------------------------------------------------------


EXPERTS, HIDDEN, SIZE = 4, 128, 64
MLP = ("gate_proj", "up_proj", "down_proj")


def experts_tree(change) -> dict:
    """The MoE layer 0 of the Qwen3-MoE fixture's shapes, its stacks NVFP4 (one amax per
    expert, gate and up sharing theirs, as engines need); `change(name, q)` alters them."""
    stacks = {
        "gate_proj": kernel(0, (EXPERTS, HIDDEN, SIZE)),
        "up_proj": kernel(1, (EXPERTS, HIDDEN, SIZE)),
        "down_proj": kernel(2, (EXPERTS, SIZE, HIDDEN)),
    }
    gate_up = jnp.maximum(*(jnp.max(jnp.abs(stacks[n]), axis=(1, 2)) for n in MLP[:2]))
    amaxes = {"gate_proj": gate_up, "up_proj": gate_up}
    amaxes["down_proj"] = jnp.max(jnp.abs(stacks["down_proj"]), axis=(1, 2))
    quantize = jax.vmap(lambda w, a: nvfp4_jax.quantize(w, axis=0, amax=a))
    tree = {n: {"kernel": change(n, quantize(stacks[n], amaxes[n]))} for n in MLP}
    return {"layers": {0: {"mlp": {"experts": tree}}}}


def experts_cases():
    """(id, the tensor refused or None, a change of expert 2 of up_proj)."""
    yield "as_quantized", None, lambda name, q: q
    for value in (math.nan, math.inf, -1.0):

        def amax(name, q, value=value):
            return dataclasses.replace(q, amax=q.amax.at[2].set(value)) if name == "up_proj" else q

        yield f"amax[2]={value}", "weight_scale_2", amax
    for byte in (0x7F, 0x80, 0x7E):

        def scale(name, q, byte=byte):
            return with_scale_byte(q, (2, 3, 0), byte) if name == "up_proj" else q

        yield f"scale_byte[2]={byte:#04x}", "weight_scale" if byte >= 0x7F else None, scale


@pytest.mark.parametrize("case", list(experts_cases()), ids=lambda c: c[0])
def test_an_experts_stack_is_written_only_as_load_accepts_it(tmp_path, case):
    _, tensor, change = case
    tree = experts_tree(change)
    up = tree["layers"][0]["mlp"]["experts"]["up_proj"]["kernel"]
    refused = load_refuses(*decode_and_bytes(up))
    assert refused == (tensor is not None)  # (the case is what its name says)
    assert_written_or_refused(
        tmp_path,
        tree,
        refused,
        match=rf"model.layers.0.mlp.experts.2.up_proj\b.*{tensor}\b",
        name_map=hf.qwen3_moe_name_map(),
        quant_algo="W4A16_NVFP4",
        config=config("modelopt_qwen3moe_nvfp4"),
    )


# --- input scales (W4A4) ----------------------------------------------------------------------


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("source", ["input_amax", "input_scale"])
def test_an_input_scale_is_written_only_as_load_accepts_it(tmp_path, source, value):
    """A recorded input amax (times 1/2688) or a frozen layer's `input_scale` as it is."""
    tree = one_linear(kernel())
    tree["layers"][0]["mlp"]["down_proj"][source] = jnp.float32(value)
    scale = np.float32(value) * (RCP2688 if source == "input_amax" else np.float32(1))
    refused = not (np.isfinite(scale) and scale > 0)
    assert_written_or_refused(
        tmp_path, tree, refused, match=rf"positive and finite.*{MODULE}", config=config()
    )


# --- tensors kept in high precision, the config -----------------------------------------------


@pytest.mark.parametrize(
    "path, value, kind",
    [
        ("norm/scale", jnp.ones(32, jnp.int32), "norm"),
        ("norm/scale", jnp.ones(32, bool), "norm"),
        ("lm_head/kernel", jnp.ones((32, 64), jnp.int32), "linear"),
        ("embed_tokens/embedding", jnp.ones((64, 32), jnp.int8), "embedding"),
        ("layers/0/mlp/down_proj/bias", jnp.ones(32, jnp.int32), "plain"),
    ],
)
def test_a_high_precision_tensor_that_is_no_float(tmp_path, path, value, kind):
    """Only a "plain" tensor may be stored as integers: the importer reads the rest as floats."""
    tree = one_linear(kernel())
    node = tree
    *parents, name = path.split("/")
    for key in parents:
        node = node.setdefault(int(key) if key.isdigit() else key, {})
    node[name] = value
    cfg = {**config(), "vocab_size": 64, "hidden_size": 32}
    if kind == "plain":
        hf.export_hf_checkpoint(tmp_path / "ckpt", tree, quant_algo="W4A16_NVFP4", config=cfg)
        loaded = hf.load_hf_checkpoint(tmp_path / "ckpt")
        assert loaded["layers"][0]["mlp"]["down_proj"]["bias"].dtype == value.dtype
        return
    with pytest.raises(TypeError, match=rf"{path}.*{kind}.*{value.dtype}"):
        hf.export_hf_checkpoint(tmp_path / "ckpt", tree, quant_algo="W4A16_NVFP4", config=cfg)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"rope_theta": math.nan}, ValueError, r"config\['rope_theta'\] is nan"),
        ({"rope_scaling": {"factor": math.inf}}, ValueError, r"\['rope_scaling'\]\['factor'\]"),
        ({"id2label": {0: "a", "0": "b"}}, ValueError, r"config\['id2label'\].*'0' twice"),
        ({"extra": np.float32(1)}, TypeError, r"config\['extra'\] is a float32"),
        ({"deep": json.loads("[" * 70 + "]" * 70)}, ValueError, r"nests deeper than 64"),
        # Keys json writes as distinct strings, and finite floats: written, and read back.
        ({"id2label": {0: "a", 1: "b", '"q"': "c", 1.5: "d"}, "rope_theta": 1e6}, None, None),
    ],
)
def test_a_config_that_is_not_strict_json(tmp_path, change, error, match):
    """config.json is read as strict JSON (no NaN, no key twice, bounded nesting)."""
    export = dict(quant_algo="W4A16_NVFP4", config=config() | change)
    if error is None:
        hf.export_hf_checkpoint(tmp_path / "x", one_linear(kernel()), **export)
        assert hf.load_hf_checkpoint(tmp_path / "x")
        return
    with pytest.raises(error, match=match):
        hf.export_hf_checkpoint(tmp_path / "x", one_linear(kernel()), **export)
    assert os.listdir(tmp_path) == []
