"""The exact native NVFP4 GEMM of the CPU (`nvfp4_gemm`, docs/NUMERICS.md section 9).

A NumPy model of the kernel's summation order (each 16-block's exact integer dot times the
two E4M3 scales, summed in f32 over the blocks in ascending order from +0, then times 0.25
and alpha) must give the kernel's bits on every ISA and thread count; against the emulated
jnp GEMM (XLA's own summation order) the results agree within the f32 summation bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DENSE, assert_same_bits, heavy_tailed

import nvfp4_jax
from nvfp4_jax import kernels
from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.training import gemm
from nvfp4_jax._src.training.dot_general import dot_general
from nvfp4_jax._src.training.recipe import NVFP4Recipe

pytestmark = pytest.mark.skipif(
    not kernels.is_available("cpu") or kernels.current_platform() != "cpu",
    reason="needs the native CPU library on a CPU platform",
)

# 2 * E2M1 of each 4-bit code.
TWICE_E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)
EPS32 = float(np.finfo(np.float32).eps)


def unpack(codes) -> np.ndarray:
    c = np.asarray(codes)
    v = np.empty((*c.shape[:-1], 2 * c.shape[-1]), np.int64)
    v[..., 0::2] = TWICE_E2M1[c & 15]
    v[..., 1::2] = TWICE_E2M1[c >> 4]
    return v


def model(a_codes, a_scales, b_codes, b_scales, alpha) -> np.ndarray:
    """The kernel's order: acc = 0; acc += (d_g * sa_g) * sb_g for g ascending; then
    (acc * 0.25) * alpha, every step in f32 (each term is exact)."""
    va, vb = unpack(a_codes), unpack(b_codes)
    m, k = va.shape
    n = vb.shape[0]
    groups = k // 16
    sa = np.asarray(a_scales).astype(np.float32)
    sb = np.asarray(b_scales).astype(np.float32)
    d = np.einsum("mgk,ngk->mng", va.reshape(m, groups, 16), vb.reshape(n, groups, 16))
    acc = np.zeros((m, n), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for g in range(groups):
            acc = acc + (d[:, :, g].astype(np.float32) * sa[:, g][:, None]) * sb[:, g][None, :]
        return (acc * np.float32(0.25)) * np.float32(alpha)


def operands(m, n, k, seed):
    x = heavy_tailed((m, k), seed=seed)
    y = heavy_tailed((n, k), seed=seed + 1)
    return nvfp4_jax.quantize(jnp.asarray(x)), nvfp4_jax.quantize(jnp.asarray(y))


def native(a, b, alpha=None):
    da, db = (a.global_scale, b.global_scale) if alpha is None else (alpha, 1.0)
    return jax.jit(kernels.gemm)(a.codes, a.scales, b.codes, b.scales, da, db)


def modelled(a, b, alpha=None):
    if alpha is None:
        alpha = np.float32(a.global_scale) * np.float32(b.global_scale)
    return model(a.codes, a.scales, b.codes, b.scales, np.float32(alpha))


# Odd M and N (no multiple of any tile: 4 or 2 rows, 32 columns, 64-row tiles), K = 16, K
# large, a single row or column.
SHAPES = [(1, 1, 16), (5, 3, 16), (37, 45, 16 * 9), (67, 97, 16 * 21), (3, 33, 4096), (130, 1, 48)]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_the_model_of_its_summation_order(m, n, k):
    a, b = operands(m, n, k, seed=m + n + k)
    assert_same_bits(native(a, b), modelled(a, b), f"{m}x{n}x{k}")


def test_zeros_and_zero_size():
    a, b = operands(7, 9, 32, seed=0)
    zero = nvfp4_jax.quantize(jnp.zeros((7, 32)))
    assert_same_bits(native(zero, b), modelled(zero, b), "zero lhs")
    assert not np.any(np.signbit(np.asarray(native(zero, b))))  # summed from +0
    empty = nvfp4_jax.quantize(jnp.zeros((0, 32)))
    assert native(empty, b).shape == (0, 9)
    assert native(a, empty).shape == (7, 0)


@pytest.mark.parametrize("alpha", [np.inf, -np.inf, np.nan, 0.0, 2.0**-100])
def test_non_finite_and_tiny_alpha_as_the_emulated_gemm(alpha):
    a, b = operands(6, 35, 64, seed=3)
    got = native(a, b, alpha)
    assert_same_bits(got, modelled(a, b, alpha), f"alpha {alpha}")
    # The emulated GEMM: the same `product * alpha` (a zero product times inf is NaN).
    emulated = gemm.matmul(
        gemm.Operand(nvfp4_jax.ops.block_values(a, jnp.float32), jnp.float32(alpha)),
        gemm.Operand(nvfp4_jax.ops.block_values(b, jnp.float32), jnp.float32(1)),
    )
    np.testing.assert_array_equal(np.isnan(got), np.isnan(emulated))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(emulated))


def test_nan_scales_poison_their_rows_and_columns():
    """A NaN scale (0x7F, the non-finite tensor's bytes) makes its whole row or column NaN."""
    a, b = operands(5, 40, 64, seed=4)
    sa = np.asarray(a.scales).view(np.uint8).copy()
    sb = np.asarray(b.scales).view(np.uint8).copy()
    sa[2, 1] = 0x7F
    sb[33, 3] = 0xFF  # the negative NaN byte
    a_codes, b_codes = a.codes, b.codes
    a_s, b_s = jnp.asarray(sa.view(jnp.float8_e4m3fn)), jnp.asarray(sb.view(jnp.float8_e4m3fn))
    got = np.asarray(kernels.gemm(a_codes, a_s, b_codes, b_s, a.global_scale, b.global_scale))
    alpha = np.float32(a.global_scale) * np.float32(b.global_scale)
    assert_same_bits(got, model(a_codes, a_s, b_codes, b_s, alpha), "NaN scales")
    assert np.isnan(got[2]).all() and np.isnan(got[:, 33]).all()
    assert np.isfinite(np.delete(np.delete(got, 2, 0), 33, 1)).all()


def test_negative_scale_bytes_decode_with_their_sign():
    a, b = operands(3, 17, 32, seed=5)
    sa = np.asarray(a.scales).view(np.uint8) | 0x80
    a_s = jnp.asarray(sa.view(jnp.float8_e4m3fn))
    got = kernels.gemm(a.codes, a_s, b.codes, b.scales, a.global_scale, b.global_scale)
    alpha = np.float32(a.global_scale) * np.float32(b.global_scale)
    assert_same_bits(got, model(a.codes, a_s, b.codes, b.scales, alpha), "signed")


# Many tiles (64 rows x 32 columns), partial ones at both edges, several parallel chunks.
ISA_SHAPE = (133, 203, 16 * 50)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_isa_and_thread_count_gives_the_same_bits(cpu_isa, threads):
    a, b = operands(*ISA_SHAPE, seed=9)
    _library.module("cpu").set_gemm_threads(threads)
    want = modelled(a, b)
    assert_same_bits(native(a, b), want, f"threads={threads}")
    # Batched (the kernel loops over the batch) and under vmap (broadcast to one call).
    batch = jax.tree.map(lambda t: jnp.stack([t, t]), (a, b))
    qa, qb = batch
    got = jax.jit(kernels.gemm)(
        qa.codes,
        qa.scales,
        qb.codes,
        qb.scales,
        jnp.stack([a.global_scale] * 2),
        jnp.stack([b.global_scale] * 2),
    )
    assert_same_bits(got, np.stack([want, want]), "batched")
    vmapped = jax.vmap(kernels.gemm, in_axes=(0, 0, None, None, 0, None))(
        qa.codes, qa.scales, b.codes, b.scales, jnp.stack([a.global_scale] * 2), b.global_scale
    )
    assert_same_bits(vmapped, np.stack([want, want]), "vmapped")


@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_path_gives_the_same_bits(threads):
    """AMX-INT8 tiles (opt-in, x86-64-v4 hosts with AMX): the same order, the same bits."""
    module = _library.module("cpu")
    if module is None or not module.set_gemm_amx(True):
        module is not None and module.set_gemm_amx(False)
        pytest.skip("this CPU, kernel or build runs no AMX-INT8")
    try:
        module.set_gemm_threads(threads)
        # Partial 16-row groups and 16-column halves, an odd block count, one row.
        for m, n, k in [ISA_SHAPE, (1, 17, 16 * 3), (16, 16, 16), (33, 40, 4096)]:
            a, b = operands(m, n, k, seed=m + k)
            assert_same_bits(native(a, b), modelled(a, b), f"amx {m}x{n}x{k}")
    finally:
        module.set_gemm_amx(False)
        module.set_gemm_threads(0)


def summation_bound(a, b) -> np.ndarray:
    """|native - emulated| <= alpha * 2 * K * eps * (|A| |B|^T): both sum K exact products."""
    va = np.abs(np.asarray(nvfp4_jax.ops.block_values(a, jnp.float32), np.float64))
    vb = np.abs(np.asarray(nvfp4_jax.ops.block_values(b, jnp.float32), np.float64))
    alpha = float(a.global_scale * b.global_scale)
    return alpha * 2 * va.shape[-1] * EPS32 * (va @ vb.T) + 1e-30


@pytest.mark.parametrize("m,n,k", [(37, 45, 16), (67, 97, 16 * 21), (3, 33, 4096)])
def test_equals_the_emulated_gemm_up_to_summation_order(m, n, k):
    a, b = operands(m, n, k, seed=k)
    got = np.asarray(gemm.scaled_matmul(a, b, backend="emulated"))  # native on the CPU
    assert_same_bits(got, modelled(a, b), "scaled_matmul runs the kernel")
    ref = gemm.Operand(nvfp4_jax.ops.block_values(a, implementation="reference"), a.global_scale)
    rhs = gemm.Operand(nvfp4_jax.ops.block_values(b, implementation="reference"), b.global_scale)
    emulated = np.asarray(gemm.matmul(ref, rhs))
    if k == 16:  # one block: an exact sum in any order, one rounding by alpha
        np.testing.assert_array_equal(got, emulated)
    assert np.all(np.abs(got - emulated) <= summation_bound(a, b))


def recipe(implementation):
    return NVFP4Recipe(implementation=implementation, gemm_backend="emulated")


def test_dot_general_fprop_runs_the_kernel_on_the_reference_operands():
    x = jnp.asarray(heavy_tailed((24, 96), seed=1))
    w = jnp.asarray(heavy_tailed((96, 80), seed=2, row_axis=0))
    y = dot_general(x, w, DENSE, recipe=recipe("ffi"))
    qx = nvfp4_jax.quantize(x, implementation="reference")
    qw = nvfp4_jax.quantize(w, axis=0, block_2d=True, implementation="reference")
    assert_same_bits(y, modelled(qx, qw), "fprop")


def test_dot_general_three_gemms_against_the_reference():
    """fprop, dgrad and wgrad: the native GEMMs (ffi) against the pure-jnp reference."""
    x = jnp.asarray(heavy_tailed((40, 64), seed=3))
    w = jnp.asarray(heavy_tailed((64, 48), seed=4, row_axis=0))
    key = jax.random.key(0)
    dy = jnp.asarray(heavy_tailed((40, 48), seed=5))  # fixed: SR sees the same dy

    def loss(x, w, implementation):
        y = dot_general(x, w, DENSE, recipe=recipe(implementation), key=key)
        return jnp.sum(y * dy), y

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (dx, dw), y = grad(x, w, "ffi")
    (dx_ref, dw_ref), y_ref = grad(x, w, "reference")
    # alpha is formed in the kernel: eager and jit give the same bits.
    assert_same_bits(dot_general(x, w, DENSE, recipe=recipe("ffi")), y, "eager = jit")
    for got, want, what in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dw")):
        got, want = np.asarray(got), np.asarray(want)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=what)
    # The batched path (vmap of the custom_vjp) runs the kernel per element alike.
    xb, wb = jnp.stack([x, 2 * x]), jnp.stack([w, w])
    dims = (((2,), (1,)), ((0,), (0,)))
    yb = dot_general(xb, wb, dims, recipe=recipe("ffi"), key=key)
    assert_same_bits(yb[0], y, "batched element 0")


BAD = [
    ("a_codes", lambda a, b: (a.codes.astype(jnp.int8), a.scales, b.codes, b.scales)),
    ("K/2", lambda a, b: (a.codes[:, :8], a.scales[:, :1], b.codes, b.scales)),
    ("a_scales", lambda a, b: (a.codes, a.scales[:, :1], b.codes, b.scales)),
    ("b_scales", lambda a, b: (a.codes, a.scales, b.codes, b.scales.astype(jnp.float32))),
    ("multiple of 8", lambda a, b: (a.codes[:, :4], a.scales[:, :1], b.codes[:, :4], b.scales)),
]


@pytest.mark.parametrize("what,make", BAD, ids=[b[0] for b in BAD])
def test_rejects_bad_operands(what, make):
    a, b = operands(4, 5, 32, seed=0)
    args = make(a, b)
    out = jax.ShapeDtypeStruct((4, 5), jnp.float32)
    call = jax.ffi.ffi_call("nvfp4_gemm", out)
    with pytest.raises(Exception, match="nvfp4_gemm") as info:
        jax.block_until_ready(call(*args, jnp.float32(1), jnp.float32(1)))
    assert "INVALID_ARGUMENT" in str(info.value)


def test_rejects_bad_decode_and_result():
    a, b = operands(4, 5, 32, seed=0)
    args = (a.codes, a.scales, b.codes, b.scales)
    with pytest.raises(Exception, match="b_decode"):
        call = jax.ffi.ffi_call("nvfp4_gemm", jax.ShapeDtypeStruct((4, 5), jnp.float32))
        jax.block_until_ready(call(*args, jnp.float32(1), jnp.ones((2,), jnp.float32)))
    with pytest.raises(Exception, match="result"):
        call = jax.ffi.ffi_call("nvfp4_gemm", jax.ShapeDtypeStruct((4, 6), jnp.float32))
        jax.block_until_ready(call(*args, jnp.float32(1), jnp.float32(1)))


def test_the_baseline_kernels_leave_the_gemm_to_xla(cpu_isa):
    # Where only the portable baseline runs (no AVX2: every non-x86 CPU), the native GEMM's
    # plain integer code is far slower than XLA's dot: the emulated backend keeps XLA's dot of
    # the block values there, decided when the function is traced. The result is the same
    # exact block products summed in f32, so it agrees with the kernel to f32 summation order.
    isa = _library.module("cpu").isa()
    assert kernels.cpu_isa() == isa
    assert gemm.uses_native_gemm("emulated", None) == (isa != "baseline")
    assert not gemm.uses_native_gemm("emulated", "reference")
    a, b = operands(37, 45, 16 * 9, seed=3)
    fn = lambda p, q: gemm.scaled_matmul(p, q, backend="emulated")  # noqa: E731
    text = jax.jit(fn).lower(a, b).as_text()
    assert ("nvfp4_gemm" in text) == (isa != "baseline"), isa
    got = np.asarray(jax.jit(fn)(a, b))
    want = modelled(a, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
