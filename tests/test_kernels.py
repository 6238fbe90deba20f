"""The native FFI kernels against the pure-jnp reference, bit for bit.

Every comparison runs the public API twice, `implementation="ffi"` and `"reference"`, on the
same inputs and compares raw bits (codes, scale bytes, amax, values). NaN outputs compare
as NaN (payload bits are not part of the contract).
"""

from __future__ import annotations

import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import heavy_tailed, np_dtype, with_underflow_block
from jax.extend.random import threefry_2x32

import nvfp4_jax
from nvfp4_jax import kernels

pytestmark = pytest.mark.skipif(
    not kernels.is_available("cpu"),
    reason=f"native CPU kernels not built: {kernels.unavailable_reason('cpu')}",
)

CPU = jax.devices("cpu")[0]
KEY = jax.random.key(7)


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if actual.dtype.kind == "f" or actual.dtype.itemsize > 1 and actual.dtype != np.uint8:
        nan = np.isnan(actual.astype(np.float32))
        np.testing.assert_array_equal(nan, np.isnan(expected.astype(np.float32)), what)
        actual, expected = np.where(nan, 0, actual), np.where(nan, 0, expected)
    mismatch = np.flatnonzero(bits(actual).ravel() != bits(expected).ravel())
    assert mismatch.size == 0, f"{what}: {mismatch.size} differ, first at {mismatch[:5]}"


def assert_same_q(q_ffi, q_ref):
    assert_same(q_ffi.codes, q_ref.codes, "codes")
    assert_same(q_ffi.scales, q_ref.scales, "scales")
    assert_same(q_ffi.amax, q_ref.amax, "amax")


@functools.cache
def _jitted(op: str, impl: str, static: tuple):
    fn = getattr(nvfp4_jax, op)
    kw = dict(static)
    if op in ("quantize", "fake_quantize"):
        return jax.jit(lambda x, key, amax: fn(x, key=key, amax=amax, implementation=impl, **kw))
    if op == "dequantize":
        return jax.jit(lambda q: fn(q, kw["dtype"], implementation=impl))
    return jax.jit(lambda x: fn(x, implementation=impl, **kw))


def run(op, impl, *args, **static):
    return _jitted(op, impl, tuple(sorted(static.items())))(*args)


def both(op, *args, **static):
    return run(op, "ffi", *args, **static), run(op, "reference", *args, **static)


def case_id(dtype, block_2d, rht, sr, shape):
    dims = "_".join(f"{c}{n}" for c, n in zip("bmk"[-len(shape) :], shape, strict=True))
    flags = f"{'2d' if block_2d else '1d'}_{'rht' if rht else 'plain'}_{'sr' if sr else 'rn'}"
    return f"{dtype}_{flags}_{dims}"


def matrix():
    """Every dtype x blocks x RHT x rounding combination, the shapes taking turns."""
    combos = itertools.product(("bf16", "f16", "f32"), (False, True), (False, True), (False, True))
    for i, (dtype, block_2d, rht, sr) in enumerate(combos):
        shape = [(16, 16), (48, 64) if block_2d else (33, 64), (3, 32, 48)][i % 3]
        yield pytest.param(
            dtype, block_2d, rht, sr, shape, id=case_id(dtype, block_2d, rht, sr, shape)
        )


@functools.cache
def _quantize_and_fake(impl: str, static: tuple):
    """quantize and fake_quantize (in f32) under one jit: one compilation per case."""
    kw = dict(static)

    def fn(x, key):
        q = nvfp4_jax.quantize(x, key=key, implementation=impl, **kw)
        fake = nvfp4_jax.fake_quantize(x, key=key, dtype=jnp.float32, implementation=impl, **kw)
        return q.codes, q.scales, q.amax, fake

    return jax.jit(fn)


@pytest.mark.parametrize("dtype,block_2d,rht,sr,shape", list(matrix()))
def test_quantize_and_fake_quantize_bits(dtype, block_2d, rht, sr, shape):
    x = heavy_tailed(shape, dtype, seed=sum(shape))
    if shape[-1] >= 32:
        x = with_underflow_block(x, row=1, block=1)
    static = tuple(sorted(dict(block_2d=block_2d, rht=rht, stochastic_rounding=sr).items()))
    ffi = _quantize_and_fake("ffi", static)(x, KEY)
    ref = _quantize_and_fake("reference", static)(x, KEY)
    for a, b, what in zip(ffi, ref, ("codes", "scales", "amax", "fake_quantize"), strict=True):
        assert_same(a, b, what)


@pytest.mark.parametrize("out", ["bf16", "f16"])
def test_fake_quantize_output_dtypes(out):
    x = heavy_tailed((32, 64), "f32", seed=6)
    fake = both("fake_quantize", x, KEY, None, dtype=np_dtype(out), rht=True)
    assert_same(*fake, f"fake_quantize -> {out}")


@pytest.fixture(params=["baseline", "x86-64-v3", "x86-64-v4"])
def cpu_isa(request):
    """Runs the CPU kernels built for one x86 level (each level is a separate build)."""
    from nvfp4_jax import _nvfp4_cpu  # noqa: PLC0415

    if not hasattr(_nvfp4_cpu, "set_isa") or not _nvfp4_cpu.set_isa(request.param):
        pytest.skip(f"this build or CPU has no {request.param} kernels")
    yield request.param
    _nvfp4_cpu.set_isa("")


@pytest.mark.parametrize(
    "dtype,block_2d,rht,sr",
    [("bf16", False, True, True), ("f16", True, True, False), ("f32", False, False, True)],
    ids=["bf16_1d_rht_sr", "f16_2d_rht_rn", "f32_1d_plain_sr"],
)
def test_every_cpu_variant_bits(cpu_isa, dtype, block_2d, rht, sr):
    x = heavy_tailed((48, 64), dtype, seed=12)
    static = tuple(sorted(dict(block_2d=block_2d, rht=rht, stochastic_rounding=sr).items()))
    ffi = _quantize_and_fake("ffi", static)(x, KEY)
    ref = _quantize_and_fake("reference", static)(x, KEY)
    for a, b, what in zip(ffi, ref, ("codes", "scales", "amax", "fake_quantize"), strict=True):
        assert_same(a, b, f"{cpu_isa} {what}")
    q = run("quantize", "reference", x, None, None, rht=rht)
    assert_same(*both("dequantize", q, dtype=np_dtype(dtype)), f"{cpu_isa} dequantize")
    assert_same(*both("apply_rht", x, inverse=rht), f"{cpu_isa} rht")


@pytest.mark.parametrize("global_scale", [True, False], ids=["global", "no_global"])
def test_fake_quantize_global_scale(global_scale):
    x = heavy_tailed((32, 64), "bf16", seed=3)
    assert_same(*both("fake_quantize", x, KEY, None, global_scale=global_scale), "values")


@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_dequantize_bits(dtype, rht):
    x = heavy_tailed((2, 33, 64), dtype, seed=5)
    q = run("quantize", "reference", x, None, None, rht=rht)
    out = np_dtype(dtype)
    assert_same(*both("dequantize", q, dtype=out), "dequantize")


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_rht_bits(dtype, inverse):
    x = heavy_tailed((5, 3, 96), dtype, seed=9)
    assert_same(*both("apply_rht", x, inverse=inverse), "rht")


def test_axis0_and_3d_round_trip():
    x = heavy_tailed((64, 3, 32), "bf16", seed=11, row_axis=0)
    for axis in (0, 1):
        if x.shape[axis] % 16:
            continue
        ffi, ref = both("quantize", x, KEY, None, axis=axis, rht=True, stochastic_rounding=True)
        assert_same_q(ffi, ref)
        assert_same(*both("dequantize", ref, dtype=jnp.bfloat16), f"dequantize axis={axis}")


def ties_block() -> np.ndarray:
    """One block whose amax is 6 and whose other values sit on every E2M1 rounding tie."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5]
    return np.array(ties + [-5.0, -0.0], np.float32)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_exact_ties_and_caller_amax(dtype):
    # A = 2688 makes S_enc = 1 and this block's scale 1: y = x lands exactly on the ties.
    x = np.stack([ties_block(), ties_block() * 0.5, -ties_block()]).astype(np_dtype(dtype))
    amax = jnp.float32(2688.0)
    ffi, ref = both("quantize", x, None, amax)
    assert_same_q(ffi, ref)
    # Values above a small caller amax saturate identically.
    assert_same_q(*both("quantize", x, None, jnp.float32(1.5)))


@pytest.mark.parametrize("sr", [False, True], ids=["rn", "sr"])
def test_all_zeros(sr):
    x = np.zeros((16, 32), np.float32)
    ffi, ref = both("quantize", x, KEY, None, stochastic_rounding=sr)
    assert_same_q(ffi, ref)
    assert float(ffi.amax) == 0.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
def test_non_finite_gives_nan_amax(bad, block_2d):
    x = heavy_tailed((32, 64), "f32", seed=2)
    x[17, 40] = bad
    for rht in (False, True):
        q = run("quantize", "ffi", x, None, None, block_2d=block_2d, rht=rht)
        assert np.isnan(q.amax)
        assert np.all(np.isnan(run("dequantize", "ffi", q, dtype=jnp.float32)))
        fake = run("fake_quantize", "ffi", x, None, None, block_2d=block_2d, rht=rht)
        assert np.all(np.isnan(fake))
        # A finite caller amax still stores NaN: the input was not finite.
        q = run("quantize", "ffi", x, None, jnp.float32(3.0), block_2d=block_2d, rht=rht)
        assert np.isnan(q.amax)
    assert np.isnan(nvfp4_jax.tensor_amax(x, implementation="ffi"))


def test_custom_call_in_compiled_hlo():
    x = jnp.asarray(heavy_tailed((32, 64), "bf16"))
    hlo = {
        "nvfp4_amax": lambda x: nvfp4_jax.tensor_amax(x, implementation="ffi"),
        "nvfp4_quantize": lambda x: nvfp4_jax.quantize(x, implementation="ffi").codes,
        "nvfp4_fake_quantize": lambda x: nvfp4_jax.fake_quantize(x, implementation="ffi"),
        "nvfp4_rht": lambda x: nvfp4_jax.apply_rht(x, implementation="ffi"),
    }
    for target, fn in hlo.items():
        text = jax.jit(fn).lower(x).compile().as_text()
        assert f'custom_call_target="{target}"' in text, target
    q = nvfp4_jax.quantize(x, implementation="reference")
    text = jax.jit(lambda q: nvfp4_jax.dequantize(q, implementation="ffi")).lower(q)
    assert 'custom_call_target="nvfp4_dequantize"' in text.compile().as_text()


def test_vmap_matches_reference():
    xs = jnp.asarray(heavy_tailed((3, 32, 64), "bf16", seed=4))
    keys = jax.random.split(KEY, 3)

    def quantize(impl):
        def one(x, key):
            q = nvfp4_jax.quantize(
                x, rht=True, stochastic_rounding=True, key=key, implementation=impl
            )
            return q.codes, q.scales, q.amax

        return jax.jit(jax.vmap(one))(xs, keys)

    for a, b, what in zip(
        quantize("ffi"), quantize("reference"), ("codes", "scales", "amax"), strict=True
    ):
        assert_same(a, b, f"vmap {what}")
    rht = jax.vmap(lambda x: nvfp4_jax.apply_rht(x, implementation="ffi"))(xs)
    assert_same(rht, nvfp4_jax.apply_rht(xs, implementation="reference"), "vmap rht")


def test_same_key_same_bits_other_key_differs():
    x = jnp.asarray(heavy_tailed((32, 64), "f32", seed=8))
    a = run("quantize", "ffi", x, KEY, None, stochastic_rounding=True)
    b = run("quantize", "ffi", x, KEY, None, stochastic_rounding=True)
    c = run("quantize", "ffi", x, jax.random.key(8), None, stochastic_rounding=True)
    assert_same(a.codes, b.codes, "same key")
    assert not np.array_equal(np.asarray(a.codes), np.asarray(c.codes))


@pytest.mark.parametrize("fake", [False, True], ids=["quantize", "fake_quantize"])
@pytest.mark.parametrize("offset_rows", [3, 16])
def test_sr_offset_matches_tail_of_full_quantization(fake, offset_rows):
    # Rows [r0:] quantized with the SR element offset r0 * C are the tail of the whole tensor.
    x = jnp.asarray(heavy_tailed((48, 64), "bf16", seed=9))
    r0 = offset_rows
    amax = nvfp4_jax.tensor_amax(x, implementation="reference")
    op = nvfp4_jax.fake_quantize if fake else nvfp4_jax.quantize

    def go(impl, x, offset):
        return op(
            x, stochastic_rounding=True, key=KEY, amax=amax, implementation=impl, _sr_offset=offset
        )

    full = go("reference", x, 0)
    for impl in ("ffi", "reference"):
        for offset in (r0 * 64, jnp.uint32(r0 * 64)):  # static and traced offsets
            tail = jax.jit(functools.partial(go, impl))(x[r0:], offset)
            if fake:
                assert_same(tail, full[r0:], f"{impl} fake values")
            else:
                assert_same(tail.codes, full.codes[r0:], f"{impl} codes")
                assert_same(tail.scales, full.scales[r0:], f"{impl} scales")


def test_sr_offset_carries_into_the_high_counter_word():
    # Counters cross 2**32 inside the tensor: the kernel and the reference must both carry.
    x = jnp.asarray(heavy_tailed((4, 64), "f32", seed=10))
    offset = 2**35 - 64  # counter 2**32 - 8: the last 8 counters wrap the low word
    # The reference's counters, checked against explicit 64-bit counters j = offset / 8 + i.
    quantize_module = sys.modules["nvfp4_jax.quantize"]

    words = quantize_module.key_words(KEY)
    j = np.arange(16, dtype=np.uint64) + np.uint64(offset // 8)
    hi, lo = (j >> np.uint64(32)).astype(np.uint32), (j & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    w = np.asarray(threefry_2x32((words[0], words[1]), jnp.asarray(np.concatenate([hi, lo]))))
    w64 = w[:16].astype(np.uint64) | w[16:].astype(np.uint64) << np.uint64(32)
    expected = w64.view(np.uint8)  # little endian: byte n % 8 of counter n // 8
    got = quantize_module.random_bytes(words, 128, offset)
    np.testing.assert_array_equal(np.asarray(got), expected)
    q = {
        impl: nvfp4_jax.quantize(
            x, stochastic_rounding=True, key=KEY, implementation=impl, _sr_offset=offset
        )
        for impl in ("ffi", "reference")
    }
    assert_same_q(q["ffi"], q["reference"])
    plain = nvfp4_jax.quantize(x, stochastic_rounding=True, key=KEY, implementation="ffi")
    assert not np.array_equal(np.asarray(q["ffi"].codes), np.asarray(plain.codes))


def raw_call(target, args, results, **attrs):
    return jax.ffi.ffi_call(target, results)(*args, **attrs)


@pytest.mark.parametrize(
    "target,args,results,attrs,message",
    [
        (
            "nvfp4_amax",
            [np.zeros((4, 20), np.float32)],
            jax.ShapeDtypeStruct((), jnp.float32),
            dict(rht=False),
            "nvfp4_amax: x of shape (4, 20) and dtype f32: the quantized (last) axis must be a "
            "multiple of 16",
        ),
        (
            "nvfp4_amax",
            [np.zeros((4, 16), np.int32)],
            jax.ShapeDtypeStruct((), jnp.float32),
            dict(rht=False),
            "nvfp4_amax: x of shape (4, 16) and dtype s32: expected dtype bf16, f16 or f32",
        ),
        (
            "nvfp4_quantize",
            [np.zeros((24, 32), np.float32), np.float32(1), np.zeros(4, np.uint32)],
            (
                jax.ShapeDtypeStruct((24, 16), jnp.uint8),
                jax.ShapeDtypeStruct((24, 2), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((), jnp.float32),
            ),
            dict(block_2d=True, rht=False, stochastic_rounding=False),
            "16x16 blocks need a row count that is a multiple of 16",
        ),
        (
            "nvfp4_quantize",
            [np.zeros((16, 32), np.float32), np.float32(1), np.zeros(3, np.uint32)],
            (
                jax.ShapeDtypeStruct((16, 16), jnp.uint8),
                jax.ShapeDtypeStruct((16, 2), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((), jnp.float32),
            ),
            dict(block_2d=False, rht=False, stochastic_rounding=False),
            "key words of shape (3,): expected uint32[4]",
        ),
        (
            "nvfp4_dequantize",
            [np.zeros((4, 8), np.uint8), np.zeros((4, 2), jnp.float8_e4m3fn), np.float32(1)],
            jax.ShapeDtypeStruct((4, 16), jnp.float32),
            dict(rht=False),
            "nvfp4_dequantize: scales of shape (4, 2) and dtype f8e4m3fn: expected 4 elements",
        ),
    ],
    ids=["amax_cols", "amax_dtype", "quantize_2d_rows", "quantize_key", "dequantize_scales"],
)
def test_native_errors_name_shape_and_dtype(target, args, results, attrs, message):
    with pytest.raises(Exception) as info:
        jax.block_until_ready(raw_call(target, args, results, **attrs))
    assert message in str(info.value)


def test_python_wrapper_errors():
    with pytest.raises(ValueError, match=r"last axis of x \(4, 20\)"):
        kernels.amax_ffi(jnp.zeros((4, 20)), rht=False)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        kernels.rht_ffi(jnp.zeros((4, 16), jnp.int32), inverse=False)


def test_broken_module_leaves_kernels_unavailable(monkeypatch):
    monkeypatch.setattr(kernels, "_MODULES", {"cpu": ("nvfp4_jax._no_such_module", "cpu")})
    monkeypatch.setattr(kernels, "_status", {})
    assert not kernels.is_available("cpu")
    assert "No module named 'nvfp4_jax._no_such_module'" in kernels.unavailable_reason("cpu")
    with pytest.raises(ValueError, match="_no_such_module"):
        nvfp4_jax.quantize(jnp.ones((16, 16)), implementation="ffi")
    # The reference keeps working.
    nvfp4_jax.quantize(jnp.ones((16, 16)), implementation="reference")


# --------------------------------------------------------------------------------------
# GPU: the CUDA kernels against the reference computed on the CPU.

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not kernels.is_available("cuda"),
    reason=f"CUDA kernels unavailable: {kernels.unavailable_reason('cuda')}",
)


def on_gpu(fn, *args):
    gpu_device = jax.devices("cuda")[0]
    return fn(*jax.device_put(args, gpu_device))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,block_2d,rht,sr,shape", list(matrix())[::3])
def test_gpu_quantize_bits(dtype, block_2d, rht, sr, shape):
    x = heavy_tailed(shape, dtype, seed=sum(shape))
    flags = dict(block_2d=block_2d, rht=rht, stochastic_rounding=sr)
    ref = jax.device_put(run("quantize", "reference", jax.device_put(x, CPU), KEY, None, **flags))
    ffi = on_gpu(lambda x, k: run("quantize", "ffi", x, k, None, **flags), x, KEY)
    assert_same_q(ffi, ref)
    fake_ref = run("fake_quantize", "reference", jax.device_put(x, CPU), KEY, None, **flags)
    fake = on_gpu(lambda x, k: run("fake_quantize", "ffi", x, k, None, **flags), x, KEY)
    assert_same(fake, fake_ref, "fake_quantize")


@gpu
@needs_cuda
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_gpu_dequantize_and_rht_bits(rht):
    x = heavy_tailed((64, 128), "bf16", seed=1)
    q = run("quantize", "reference", jax.device_put(x, CPU), None, None, rht=rht)
    ref = run("dequantize", "reference", q, dtype=jnp.bfloat16)
    ffi = on_gpu(lambda q: run("dequantize", "ffi", q, dtype=jnp.bfloat16), q)
    assert_same(ffi, ref, "dequantize")
    rht_ref = run("apply_rht", "reference", jax.device_put(x, CPU), inverse=rht)
    assert_same(on_gpu(lambda x: run("apply_rht", "ffi", x, inverse=rht), x), rht_ref, "rht")
