"""The NVFP4 GEMM (nvfp4_jax.gemm): jax.nn.scaled_matmul operands, the backends, and the
dgrad weight transpose."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, assert_same_q, heavy_tailed, normal, same_bits

from nvfp4_jax import NVFP4Recipe, dequantize, dot_general, quantize, reference
from nvfp4_jax._src.core import ops
from nvfp4_jax._src.training import gemm, scaled_matmul

# E2M1 code -> value, straight from docs/NUMERICS.md section 1 (bit 3 = sign).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
RCP2688 = np.float32(1 / 2688)


def on_blackwell():
    return gemm.scaled_matmul_unsupported_reason() is None


# ---- jax.nn.scaled_matmul operands ---------------------------------------------------------


@pytest.mark.parametrize(
    "shape,axis,block_2d,rht",
    [((32, 64), -1, False, False), ((64, 48), 0, True, False), ((2, 16, 32), -1, False, True)],
    ids=["m32_k64", "k64_n48_axis0_2d", "batch2_rht"],
)
def test_operands_round_trip(shape, axis, block_2d, rht):
    q = quantize(normal(shape, dtype=jnp.bfloat16), axis=axis, block_2d=block_2d, rht=rht)
    ops = jax.jit(scaled_matmul.to_scaled_matmul_operands)(q)
    assert ops.data.dtype == jnp.float4_e2m1fn and ops.data.shape == q.stored_shape
    assert ops.scales.dtype == jnp.float8_e4m3fn and ops.scales.shape == q.scales.shape
    assert same_bits(ops.global_scale, q.amax * RCP2688)
    back = scaled_matmul.from_scaled_matmul_operands(
        ops.data, ops.scales, q.amax, dtype=q.dtype, axis=q.axis, block_2d=block_2d, rht=rht
    )
    assert_same_q(back, q)


# ---- the emulated operand: block values on every implementation ----------------------------


@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: d.__name__
)
@pytest.mark.parametrize(
    "shape,axis,block_2d,rht",
    [((48, 80), -1, False, False), ((64, 32), 0, True, False), ((3, 32, 64), -1, False, True)],
    ids=["m48_k80", "axis0_2d", "batch3_rht"],
)
def test_block_values_match_the_reference_and_the_code_table(
    impl, shape, axis, block_2d, rht, dtype
):
    x = jnp.asarray(heavy_tailed(shape, "bf16", seed=3))
    q = quantize(x, axis=axis, block_2d=block_2d, rht=rht, implementation="reference")
    got = jax.jit(lambda q: ops.block_values(q, dtype, implementation=impl.implementation))(
        jax.device_put(q, impl.device)
    )
    assert_same_bits(got, reference.block_values(q, dtype), f"{impl.name} block values")
    # value(code) * f32(s_b), no tensor factor and no inverse RHT, in the stored layout.
    codes = np.asarray(q.codes)
    table = np.stack([E2M1[codes & 0xF], E2M1[codes >> 4]], axis=-1).reshape(q.stored_shape)
    scales = np.repeat(np.asarray(q.scales).astype(np.float32), 16, axis=-1)
    assert_same_bits(got, (table * scales).astype(dtype), f"{impl.name} against the code table")


def test_block_values_of_a_batch_and_of_non_finite_input(impl):
    x = jnp.asarray(heavy_tailed((2, 16, 32), "f32", seed=4)).at[1, 3, 5].set(jnp.nan)
    q = jax.vmap(lambda t: quantize(t, implementation="reference"))(x)  # one amax per tensor
    got = jax.jit(lambda q: ops.block_values(q, implementation=impl.implementation))(
        jax.device_put(q, impl.device)
    )
    expected = reference.block_values(q)
    assert_same_bits(got, expected, f"{impl.name} batch block values")
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    assert np.isnan(np.asarray(got[1], np.float32)).all()  # every scale is the E4M3 NaN


def test_block_values_reject_what_is_not_an_nvfp4_array():
    with pytest.raises(TypeError, match="block_values: q must be an NVFP4Array, got ndarray"):
        ops.block_values(np.zeros((16, 16), np.float32))
    with pytest.raises(TypeError, match="block_values"):
        ops.block_values(quantize(normal((16, 32))), jnp.int8)
    with pytest.raises(TypeError, match="block_values: dtype must be"):
        reference.block_values(quantize(normal((16, 32))), jnp.int8)


def test_operand_values_follow_the_nibble_order():
    q = quantize(normal((16, 32)))
    data = np.asarray(scaled_matmul.to_scaled_matmul_operands(q).data).astype(np.float32)
    codes = np.asarray(q.codes)
    expected = np.stack([E2M1[codes & 0xF], E2M1[codes >> 4]], axis=-1).reshape(16, 32)
    np.testing.assert_array_equal(data, expected)


def test_from_operands_rejects_wrong_dtypes_and_shapes():
    ops = scaled_matmul.to_scaled_matmul_operands(quantize(normal((16, 32))))
    with pytest.raises(TypeError, match="float4_e2m1fn"):
        scaled_matmul.from_scaled_matmul_operands(ops.data.astype(jnp.float32), ops.scales, 1.0)
    with pytest.raises(ValueError, match="scales of shape"):
        scaled_matmul.from_scaled_matmul_operands(ops.data, ops.scales[:, :1], 1.0)


def test_emulated_scaled_matmul_is_the_dequantized_product():
    qa, qb = quantize(normal((32, 64), 1)), quantize(normal((48, 64), 2))
    got = gemm.scaled_matmul(qa, qb, backend="emulated")
    expected = dequantize(qa) @ dequantize(qb).T
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    not on_blackwell(),
    reason="jax.nn.scaled_matmul NVFP4 needs a CUDA GPU "
    f"with compute capability >= 10: {gemm.scaled_matmul_unsupported_reason()}",
)
def test_scaled_matmul_equals_emulated_gemm_on_blackwell():
    qa, qb = quantize(normal((256, 320), 1)), quantize(normal((128, 320), 2))
    hw = gemm.scaled_matmul(qa, qb, backend="scaled_matmul")
    emulated = gemm.scaled_matmul(qa, qb, backend="emulated")
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
    assert gemm.resolve_gemm_backend(None) == "emulated"


def test_default_backend_gives_the_emulated_numbers():
    x, w = normal((32, 64), 1), normal((64, 32), 2)
    dims = (((1,), (0,)), ((), ()))
    expected = gemm.resolve_gemm_backend(None)
    default = dot_general(x, w, dims, recipe=NVFP4Recipe())
    explicit = dot_general(x, w, dims, recipe=NVFP4Recipe(gemm_backend=expected))
    assert same_bits(default, explicit)


def fake_cudnn_product(lhs, rhs):
    """Stands in for jax.nn.scaled_matmul on CPU: the same block-scaled sum, from the operands."""
    parts = []
    for q in (lhs, rhs):
        data, scales, _ = scaled_matmul.to_scaled_matmul_operands(q)
        values = data.astype(jnp.float32).reshape(*scales.shape, 16)
        parts.append((values * scales.astype(jnp.float32)[..., None]).reshape(data.shape))
    return jnp.einsum("...mk,...nk->...mn", *parts, precision="highest")


@pytest.mark.parametrize("weight_2d", [True, False], ids=["w2d", "w1d"])
def test_scaled_matmul_backend_wiring_matches_emulated(monkeypatch, weight_2d):
    """The packed operands of all three GEMMs, checked on CPU with a stand-in for cuDNN."""
    monkeypatch.setattr(gemm, "_cudnn_product", fake_cudnn_product)
    monkeypatch.setattr(gemm, "scaled_matmul_unsupported_reason", lambda: None)
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
    moved = gemm.transpose_2d_blocks(q_nk)
    assert_same_q(moved, q_kn)
