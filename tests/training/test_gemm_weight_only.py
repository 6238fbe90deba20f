"""The native weight-only (W4A16) GEMM of the CPU (`nvfp4_w4a16`, docs/NUMERICS.md section 9).

`x @ dequantize(W, x.dtype)` with the weight decoded in registers: a NumPy model of the
kernel's order (each weight element dequantize's value in x's dtype, f32 products summed in
16 slots k mod 16 in ascending k, then a fixed tree over the slots) must give its bits on
every ISA and thread count; against today's path (XLA's dot of the dequantized weight) the
results agree within the f32 summation bound; the frozen layers run it on the CPU. Sharded on
8 CPU devices (rows of x, N of the weight, K gathered) it runs on each device's shard and
gives the unsharded bits.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_bits, heavy_tailed, make_mesh, mesh_context
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax
from nvfp4_jax import kernels
from nvfp4_jax._src.core import ops
from nvfp4_jax._src.core.kernels import _gemm, _library
from nvfp4_jax._src.training import weight_only

pytestmark = pytest.mark.skipif(
    not kernels.is_available("cpu") or kernels.current_platform() != "cpu",
    reason="needs the native CPU library on a CPU platform",
)

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
EPS32 = float(np.finfo(np.float32).eps)
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def weight_values(codes, scales, decode, dtype) -> np.ndarray:
    """(N, K) f32: dequantize's `dtype(value(code) * (f32(s) * D))` of the stored weight."""
    c = np.asarray(codes)
    v = np.empty((c.shape[0], 2 * c.shape[1]), np.float32)
    v[:, 0::2] = E2M1[c & 15]
    v[:, 1::2] = E2M1[c >> 4]
    factor = np.asarray(scales).astype(np.float32) * np.float32(decode)
    with np.errstate(invalid="ignore", over="ignore"):
        w = v * np.repeat(factor, 16, axis=1)
    return w.astype(np.dtype(dtype)).astype(np.float32)


def model(x, codes, scales, decode) -> np.ndarray:
    """The kernel's order: slot k mod 16 sums x_k * w_k (an f32 product, an f32 add) over
    ascending k from +0; then s8 = a[:8] + a[8:], s4, s2, out = s2[0] + s2[1]."""
    xf = np.asarray(x).astype(np.float32)
    w = weight_values(codes, scales, decode, np.asarray(x).dtype)
    m, k = xf.shape
    acc = np.zeros((m, w.shape[0], 16), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for g in range(k // 16):
            acc = acc + xf[:, None, 16 * g : 16 * g + 16] * w[None, :, 16 * g : 16 * g + 16]
        s8 = acc[..., :8] + acc[..., 8:]
        s4 = s8[..., :4] + s8[..., 4:]
        s2 = s4[..., :2] + s4[..., 2:]
        return s2[..., 0] + s2[..., 1]


def weight(k, n, seed, **kw):
    """An (in, out) = (k, n) weight quantized along in: stored (n, k)."""
    w = heavy_tailed((k, n), seed=seed) * np.float32(k**-0.5)
    return nvfp4_jax.quantize(jnp.asarray(w), axis=0, **kw)


def activations(m, k, seed, dtype):
    return jnp.asarray(heavy_tailed((m, k), seed=seed)).astype(dtype)


def native(x, q):
    return jax.jit(_gemm.weight_only_matmul)(x, q.codes, q.scales, q.global_scale)


def modelled(x, q):
    return model(x, q.codes, q.scales, np.float32(q.global_scale))


SHAPES = [(1, 1, 16), (1, 37, 160), (3, 45, 16 * 9), (8, 33, 4096), (13, 100, 256), (21, 7, 48)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_the_model_of_its_summation_order(m, n, k, dtype):
    q, x = weight(k, n, seed=m + n), activations(m, k, seed=k, dtype=DTYPES[dtype])
    assert_same_bits(native(x, q), modelled(x, q), f"{m}x{n}x{k} {dtype}")


def test_an_imported_decode_scale_and_2d_blocks():
    q = weight(64, 48, seed=1, block_2d=True)
    q = dataclasses.replace(q, decode_scale=jnp.float32(q.global_scale) * np.float32(1 + 2**-20))
    x = activations(2, 64, seed=2, dtype=jnp.bfloat16)
    assert_same_bits(native(x, q), modelled(x, q), "decode_scale")


def test_zero_rows_and_one_row():
    q = weight(32, 9, seed=3)
    assert native(jnp.zeros((0, 32), jnp.bfloat16), q).shape == (0, 9)
    x = activations(1, 32, seed=4, dtype=jnp.bfloat16)
    assert_same_bits(native(x, q), modelled(x, q), "M=1")
    zero = native(jnp.zeros((1, 32), jnp.bfloat16), q)
    assert not np.any(np.signbit(np.asarray(zero)))  # summed from +0


def test_non_finite_activations():
    q = weight(64, 20, seed=5)
    x = np.array(activations(4, 64, seed=6, dtype=jnp.float32))
    x[1, 3], x[2, 40], x[3, 0], x[3, 17] = np.nan, np.inf, np.inf, -np.inf
    x = jnp.asarray(x).astype(jnp.bfloat16)
    got = np.asarray(native(x, q))
    assert_same_bits(got, modelled(x, q), "non-finite x")
    assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()
    today = jnp.matmul(x, ops.dequantize(q, jnp.bfloat16), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(today))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(today))


def test_a_nan_scale_poisons_its_column():
    q = weight(64, 20, seed=7)
    s = np.asarray(q.scales).view(np.uint8).copy()
    s[5, 2] = 0x7F
    scales = jnp.asarray(s.view(jnp.float8_e4m3fn))
    x = activations(3, 64, seed=8, dtype=jnp.bfloat16)
    got = np.asarray(_gemm.weight_only_matmul(x, q.codes, scales, q.global_scale))
    assert_same_bits(got, model(x, q.codes, scales, np.float32(q.global_scale)), "NaN scale")
    assert np.isnan(got[:, 5]).all() and np.isfinite(np.delete(got, 5, 1)).all()


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_within_the_summation_bound_of_todays_path(dtype):
    """|native - XLA| <= 2 K eps32 sum_k |x_k w_k|: both sum the same exact products in f32."""
    m, n, k = 5, 300, 16 * 37
    q, x = weight(k, n, seed=9), activations(m, k, seed=10, dtype=DTYPES[dtype])
    w = ops.dequantize(q, DTYPES[dtype])
    today = np.asarray(jnp.matmul(x, w, preferred_element_type=jnp.float32))
    got = np.asarray(native(x, q))
    scale = np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(w, np.float32))
    assert np.all(np.abs(got - today) <= 2 * k * EPS32 * scale)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_same_bits_on_every_isa_and_thread_count(cpu_isa, threads, dtype):
    _library.module("cpu").set_gemm_threads(threads)
    m, n, k = 11, 203, 16 * 50
    q, x = weight(k, n, seed=13), activations(m, k, seed=14, dtype=DTYPES[dtype])
    # Not jitted: a fresh call on the forced ISA (the kernel is picked at run time anyway).
    got = _gemm.weight_only_matmul(x, q.codes, q.scales, q.global_scale)
    assert_same_bits(got, modelled(x, q), f"threads={threads} {dtype}")


def test_batch_dims_broadcast_and_vmap():
    q = weight(48, 24, seed=15)
    xs = activations(6, 48, seed=16, dtype=jnp.bfloat16).reshape(3, 2, 48)
    got = jax.vmap(lambda x: _gemm.weight_only_matmul(x, q.codes, q.scales, q.global_scale))(xs)
    for b in range(3):
        assert_same_bits(got[b], modelled(xs[b], q), f"vmap x {b}")
    qs = [weight(48, 24, seed=17 + b) for b in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *qs)
    x = activations(2, 48, seed=20, dtype=jnp.bfloat16)
    got = jax.vmap(lambda c, s, d: _gemm.weight_only_matmul(x, c, s, d))(
        stacked.codes, stacked.scales, stacked.global_scale
    )
    for b in range(2):
        assert_same_bits(got[b], modelled(x, qs[b]), f"vmap W {b}")


def test_bad_operands_are_named():
    q = weight(32, 8, seed=21)
    x = activations(2, 32, seed=22, dtype=jnp.bfloat16)
    call = jax.ffi.ffi_call("nvfp4_w4a16", jax.ShapeDtypeStruct((2, 8), jnp.float32))
    d = jnp.float32(q.global_scale)
    cases = [
        ((x.astype(jnp.int32), q.codes, q.scales, d), "x of shape (2, 32) and dtype s32"),
        ((x[:, :24], q.codes, q.scales, d), "x of shape (2, 24)"),
        ((x, q.codes[:, :8], q.scales, d), "codes of shape (8, 8)"),
        ((x, q.codes, q.scales.view(jnp.uint8), d), "scales of shape (8, 2) and dtype u8"),
        ((x, q.codes, q.scales[:4], d), "scales of shape (4, 2)"),
        ((x, q.codes, q.scales, jnp.ones((2,), jnp.float32)), "decode of shape (2,)"),
    ]
    for args, message in cases:
        with pytest.raises(Exception, match=rf"nvfp4_w4a16: {__import__('re').escape(message)}"):
            jax.block_until_ready(call(*args))
    bad_out = jax.ffi.ffi_call("nvfp4_w4a16", jax.ShapeDtypeStruct((2, 9), jnp.float32))
    with pytest.raises(Exception, match="nvfp4_w4a16: result of shape"):
        jax.block_until_ready(bad_out(x, q.codes, q.scales, d))


# --- the frozen layers -------------------------------------------------------------------------


@pytest.fixture
def spy(monkeypatch):
    calls = []
    original = weight_only.native_weight_only_matmul

    def counting(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(weight_only, "native_weight_only_matmul", counting)
    return calls


def expected_layer_output(x, q, out_dtype):
    y = model(np.asarray(x).reshape(-1, x.shape[-1]), q.codes, q.scales, np.float32(q.global_scale))
    return jnp.asarray(y.reshape(*x.shape[:-1], -1)).astype(out_dtype)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_nnx_linear_from_quantized_runs_the_native_kernel(spy, dtype):
    q = weight(64, 48, seed=23)
    layer = nvfp4_jax.nnx.Linear.from_quantized(q, dtype=DTYPES[dtype])
    x = activations(6, 64, seed=24, dtype=jnp.float32).reshape(2, 3, 64)
    y = layer(x)
    assert spy == [(6, 64)]
    assert_same_bits(y, expected_layer_output(x.astype(DTYPES[dtype]), q, DTYPES[dtype]))
    assert_same_bits(nnx.jit(lambda m, v: m(v))(layer, x), y, "jit")
    # W4A4: the fake-quantized activations through the same kernel.
    w4a4 = nvfp4_jax.nnx.Linear.from_quantized(
        q, input_scale=jnp.float32(0.01), activations="nvfp4", dtype=DTYPES[dtype]
    )
    x_q = ops.fake_quantize_with_data_amax(
        x.astype(DTYPES[dtype]), jnp.float32(0.01) * 2688, dtype=DTYPES[dtype]
    )
    assert_same_bits(w4a4(x), expected_layer_output(x_q, q, DTYPES[dtype]), "W4A4")


def test_linen_dense_with_an_nvfp4_kernel_runs_the_native_kernel(spy):
    q = weight(64, 32, seed=25)
    x = activations(4, 64, seed=26, dtype=jnp.bfloat16)
    frozen = {"params": {"kernel": q, "bias": jnp.zeros(32, jnp.bfloat16)}}
    y = nvfp4_jax.linen.Dense(32).apply(frozen, x)
    assert spy == [(4, 64)]
    assert_same_bits(y, expected_layer_output(x, q, jnp.bfloat16))


def test_the_xla_path_where_the_kernel_does_not_apply(spy):
    q = weight(64, 32, seed=27)
    layer = nvfp4_jax.nnx.Linear.from_quantized(q, dtype=jnp.bfloat16)
    many = activations(weight_only.WEIGHT_ONLY_MAX_ROWS + 1, 64, seed=28, dtype=jnp.bfloat16)
    assert_same_bits(layer(many), jnp.matmul(many, ops.dequantize(q, jnp.bfloat16)), "many rows")
    f32 = nvfp4_jax.nnx.Linear.from_quantized(q, dtype=jnp.float32)
    x = activations(2, 64, seed=29, dtype=jnp.float32)
    assert_same_bits(f32(x), jnp.matmul(x, ops.dequantize(q, jnp.float32)), "f32 activations")
    ref = weight_only.weight_only_matmul(x.astype(jnp.bfloat16), q, implementation="reference")
    assert_same_bits(ref, jnp.matmul(x.astype(jnp.bfloat16), ops.dequantize(q, jnp.bfloat16)))
    assert spy == []


def test_an_imported_checkpoint_layer_runs_the_native_kernel(spy):
    """A ModelOpt-style weight (its own decode scale, as load_hf_checkpoint gives it)."""
    q = weight(64, 32, seed=30)
    imported = dataclasses.replace(
        q, decode_scale=jnp.float32(float(q.global_scale) * (1 + 2**-20))
    )
    layer = nvfp4_jax.nnx.Linear.from_quantized(imported, dtype=jnp.bfloat16)
    x = activations(1, 64, seed=31, dtype=jnp.bfloat16)
    assert_same_bits(layer(x), expected_layer_output(x, imported, jnp.bfloat16))
    assert spy == [(1, 64)]


def test_bf16_weights_round_as_dequantize_does():
    """Each weight element is dequantize's bf16 value: the model's weights are those bits."""
    q = weight(32, 16, seed=32)
    w = weight_values(q.codes, q.scales, np.float32(q.global_scale), ml_dtypes.bfloat16)
    assert_same_bits(w.T, np.asarray(ops.dequantize(q, jnp.bfloat16), np.float32), "weights")


# --- sharded: the kernel on each device's shard, the unsharded bits ----------------------------

needs_8_devices = pytest.mark.skipif(jax.device_count("cpu") < 8, reason="needs 8 CPU devices")
B, M, N, K = 4, 8, 64, 256  # the unsharded problem of every layout below


def mesh(mode: str = "auto"):
    """2 x 4: "data" for the rows of x, "model" for the weight's N (tensor parallelism)."""
    return make_mesh((2, 4), ("data", "model"), mode)


def put(a, spec, mode: str = "auto"):
    return jax.device_put(a, NamedSharding(mesh(mode), spec))


def batched_weight(batch, seed):
    """codes (batch, N, K/2), scales (batch, N, K/16), decode (batch,) of `batch` weights."""
    qs = [weight(K, N, seed=seed + b) for b in range(batch)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *qs)
    return stack.codes, stack.scales, jnp.stack([jnp.float32(q.global_scale) for q in qs])


# name -> (x's batch, the weight's batch (None: 2-D operands), x's spec, the weight's spec (its
# codes and scales), the result's spec (None: either operand may keep the axis), all-gathers)
SHARDED_CASES = {
    "rows": (None, None, P("data"), P(), P("data", None), 0),
    "n": (None, None, P(), P("model"), P(None, "model"), 0),
    "rows_and_n": (None, None, P("data"), P("model"), P("data", "model"), 0),
    "rows_on_both_axes": (None, None, P(("data", "model")), P(), P(("data", "model")), 0),
    "rows_and_n_on_one_axis": (None, None, P("model"), P("model"), None, 1),
    "k_of_x": (None, None, P(None, "model"), P(), P(), 1),
    "k_of_the_weight": (None, None, P(), P(None, "model"), P(), 2),  # codes and scales
    "n_and_k_of_both": (None, None, P(None, "data"), P("model", "data"), P(None, "model"), 3),
    "batch_rows_and_n": (B, B, P("data"), P("data", "model"), P("data", None, "model"), 0),
    "batch_m": (B, B, P(None, "data"), P(), P(None, "data", None), 0),
    "batch_of_the_weight_x_broadcast": (1, B, P(None, "data"), P("model"), P("model", "data"), 0),
    "batch_of_x_weight_broadcast": (B, 1, P("data"), P(None, "model"), P("data", None, "model"), 0),
}


def sharded_operands(case):
    x_batch, w_batch, _, _, _, _ = SHARDED_CASES[case]
    x = activations((x_batch or 1) * M, K, seed=40, dtype=jnp.bfloat16)
    if w_batch is None:
        q = weight(K, N, seed=41)
        return x, q.codes, q.scales, jnp.float32(q.global_scale)
    return (x.reshape(x_batch, M, K), *batched_weight(w_batch, seed=42))


def call_operand_shapes(hlo: str) -> list[str]:
    """The operand shapes of the (one) `nvfp4_w4a16` custom call in compiled HLO text."""
    calls = [line for line in hlo.splitlines() if 'custom_call_target="nvfp4_w4a16"' in line]
    assert len(calls) == 1, calls
    return re.findall(r"\w+\[[\d,]*\]", calls[0].split("operand_layout_constraints=")[1])


@pytest.mark.slow
@needs_8_devices
@pytest.mark.parametrize("mode", ["auto", "explicit"])
@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_sharded_equals_unsharded(case, mode):
    _, _, x_spec, w_spec, out_spec, gathers = SHARDED_CASES[case]
    x, codes, scales, decode = sharded_operands(case)
    expected = jax.jit(_gemm.weight_only_matmul)(x, codes, scales, decode)  # one device
    args = (put(x, x_spec, mode), put(codes, w_spec, mode), put(scales, w_spec, mode), decode)
    fn = jax.jit(_gemm.weight_only_matmul)
    with mesh_context(mesh(mode), mode):
        got = fn(*args)
        hlo = fn.lower(*args).compile().as_text()
    assert_same_bits(got, expected, case)
    if out_spec is not None:
        want = NamedSharding(mesh(mode), out_spec)
        assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)
    assert len(re.findall(r"\ball-gather\(", hlo)) == gathers, hlo
    # The kernel sees each device's shard: x's rows and the weight's N as the result has them.
    local = got.addressable_shards[0].data.shape
    x_shape, codes_shape, *_ = call_operand_shapes(hlo)
    assert codes_shape.startswith("u8[") and x_shape.startswith("bf16["), (x_shape, codes_shape)
    assert x_shape.endswith(f"{local[-2]},{K}]") and codes_shape.endswith(f"{local[-1]},{K // 2}]")


@needs_8_devices
def test_the_n_sharded_weight_is_never_gathered():
    """Tensor parallelism: each device decodes its N/4 rows of the weight, nothing moves."""
    x, codes, scales, decode = sharded_operands("n")
    args = (put(x, P()), put(codes, P("model")), put(scales, P("model")), decode)
    hlo = jax.jit(_gemm.weight_only_matmul).lower(*args).compile().as_text()
    assert call_operand_shapes(hlo)[1:3] == [
        f"u8[{N // 4},{K // 2}]",
        f"f8e4m3fn[{N // 4},{K // 16}]",
    ]
    collectives = ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute(")
    assert not [line for line in hlo.splitlines() if any(c in line for c in collectives)]


@needs_8_devices
def test_vmap_under_a_mesh():
    q = weight(K, N, seed=43)
    xs = activations(B * M, K, seed=44, dtype=jnp.float16).reshape(B, M, K)
    fn = jax.jit(jax.vmap(lambda x: _gemm.weight_only_matmul(x, q.codes, q.scales, q.global_scale)))
    got = fn(put(xs, P("data")))
    for b in range(B):
        assert_same_bits(got[b], modelled(xs[b], q), f"vmap {b}")


def tensor_parallel(q):
    """`q` with its kernel sharded over the output features: the stored rows (N)."""
    tp = P("model", None)
    return dataclasses.replace(q, codes=put(q.codes, tp), scales=put(q.scales, tp))


@needs_8_devices
def test_weight_only_matmul_and_a_frozen_layer_with_a_sharded_kernel(spy):
    q = weight(K, N, seed=45)
    x = activations(2 * 12, K, seed=46, dtype=jnp.bfloat16).reshape(2, 12, K)  # 24 rows
    expected = expected_layer_output(x, q, jnp.bfloat16)
    x_rows, kernel = put(x, P("data")), tensor_parallel(q)
    matmul = jax.jit(weight_only.weight_only_matmul)
    got = matmul(x_rows, kernel)
    assert spy == [(24, K)]  # the native kernel
    assert_same_bits(got, expected, "weight_only_matmul")
    want = NamedSharding(mesh(), P("data", None, "model"))
    assert got.sharding.is_equivalent_to(want, 3), got.sharding
    assert "all-gather(" not in matmul.lower(x_rows, kernel).compile().as_text()
    layer = nvfp4_jax.nnx.Linear.from_quantized(kernel, dtype=jnp.bfloat16)
    spy.clear()
    y = nnx.jit(lambda m, v: m(v))(layer, x_rows)
    assert spy == [(24, K)]
    assert_same_bits(y, expected, "nnx.Linear.from_quantized")
    assert y.sharding.is_equivalent_to(want, 3), y.sharding


# --- frozen experts: weight_only_ragged_dot and Experts.from_quantized -----------------------


def _stacked_experts(g, k, n, seed):
    w = heavy_tailed((g, k, n), seed=seed)
    per_expert = [nvfp4_jax.quantize(jnp.asarray(w[e]), axis=0) for e in range(g)]
    return jax.tree.map(lambda *x: jnp.stack(x), *per_expert)


@pytest.mark.parametrize("implementation", ["ffi", "reference"])
@pytest.mark.parametrize("rows", [1, 7, 40])  # decode sizes (native on the CPU) and prefill
def test_ragged_weight_only_rows_are_their_experts_products(implementation, rows):
    if implementation == "ffi" and not kernels.is_available():
        pytest.skip("the native library is not available here")
    g, k, n = 4, 64, 48
    q = _stacked_experts(g, k, n, seed=11)
    x = jnp.asarray(heavy_tailed((rows, k), seed=12), jnp.bfloat16)
    sizes = np.array([rows // 3, 0, rows - rows // 3 - 1, 0][:g], np.int32)  # one row past
    fn = jax.jit(
        lambda x, q, s: weight_only.weight_only_ragged_dot(x, q, s, implementation=implementation)
    )
    got = np.asarray(fn(x, q, jnp.asarray(sizes)))
    assert got.dtype == np.dtype(jnp.bfloat16)
    native = implementation == "ffi" and rows <= weight_only.WEIGHT_ONLY_MAX_ROWS
    text = fn.lower(x, q, jnp.asarray(sizes)).as_text()
    assert ("nvfp4_w4a16" in text) == native, text.count("nvfp4_w4a16")
    start = 0
    for e, size in enumerate(sizes):
        if size:
            # Each row is bit for bit its expert's weight_only_matmul (native: its own sum).
            want = weight_only.weight_only_matmul(
                x[start : start + size],
                weight_only.expert_weight(q, e),
                implementation=implementation,
            )
            if not native:
                dense = ops.dequantize(weight_only.expert_weight(q, e), jnp.bfloat16)
                want = jax.lax.ragged_dot(
                    x[start : start + size], dense[None], jnp.asarray([size], jnp.int32)
                )
            assert_same_bits(got[start : start + size], np.asarray(want), f"expert {e}")
        start += size
    np.testing.assert_array_equal(got[start:].astype(np.float32), 0)  # past the groups


def test_frozen_experts_layer():
    g, k, n = 3, 32, 16
    q = _stacked_experts(g, k, n, seed=13)
    layer = nvfp4_jax.nnx.Experts.from_quantized(q)
    assert isinstance(layer.kernel, nvfp4_jax.nnx.QuantizedKernel)
    assert not jax.tree.leaves(nnx.state(layer, nnx.Param))  # nothing to train
    x = jnp.asarray(heavy_tailed((6, k), seed=14), jnp.float32)
    sizes = jnp.asarray([2, 3, 1], jnp.int32)
    want = weight_only.weight_only_ragged_dot(x.astype(jnp.bfloat16), q, sizes)
    assert_same_bits(layer(x, sizes), want, "ragged")
    # Dropping layout (G, capacity, in): each expert's weight_only_matmul.
    batched = jnp.asarray(heavy_tailed((g, 5, k), seed=15), jnp.bfloat16)
    got = layer(batched)
    for e in range(g):
        assert_same_bits(
            got[e], weight_only.weight_only_matmul(batched[e], weight_only.expert_weight(q, e))
        )
    # Bad kernels are refused by name.
    with pytest.raises(ValueError, match=r"\(G, in, out\) NVFP4Array quantized along axis 1"):
        nvfp4_jax.nnx.Experts.from_quantized(weight_only.expert_weight(q, 0))
    along_out = jax.tree.map(
        lambda *x: jnp.stack(x),
        *[nvfp4_jax.quantize(jnp.ones((k, n)), axis=1) for _ in range(g)],
    )
    with pytest.raises(ValueError, match="quantized along axis 1"):
        nvfp4_jax.nnx.Experts.from_quantized(along_out)
    with pytest.raises(ValueError, match=r"amax of shape \(2,\) does not fit"):
        nvfp4_jax.nnx.Experts.from_quantized(dataclasses.replace(q, amax=jnp.ones((2,))))
    with pytest.raises(TypeError):
        nvfp4_jax.nnx.Experts.from_quantized(jnp.ones((g, k, n)))
    # Bad calls name what is wrong.
    with pytest.raises(ValueError, match=r"group_sizes must be \(3,\) integers.*shape \(2,\)"):
        layer(x, jnp.asarray([2, 3], jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes must be \(3,\) integers.*float32"):
        layer(x, jnp.asarray([2.0, 3.0, 1.0]))
    with pytest.raises(ValueError, match=r"x must be \(tokens, 32\).*\(2, 6, 32\)"):
        weight_only.weight_only_ragged_dot(jnp.ones((2, 6, k), jnp.bfloat16), q, sizes)
