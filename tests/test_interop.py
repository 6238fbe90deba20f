"""Interop: scaled_matmul operands and GEMM backend, sharded master weights, checkpoints, export."""

from __future__ import annotations

import importlib
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from nvfp4_jax import NVFP4Recipe, dequantize, dot_general, interop, quantize
from nvfp4_jax.checkpoint import restore_checkpoint, save_checkpoint, validate_nvfp4_array
from nvfp4_jax.export import export_nvfp4_safetensors, read_safetensors
from nvfp4_jax.layout import swizzle_scales

# E2M1 code -> value, straight from NUMERICS section 1 (bit 3 = sign).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
RCP2688 = np.float32(1 / 2688)
dot_general_module = importlib.import_module("nvfp4_jax.dot_general")


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


def on_blackwell():
    return interop.scaled_matmul_unsupported_reason() is None


# ---- jax.nn.scaled_matmul operands ---------------------------------------------------------


@pytest.mark.parametrize(
    "shape,axis,block_2d,rht",
    [((32, 64), -1, False, False), ((64, 48), 0, True, False), ((2, 16, 32), -1, False, True)],
    ids=["m32_k64", "k64_n48_axis0_2d", "batch2_rht"],
)
def test_operands_round_trip(shape, axis, block_2d, rht):
    q = quantize(normal(shape, dtype=jnp.bfloat16), axis=axis, block_2d=block_2d, rht=rht)
    ops = jax.jit(interop.to_scaled_matmul_operands)(q)
    assert ops.data.dtype == jnp.float4_e2m1fn and ops.data.shape == q.stored_shape
    assert ops.scales.dtype == jnp.float8_e4m3fn and ops.scales.shape == q.scales.shape
    assert same_bits(ops.global_scale, q.amax * RCP2688)
    back = interop.from_scaled_matmul_operands(
        ops.data, ops.scales, q.amax, dtype=q.dtype, axis=q.axis, block_2d=block_2d, rht=rht
    )
    assert_same_nvfp4(back, q)


def test_operand_values_follow_the_nibble_order():
    q = quantize(normal((16, 32)))
    data = np.asarray(interop.to_scaled_matmul_operands(q).data).astype(np.float32)
    codes = np.asarray(q.codes)
    expected = np.stack([E2M1[codes & 0xF], E2M1[codes >> 4]], axis=-1).reshape(16, 32)
    np.testing.assert_array_equal(data, expected)


def test_from_operands_rejects_wrong_dtypes_and_shapes():
    ops = interop.to_scaled_matmul_operands(quantize(normal((16, 32))))
    with pytest.raises(TypeError, match="float4_e2m1fn"):
        interop.from_scaled_matmul_operands(ops.data.astype(jnp.float32), ops.scales, 1.0)
    with pytest.raises(ValueError, match="scales of shape"):
        interop.from_scaled_matmul_operands(ops.data, ops.scales[:, :1], 1.0)


def test_emulated_scaled_matmul_is_the_dequantized_product():
    qa, qb = quantize(normal((32, 64), 1)), quantize(normal((48, 64), 2))
    got = interop.scaled_matmul(qa, qb, backend="emulated")
    expected = dequantize(qa) @ dequantize(qb).T
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    not on_blackwell(),
    reason="jax.nn.scaled_matmul NVFP4 needs a CUDA GPU "
    f"with compute capability >= 10: {interop.scaled_matmul_unsupported_reason()}",
)
def test_scaled_matmul_equals_emulated_gemm_on_blackwell():
    qa, qb = quantize(normal((256, 320), 1)), quantize(normal((128, 320), 2))
    hw = interop.scaled_matmul(qa, qb, backend="scaled_matmul")
    emulated = interop.scaled_matmul(qa, qb, backend="emulated")
    np.testing.assert_allclose(hw, emulated, rtol=1e-5, atol=1e-4 * float(jnp.abs(emulated).max()))
    x, w = normal((64, 256), 3, jnp.bfloat16), normal((256, 128), 4, jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    results = {}
    for backend in ("emulated", "scaled_matmul"):
        recipe = NVFP4Recipe(gemm_backend=backend)

        def loss(x, w, recipe=recipe):
            y = dot_general(x, w, dims, recipe=recipe, key=jax.random.key(5))
            return jnp.sum(y.astype(jnp.float32) ** 2)

        results[backend] = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    for hw, ref in zip(
        jax.tree.leaves(results["scaled_matmul"]), jax.tree.leaves(results["emulated"]), strict=True
    ):
        hw, ref = np.asarray(hw, np.float32), np.asarray(ref, np.float32)
        np.testing.assert_allclose(hw, ref, rtol=2e-2, atol=1e-2 * np.abs(ref).max())


# ---- GEMM backend in the recipe ------------------------------------------------------------


def test_recipe_rejects_unknown_backend():
    with pytest.raises(ValueError, match="gemm_backend"):
        NVFP4Recipe(gemm_backend="cublas")


@pytest.mark.skipif(on_blackwell(), reason="checks the error raised off Blackwell")
def test_scaled_matmul_backend_off_blackwell_raises_clearly():
    x, w = normal((16, 32)), normal((32, 16))
    with pytest.raises(ValueError, match="compute capability|not a CUDA GPU"):
        dot_general(
            x, w, (((1,), (0,)), ((), ())), recipe=NVFP4Recipe(gemm_backend="scaled_matmul")
        )
    assert interop.resolve_gemm_backend(None) == "emulated"


def test_default_backend_gives_the_emulated_numbers():
    x, w = normal((32, 64), 1), normal((64, 32), 2)
    dims = (((1,), (0,)), ((), ()))
    expected = interop.resolve_gemm_backend(None)
    default = dot_general(x, w, dims, recipe=NVFP4Recipe())
    explicit = dot_general(x, w, dims, recipe=NVFP4Recipe(gemm_backend=expected))
    assert same_bits(default, explicit)


def fake_cudnn_product(lhs, rhs, lhs3, rhs3):
    """Stands in for jax.nn.scaled_matmul on CPU: the same block-scaled sum, from the operands."""
    parts = []
    for q, shape in ((lhs, lhs3), (rhs, rhs3)):
        data, scales, _ = interop.to_scaled_matmul_operands(q)
        values = data.astype(jnp.float32).reshape(*shape[:2], -1, 16)
        parts.append(
            (values * scales.astype(jnp.float32).reshape(*shape[:2], -1, 1)).reshape(shape)
        )
    return jnp.einsum("bmk,bnk->bmn", *parts, precision="highest")


@pytest.mark.parametrize("weight_2d", [True, False], ids=["w2d", "w1d"])
def test_scaled_matmul_backend_wiring_matches_emulated(monkeypatch, weight_2d):
    """The packed operands of all three GEMMs, checked on CPU with a stand-in for cuDNN."""
    monkeypatch.setattr(interop, "_cudnn_product", fake_cudnn_product)
    monkeypatch.setattr(interop, "scaled_matmul_unsupported_reason", lambda: None)
    x, w = normal((40, 64), 1), normal((64, 48), 2)
    dims = (((1,), (0,)), ((), ()))
    results = {}
    for backend in ("emulated", "scaled_matmul"):
        recipe = NVFP4Recipe(gemm_backend=backend, weight_2d=weight_2d)

        def loss(x, w, recipe=recipe):
            return jnp.sum(jnp.sin(dot_general(x, w, dims, recipe=recipe, key=jax.random.key(3))))

        results[backend] = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    for got, ref in zip(
        jax.tree.leaves(results["scaled_matmul"]), jax.tree.leaves(results["emulated"]), strict=True
    ):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_transposed_2d_blocks_equal_quantizing_the_other_way():
    w = normal((64, 48), 4)
    q_nk = quantize(w, axis=0, block_2d=True)
    q_kn = quantize(w, axis=1, block_2d=True)
    moved = dot_general_module._transpose_2d_blocks(q_nk)
    assert same_bits(moved.codes, q_kn.codes) and same_bits(moved.scales, q_kn.scales)


# ---- sharded master weights (8 CPU devices, in a subprocess) -------------------------------

SCRIPT = "interop_distributed_checks.py"
MASTER_CHECKS = [
    "rows_1d",
    "cols_1d",
    "rows_2d_blocks",
    "cols_2d_blocks_axis0",
    "both_axes_2d_blocks",
    "nan_on_one_shard",
]


@pytest.fixture(scope="module")
def master_report(run_check_script):
    lines, output, _ = run_check_script(SCRIPT, MASTER_CHECKS, timeout=300)
    return lines, output


@pytest.mark.parametrize("check", MASTER_CHECKS)
def test_master_weights_sharded_equal_unsharded(master_report, check):
    lines, output = master_report
    assert check in lines, output[-4000:]
    assert lines[check].startswith("PASS"), lines[check]


class EightWayMesh:
    """Only the mesh sizes, for the shard check (this process has one device)."""

    shape = {"x": 8}


def test_master_weights_reject_blocks_across_devices():
    # 136 columns over 8 shards: 17 each, so blocks of 16 would straddle devices.
    with pytest.raises(ValueError, match="multiple of 16"):
        interop._check_shards((32, 136), [None, "x"], EightWayMesh(), -1, False)
    # 2D blocks also need whole 16-row tiles per shard: 64 rows over 8 shards is 8 each.
    with pytest.raises(ValueError, match="multiple of 16"):
        interop._check_shards((64, 128), ["x", None], EightWayMesh(), -1, True)


def test_master_weights_on_one_device_equal_quantize():
    mesh = jax.make_mesh((1,), ("x",))
    spec = jax.sharding.PartitionSpec(None, "x")
    q = interop.quantize_master_weights(normal((32, 64)), mesh=mesh, spec=spec)
    assert_same_nvfp4(q, quantize(normal((32, 64))))


# ---- checkpoints ---------------------------------------------------------------------------


def test_checkpoint_round_trip_of_a_pytree(tmp_path):
    tree = {
        "w": quantize(normal((64, 32), dtype=jnp.bfloat16), axis=0, block_2d=True),
        "layers": [quantize(normal((16, 48), 1), rht=True), jnp.arange(5.0)],
    }
    save_checkpoint(tmp_path / "ckpt", tree)
    target = jax.eval_shape(lambda: tree)
    restored = restore_checkpoint(tmp_path / "ckpt", target)
    assert_same_nvfp4(restored["w"], tree["w"])
    assert_same_nvfp4(restored["layers"][0], tree["layers"][0])
    assert same_bits(restored["layers"][1], tree["layers"][1])
    untargeted = restore_checkpoint(tmp_path / "ckpt")
    assert_same_nvfp4(untargeted["layers"]["0"], tree["layers"][0])


class QuantizedMLP(nnx.Module):
    def __init__(self, seed):
        keys = jax.random.split(jax.random.key(seed))
        self.up = nnx.Variable(
            quantize(jax.random.normal(keys[0], (64, 32)), axis=0, block_2d=True)
        )
        self.down = nnx.Variable(quantize(jax.random.normal(keys[1], (32, 64)), axis=0))
        self.bias = nnx.Param(jnp.zeros((64,)))

    def __call__(self, x):
        h = jax.nn.relu(x @ self.up.get_value().dequantize())
        return h @ self.down.get_value().dequantize() + self.bias[...]


def test_checkpoint_round_trip_of_an_nnx_model(tmp_path):
    model = QuantizedMLP(0)
    save_checkpoint(tmp_path / "model", nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: QuantizedMLP(1)))
    restored = nnx.merge(graphdef, restore_checkpoint(tmp_path / "model", abstract))
    assert_same_nvfp4(restored.up.get_value(), model.up.get_value())
    assert_same_nvfp4(restored.down.get_value(), model.down.get_value())
    x = normal((4, 64), 7)
    assert same_bits(restored(x), model(x))


def test_restore_with_wrong_shape_or_metadata_raises(tmp_path):
    save_checkpoint(tmp_path / "c", {"w": quantize(normal((64, 32)), axis=0)})
    wrong_shape = jax.eval_shape(lambda: {"w": quantize(normal((64, 64)), axis=0)})
    with pytest.raises(ValueError, match="'w' was saved with"):
        restore_checkpoint(tmp_path / "c", wrong_shape)
    wrong_meta = jax.eval_shape(lambda: {"w": quantize(normal((64, 32)), axis=0, block_2d=True)})
    with pytest.raises(ValueError, match="block_2d"):
        restore_checkpoint(tmp_path / "c", wrong_meta)
    with pytest.raises(ValueError, match="no entry 'v'"):
        restore_checkpoint(tmp_path / "c", {"v": jax.ShapeDtypeStruct((3,), jnp.float32)})


def test_validate_rejects_wrong_dtypes_and_shapes():
    q = quantize(normal((32, 64)))
    with pytest.raises(TypeError, match="scales must be float8_e4m3fn"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "scales": q.scales.astype(jnp.float32)}))
    with pytest.raises(ValueError, match="need scales of shape"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "scales": q.scales[:, :2]}))
    with pytest.raises(TypeError, match="codes must be uint8"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "codes": q.codes.astype(jnp.int32)}))
    assert validate_nvfp4_array(q) is q


def test_save_rejects_an_invalid_array(tmp_path):
    q = quantize(normal((32, 64)))
    bad = q.__class__(**{**vars(q), "amax": q.amax.astype(jnp.bfloat16)})
    with pytest.raises(TypeError, match="amax must be float32"):
        save_checkpoint(tmp_path / "bad", {"w": bad})


# ---- export --------------------------------------------------------------------------------


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
