"""The native custom calls (nvfp4_jax/_src/core/kernels/, ffi/) through raw `jax.ffi.ffi_call`:
the non-finite contract of docs/NUMERICS.md section 8 (stored amax NaN, every scale byte
0x7F, every code 0, fake quantize all NaN) and zero-size inputs. Runs on the CPU kernels.
The calls and their operands are ffi_calls.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
from ffi_calls import (
    BF16,
    E4M3,
    F32,
    U8,
    U32,
    amax_case,
    call,
    dequantize_case,
    fake_case,
    fake_results,
    ms_eden_amax_case,
    ms_eden_fake_case,
    ms_eden_quantize_case,
    quantize_case,
    rht_case,
    sds,
)

from nvfp4_jax import kernels

if not kernels.is_available("cpu"):  # registers the targets
    pytest.skip(
        f"native CPU kernels not built: {kernels.unavailable_reason('cpu')}",
        allow_module_level=True,
    )


# --- the non-finite contract (docs/NUMERICS.md section 8) -------------------------------------


def data(shape, dtype=F32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(F32).astype(dtype)


def quantize(x, amax, **flags):
    target, args, results, attrs = quantize_case(x, amax=F32(amax), **flags)
    return call(target, args, results, **attrs)


def fake_quantize(x, amax, dtype=F32, **flags):
    target, args, _, attrs = fake_case(x, amax=F32(amax), **flags)
    return call(target, args, tuple(fake_results(x, dtype)), **attrs)


def amax_of(x, rht):
    return call(*amax_case(x, rht=rht)[:3], rht=rht)


def assert_non_finite_result(codes, scales, stored):
    assert np.isnan(stored), stored
    assert np.all(scales.view(U8) == 0x7F), np.unique(scales.view(U8))
    assert np.all(codes == 0), np.unique(codes)


def assert_all_nan(values):
    assert values.size and np.all(np.isnan(values.astype(F32)))


FLAGS = [
    pytest.param(
        dict(block_2d=b, rht=r, sr=s),
        id=f"{'2d' if b else '1d'}-{'rht' if r else 'plain'}-{'sr' if s else 'rn'}",
    )
    for b in (False, True)
    for r in (False, True)
    for s in (False, True)
]


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_element(bad, flags):
    x = data((32, 64))
    finite_amax = float(np.max(np.abs(x)))
    x[17, 40] = bad
    assert np.isnan(amax_of(x, flags["rht"]))
    # The amax operand is finite: the element alone makes the result the non-finite one.
    assert_non_finite_result(*quantize(x, finite_amax, **flags))
    for global_scale in (True, False):
        for dtype in (F32, BF16):
            values, stored = fake_quantize(
                x, finite_amax, dtype, global_scale=global_scale, **flags
            )
            assert_all_nan(values)
            assert np.isnan(stored)


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0], ids=["nan", "inf", "negative"])
def test_non_finite_amax_operand(bad, flags):
    x = data((32, 64), BF16, seed=1)
    assert_non_finite_result(*quantize(x, bad, **flags))
    for global_scale in (True, False):
        values, stored = fake_quantize(x, bad, F32, global_scale=global_scale, **flags)
        assert_all_nan(values)
        assert np.isnan(stored)


@pytest.mark.parametrize("flags", FLAGS)
def test_finite_input_keeps_its_amax(flags):
    x = data((32, 64), seed=2)
    amax = amax_of(x, flags["rht"])
    assert np.isfinite(amax)
    codes, scales, stored = quantize(x, amax, **flags)
    assert stored == amax
    assert not np.any(scales.view(U8) == 0x7F) and np.any(codes != 0)
    values, stored = fake_quantize(x, amax, **flags)
    assert stored == amax and np.all(np.isfinite(values))


RHT_SIGNS = np.array([-1.0 if 0xD7E8 >> i & 1 else 1.0 for i in range(16)], F32)


def test_rht_overflow_is_non_finite():
    # Finite f16 input whose RHT (rounded to f16) overflows: x = 60000 * sign makes the first
    # output 16 * 60000 / 4 = 240000, inf in f16. The post-RHT tensor is not finite.
    x = np.tile(RHT_SIGNS * 60000.0, (2, 1)).astype(np.float16)
    assert np.isfinite(amax_of(x, rht=False)) and np.isnan(amax_of(x, rht=True))
    assert_non_finite_result(*quantize(x, 60000.0, rht=True))
    codes, scales, stored = quantize(x, 60000.0)
    assert stored == 60000.0 and np.all(scales.view(U8) != 0x7F)
    assert_all_nan(fake_quantize(x, 60000.0, rht=True)[0])


def test_negative_zero_amax_is_zero():
    x = np.zeros((16, 32), F32)
    codes, scales, stored = quantize(x, -0.0)
    assert stored == 0 and np.all(scales.view(U8) == 0) and np.all(codes == 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_ms_eden_non_finite_element_and_amax(bad):
    x = data((4, 256))
    amax = call(*ms_eden_amax_case(x)[:3])
    assert np.isfinite(amax)
    codes, scales, stored = call(*ms_eden_quantize_case(x, amax=F32(amax))[:3])
    assert stored == amax and np.all(scales.view(U8) != 0x7F)
    x[2, 200] = bad
    assert np.isnan(call(*ms_eden_amax_case(x)[:3]))
    assert_non_finite_result(*call(*ms_eden_quantize_case(x, amax=F32(amax))[:3]))
    for global_scale in (True, False):
        values, stored = call(*ms_eden_fake_case(x, amax=F32(amax), global_scale=global_scale)[:3],
                              global_scale=global_scale)  # fmt: skip
        assert_all_nan(values)
        assert np.isnan(stored)
    # A bad amax operand alone: the non-finite result without reading x.
    clean = data((4, 256), seed=1)
    assert_non_finite_result(*call(*ms_eden_quantize_case(clean, amax=F32(-1.0))[:3]))


def test_ms_eden_rotation_overflow_is_non_finite():
    # Finite f32 input whose rotated group overflows: 128 equal values near FLT_MAX sum to inf.
    x = np.full((1, 128), 3e38, F32)
    assert np.isnan(call(*ms_eden_amax_case(x, rotation=np.zeros(4, U32))[:3]))
    zero_signs = ms_eden_quantize_case(x, amax=F32(3e38), rotation=np.zeros(4, U32))
    assert_non_finite_result(*call(*zero_signs[:3]))


@pytest.mark.parametrize("shape", [(0, 128), (4, 0), (0,)], ids=str)
def test_ms_eden_zero_size(shape):
    x = np.zeros(shape, F32)
    assert call(*ms_eden_amax_case(x)[:3]) == 0
    codes, scales, stored = call(*ms_eden_quantize_case(x, amax=F32(2.5))[:3])
    assert codes.size == 0 and scales.size == 0 and stored == 2.5
    values, stored = call(*ms_eden_fake_case(x, amax=F32(0.0))[:3], global_scale=True)
    assert values.shape == shape and stored == 0


# --- zero-size inputs --------------------------------------------------------------------------

EMPTY_SHAPES = [(0, 32), (4, 0), (0,), (2, 0, 16), (0, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [F32, BF16, np.float16], ids=["f32", "bf16", "f16"])
def test_zero_size(shape, dtype):
    x = np.zeros(shape, dtype)
    for rht in (False, True):
        assert amax_of(x, rht) == 0
    for block_2d in (False, True):
        if block_2d and (len(shape) < 2 or np.prod(shape[:-1]) % 16):
            continue
        for rht, sr in ((False, False), (True, False), (True, True)):
            flags = dict(block_2d=block_2d, rht=rht, sr=sr)
            for amax in (0.0, 2.5):  # the stored amax is the operand as given
                codes, scales, stored = quantize(x, amax, **flags)
                assert codes.shape == (*shape[:-1], shape[-1] // 2) and codes.size == 0
                assert scales.shape == (*shape[:-1], shape[-1] // 16) and scales.size == 0
                assert stored == amax
                values, stored = fake_quantize(x, amax, dtype, **flags)
                assert values.shape == shape and values.dtype == dtype and stored == amax
            # A bad amax operand is still reported, with empty results.
            codes, scales, stored = quantize(x, np.nan, **flags)
            assert np.isnan(stored) and codes.size == 0
    for rht in (False, True):
        codes = np.zeros((*shape[:-1], shape[-1] // 2), U8)
        scales = np.zeros((*shape[:-1], shape[-1] // 16), E4M3)
        target, args, result, attrs = dequantize_case(
            codes, scales, F32(1.0), sds(shape, dtype), rht
        )
        assert call(target, args, result, **attrs).shape == shape
        target, args, result, attrs = rht_case(x, inverse=rht)
        out = call(target, args, result, **attrs)
        assert out.shape == shape and out.dtype == dtype
