"""Export of dense weights to the ModelOpt NVFP4 safetensors layout."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from nvfp4_jax import dequantize, quantize
from nvfp4_jax.export import export_nvfp4_safetensors, read_safetensors
from nvfp4_jax.layout import swizzle_scales

# E2M1 code -> value, straight from docs/NUMERICS.md section 1 (bit 3 = sign).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(
        a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    )


def assert_same_nvfp4(a, b):
    for part in ("codes", "scales", "amax"):
        assert same_bits(getattr(a, part), getattr(b, part)), part
    assert (a.dtype, a.axis, a.block_2d, a.rht) == (b.dtype, b.axis, b.block_2d, b.rht)


def modelopt_dequantize(weight, weight_scale, weight_scale_2):
    """ModelOpt's NVFP4 dequantization, from the file's tensors: value * (f32(s) * ws2)."""
    codes = np.stack([weight & 0xF, weight >> 4], axis=-1).reshape(weight.shape[0], -1)
    factor = weight_scale.astype(np.float32) * np.float32(weight_scale_2)
    blocks = E2M1[codes].reshape(*factor.shape, 16) * factor[..., None]
    return blocks.reshape(codes.shape)


@pytest.mark.parametrize("block_2d", [True, False], ids=["w2d", "w1d"])
def test_export_round_trip_is_bit_exact(tmp_path, block_2d):
    params = {
        "mlp": {"up": {"kernel": normal((64, 128), 1), "bias": jnp.arange(128.0)}},
        "head": {"kernel": normal((128, 40), 2)},  # 40 is not a multiple of 16: excluded
    }
    kinds = export_nvfp4_safetensors(
        tmp_path, params, block_2d=block_2d, input_amax={"mlp.up": 3.0}, swizzled_scales=True
    )
    assert kinds == {"mlp.up": "nvfp4", "mlp.up.bias": "array", "head": "excluded"}
    tensors = read_safetensors(tmp_path / "model.safetensors")
    w = tensors["mlp.up.weight"]
    assert w.dtype == np.uint8 and w.shape == (128, 32)  # (out, in / 2)
    assert tensors["mlp.up.weight_scale"].dtype == ml_dtypes.float8_e4m3fn
    assert tensors["mlp.up.weight_scale"].shape == (128, 4)
    assert (
        tensors["mlp.up.weight_scale_2"].shape == () and tensors["mlp.up.input_scale"].shape == ()
    )
    q = quantize(params["mlp"]["up"]["kernel"], axis=0, block_2d=block_2d)
    from_file = modelopt_dequantize(
        w, tensors["mlp.up.weight_scale"], tensors["mlp.up.weight_scale_2"]
    )
    assert same_bits(from_file, np.asarray(dequantize(q)).T)
    assert same_bits(
        tensors["mlp.up.weight_scale_swizzled"], swizzle_scales(tensors["mlp.up.weight_scale"])
    )
    assert same_bits(tensors["mlp.up.bias"], params["mlp"]["up"]["bias"])
    assert same_bits(tensors["head.weight"], np.asarray(params["head"]["kernel"]).T)
    config = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert config["quantization"] == {
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["head"],
    }


def test_export_of_an_nnx_state(tmp_path):
    model = nnx.Linear(32, 48, rngs=nnx.Rngs(0))
    kinds = export_nvfp4_safetensors(tmp_path, nnx.state(model))
    assert kinds == {"": "nvfp4", "bias": "array"}
    tensors = read_safetensors(tmp_path / "model.safetensors")
    assert tensors[".weight"].shape == (48, 16)


def test_export_rejects_quantized_leaves_and_unknown_input_amax(tmp_path):
    with pytest.raises(TypeError, match="already quantized"):
        export_nvfp4_safetensors(tmp_path, {"l": {"kernel": quantize(normal((32, 32)))}})
    with pytest.raises(ValueError, match="not a quantized layer"):
        export_nvfp4_safetensors(
            tmp_path, {"l": {"kernel": normal((32, 32))}}, input_amax={"x": 1.0}
        )
