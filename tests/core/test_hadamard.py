"""The Random Hadamard Transform against scipy, first principles and the NumPy oracle FWHT.

The transform tests run on every implementation (the `impl` fixture).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numerics_oracle as oracle
import numpy as np
import pytest
import scipy.linalg
from helpers import assert_same_bits, heavy_tailed, np_dtype

import nvfp4_jax


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64])
def test_hadamard_matrix_equals_scipy(n):
    got = np.asarray(nvfp4_jax.get_hadamard_matrix(n))
    np.testing.assert_array_equal(got, scipy.linalg.hadamard(n))


def test_hadamard16_is_sylvester_popcount():
    h = np.asarray(nvfp4_jax.get_hadamard_matrix(16))
    i = np.arange(16)
    popcount = np.array([[bin(a & b).count("1") for b in i] for a in i])
    np.testing.assert_array_equal(h, (-1.0) ** popcount)
    np.testing.assert_array_equal(h, oracle.hadamard16())


@pytest.mark.parametrize("n", [0, 3, 12, 24, -4])
def test_hadamard_matrix_rejects_non_powers_of_two(n):
    with pytest.raises(ValueError, match=str(n)):
        nvfp4_jax.get_hadamard_matrix(n)


def test_sign_vector_and_bitmask():
    signs = np.asarray(nvfp4_jax.get_wgrad_sign_vector())
    np.testing.assert_array_equal(signs, oracle.SIGN_VECTOR)
    assert nvfp4_jax.get_sign_from_vector(signs) == 0xD7E8 == 55272
    # The bitmask by definition: bit i set where sign i is -1, bit 0 least significant.
    assert sum(1 << i for i, s in enumerate(oracle.SIGN_VECTOR) if s < 0) == 0xD7E8
    assert nvfp4_jax.get_sign_from_vector([1] * 16) == 0
    assert nvfp4_jax.get_sign_from_vector([-1] + [1] * 15) == 1


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_rht_matrix(dtype):
    m = np.asarray(nvfp4_jax.get_rht_matrix(), np.float64)
    assert m.shape == (16, 16)
    np.testing.assert_array_equal(np.abs(m), 0.25)
    np.testing.assert_array_equal(m, oracle.rht_matrix())
    np.testing.assert_array_equal(m @ m.T, np.eye(16))
    # +-0.25 is exact in every supported dtype.
    np.testing.assert_array_equal(m.astype(np_dtype(dtype)).astype(np.float64), m)


RHT_SHAPES = {"k16": (16,), "m8_k64": (8, 64), "b2_m4_k32": (2, 4, 32), "r4": (2, 3, 2, 48)}


@pytest.mark.parametrize("shape_id", list(RHT_SHAPES))
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_apply_rht_matches_oracle_fwht_bits(impl, dtype, shape_id):
    shape = RHT_SHAPES[shape_id]
    x = heavy_tailed(shape, dtype, seed=len(shape_id))
    got = np.asarray(impl.apply_rht(x))
    want = oracle.fwht_rht(x)
    assert got.dtype == want.dtype == np_dtype(dtype)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_apply_rht_equals_matmul_within_rounding(impl, dtype):
    x = heavy_tailed((64, 128), dtype, seed=9, outliers=False)
    got = np.asarray(impl.apply_rht(x), np.float64)
    xm = x.astype(np.float64).reshape(-1, 16) @ oracle.rht_matrix().astype(np.float64)
    exact = xm.reshape(x.shape)
    eps = {"f32": 2.0**-23, "bf16": 2.0**-7, "f16": 2.0**-10}[dtype]
    # One rounding to the output dtype (half an ulp) plus f32 summation error of 16 terms.
    scale = np.abs(x.astype(np.float64)).reshape(-1, 16).sum(axis=1, keepdims=True) * 0.25
    tol = np.maximum(np.abs(exact), 0).reshape(-1, 16) * eps + scale * 4 * 2.0**-24
    assert np.all(np.abs(got.reshape(-1, 16) - exact.reshape(-1, 16)) <= tol)


def test_apply_rht_inverse_round_trip_f32(impl):
    x = heavy_tailed((32, 64), "f32", seed=10)
    y = impl.apply_rht(x)
    back = np.asarray(impl.apply_rht(y, inverse=True))
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-6 * float(np.max(np.abs(x))))
    # The inverse is M^T.
    inv = np.asarray(impl.apply_rht(x, inverse=True), np.float64).reshape(-1, 16)
    want = x.astype(np.float64).reshape(-1, 16) @ oracle.rht_matrix().T.astype(np.float64)
    np.testing.assert_allclose(inv, want, rtol=0, atol=1e-6 * float(np.max(np.abs(x))))


def test_apply_rht_of_basis_vectors_gives_matrix_rows(impl):
    eye = np.eye(16, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(impl.apply_rht(eye)), oracle.rht_matrix())
    eye_bf16 = eye.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(impl.apply_rht(eye_bf16)).astype(np.float32), oracle.rht_matrix()
    )


def test_apply_rht_under_jit_and_vmap(impl):
    x = jax.device_put(jnp.asarray(heavy_tailed((3, 8, 32), "bf16", seed=12)), impl.device)

    def eager(v):
        return nvfp4_jax.apply_rht(v, implementation=impl.implementation)

    expected = oracle.fwht_rht(np.asarray(x))
    assert_same_bits(eager(x), expected, "eager")
    assert_same_bits(jax.jit(eager)(x), expected, "jit")
    assert_same_bits(jax.jit(jax.vmap(eager))(x), expected, "vmap")


@pytest.mark.parametrize("shape", [(8, 24), (40,), (4, 8)], ids=["k24", "k40", "k8"])
def test_apply_rht_bad_last_dim_raises(impl, shape):
    with pytest.raises(ValueError, match=re.escape(str(shape))):
        impl.apply_rht(np.ones(shape, np.float32))


def test_apply_rht_scalar_raises(impl):
    with pytest.raises(ValueError, match="shape"):
        impl.apply_rht(np.float32(1.0))


@pytest.mark.parametrize("bad", [np.ones((4, 16), np.int32), np.ones((4, 16), np.float64)])
def test_apply_rht_bad_dtype_raises(impl, bad):
    with pytest.raises(TypeError, match=bad.dtype.name):  # the dtype before any conversion
        nvfp4_jax.apply_rht(bad, implementation=impl.implementation)


def test_apply_rht_inverse_must_be_a_bool(impl):
    with pytest.raises(TypeError, match="inverse must be a bool"):
        impl.apply_rht(np.ones((4, 16), np.float32), inverse=1)
