"""The native custom calls through raw `jax.ffi.ffi_call`, independent of the Python wrappers.

Covers what the wrappers never send: every unsupported dtype and bad shape must come back
as an error naming the target, the operand, its shape and dtype; the non-finite contract
of docs/NUMERICS.md section 8 (stored amax NaN, every scale byte 0x7F, every code 0, fake quantize
all NaN); and zero-size inputs. Runs on the CPU kernels; the CUDA handlers share the same
argument checks (ffi/include/nvfp4/checks.h).
"""

from __future__ import annotations

import subprocess
import sys
import types

import jax
import jax.extend.random
import ml_dtypes
import numpy as np
import pytest

from nvfp4_jax import kernels
from nvfp4_jax._src.core.kernels import _library

if not kernels.is_available("cpu"):  # registers the targets
    pytest.skip(
        f"native CPU kernels not built: {kernels.unavailable_reason('cpu')}",
        allow_module_level=True,
    )

CPU = jax.devices("cpu")[0]
KEY = np.array([0x12345678, 0x9ABCDEF0, 0, 0], np.uint32)
F32, U8, U32 = np.float32, np.uint8, np.uint32
E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def call(target, args, results, **attrs):
    """Runs one custom call on the CPU (x64 on, so f64 operands stay f64)."""
    with jax.enable_x64(True), jax.default_device(CPU):
        out = jax.ffi.ffi_call(target, results)(*args, **attrs)
        return jax.tree.map(np.asarray, jax.block_until_ready(out))


# --- operands and results of each target, valid unless a case overrides one -------------------


def amax_case(x=None, result=None, rht=False):
    x = np.ones((4, 32), F32) if x is None else x
    return "nvfp4_amax", [x], sds((), F32) if result is None else result, dict(rht=rht)


def quantize_results(x):
    lead, cols = x.shape[:-1], x.shape[-1] if x.ndim else 0
    return [sds((*lead, cols // 2), U8), sds((*lead, cols // 16), E4M3), sds((), F32)]


def quantize_case(x=None, amax=None, key=None, results=None, block_2d=False, rht=False, sr=False):
    x = np.ones((16, 32), F32) if x is None else x
    results = quantize_results(x) if results is None else results
    args = [x, F32(1.0) if amax is None else amax, KEY if key is None else key]
    attrs = dict(block_2d=block_2d, rht=rht, stochastic_rounding=sr)
    return "nvfp4_quantize", args, tuple(results), attrs


def fake_results(x, dtype=F32):
    return [sds(x.shape, dtype), sds((), F32)]


def fake_case(
    x=None,
    amax=None,
    key=None,
    results=None,
    block_2d=False,
    rht=False,
    sr=False,
    global_scale=True,
):
    x = np.ones((16, 32), F32) if x is None else x
    results = fake_results(x) if results is None else results
    args = [x, F32(1.0) if amax is None else amax, KEY if key is None else key]
    attrs = dict(block_2d=block_2d, rht=rht, stochastic_rounding=sr, global_scale=global_scale)
    return "nvfp4_fake_quantize", args, tuple(results), attrs


def dequantize_case(codes=None, scales=None, amax=None, result=None, rht=False):
    codes = np.zeros((4, 16), U8) if codes is None else codes
    scales = np.zeros((4, 2), E4M3) if scales is None else scales
    if result is None:
        result = sds((*codes.shape[:-1], 2 * codes.shape[-1]), F32)
    args = [codes, scales, F32(1.0) if amax is None else amax]
    return "nvfp4_dequantize", args, result, dict(rht=rht)


def rht_case(x=None, result=None, inverse=False):
    x = np.ones((4, 32), F32) if x is None else x
    return (
        "nvfp4_rht",
        [x],
        sds(x.shape, x.dtype) if result is None else result,
        dict(inverse=inverse),
    )


def four_over_six_case(case, error="mae", e4m3_max=256):
    """A quantize or fake-quantize case on its Four Over Six twin target."""
    target, args, results, attrs = case
    return f"{target}_4over6", args, results, dict(attrs, error=error, e4m3_max=np.int32(e4m3_max))


ROTATION = np.array([0xDEADBEEF, 0x01234567, 0x89ABCDEF, 0x0F0F0F0F], U32)
XG = np.ones((2, 128), F32)  # MS-EDEN's rows: whole 128-groups


def ms_eden_amax_case(x=None, rotation=None, result=None):
    x = XG if x is None else x
    args = [x, ROTATION if rotation is None else rotation]
    return "nvfp4_amax_ms_eden", args, sds((), F32) if result is None else result, {}


def ms_eden_quantize_case(x=None, amax=None, key=None, rotation=None, results=None):
    x = XG if x is None else x
    results = quantize_results(x) if results is None else results
    args = [x, F32(1.0) if amax is None else amax, KEY if key is None else key]
    args.append(ROTATION if rotation is None else rotation)
    return "nvfp4_quantize_ms_eden", args, tuple(results), {}


def ms_eden_fake_case(x=None, amax=None, key=None, rotation=None, results=None, global_scale=True):
    x = XG if x is None else x
    results = fake_results(x) if results is None else results
    args = [x, F32(1.0) if amax is None else amax, KEY if key is None else key]
    args.append(ROTATION if rotation is None else rotation)
    return "nvfp4_fake_quantize_ms_eden", args, tuple(results), dict(global_scale=global_scale)


def with_result(results, i, value):
    results = list(results)
    results[i] = value
    return results


X = np.ones((16, 32), F32)
FLOAT_MSG = "expected dtype bf16, f16 or f32"
SCALAR_MSG = "expected an f32 scalar of shape ()"
KEY_MSG = "expected uint32[4] (k0, k1, counter offset lo, hi), got dtype"
COLS_MSG = "the quantized (last) axis must be a multiple of 16"
ROWS_MSG = "16x16 blocks need a row count that is a multiple of 16"
GROUPS_MSG = "the quantized (last) axis must be a multiple of 128 (MS-EDEN's rotation groups)"
ROTATION_MSG = "expected uint32[4] (the 128 sign bits of the rotation)"

# (id, case, the exact message): each names the target, operand, shape and dtype.
ERROR_CASES = [
    # nvfp4_amax
    (
        "amax-x-s32",
        amax_case(np.ones((4, 16), np.int32)),
        f"nvfp4_amax: x of shape (4, 16) and dtype s32: {FLOAT_MSG}",
    ),
    (
        "amax-x-f64",
        amax_case(np.ones((4, 16), np.float64)),
        f"nvfp4_amax: x of shape (4, 16) and dtype f64: {FLOAT_MSG}",
    ),
    (
        "amax-x-f8",
        amax_case(np.ones((4, 16), E4M3)),
        f"nvfp4_amax: x of shape (4, 16) and dtype f8e4m3fn: {FLOAT_MSG}",
    ),
    (
        "amax-x-pred",
        amax_case(np.ones((4, 16), bool)),
        f"nvfp4_amax: x of shape (4, 16) and dtype pred: {FLOAT_MSG}",
    ),
    ("amax-x-rank0", amax_case(F32(1)), "nvfp4_amax: x of shape () and dtype f32: needs rank >= 1"),
    (
        "amax-x-cols",
        amax_case(np.ones((4, 20), F32)),
        f"nvfp4_amax: x of shape (4, 20) and dtype f32: {COLS_MSG}",
    ),
    (
        "amax-result-s32",
        amax_case(result=sds((), np.int32)),
        f"nvfp4_amax: result of shape () and dtype s32: {SCALAR_MSG}",
    ),
    (
        "amax-result-shape",
        amax_case(result=sds((1,), F32)),
        f"nvfp4_amax: result of shape (1,) and dtype f32: {SCALAR_MSG}",
    ),
    # nvfp4_quantize
    (
        "quantize-x-s32",
        quantize_case(np.ones((16, 32), np.int32)),
        f"nvfp4_quantize: x of shape (16, 32) and dtype s32: {FLOAT_MSG}",
    ),
    (
        "quantize-x-f64",
        quantize_case(np.ones((16, 32), np.float64)),
        f"nvfp4_quantize: x of shape (16, 32) and dtype f64: {FLOAT_MSG}",
    ),
    (
        "quantize-x-f8",
        quantize_case(np.ones((16, 32), E4M3)),
        f"nvfp4_quantize: x of shape (16, 32) and dtype f8e4m3fn: {FLOAT_MSG}",
    ),
    (
        "quantize-x-cols",
        quantize_case(np.ones((16, 24), F32), results=quantize_results(X)),
        f"nvfp4_quantize: x of shape (16, 24) and dtype f32: {COLS_MSG}",
    ),
    (
        "quantize-x-2d-rows",
        quantize_case(np.ones((24, 32), F32), block_2d=True),
        f"nvfp4_quantize: x of shape (24, 32) and dtype f32: {ROWS_MSG}",
    ),
    (
        "quantize-x-2d-rank1",
        quantize_case(np.ones((32,), F32), block_2d=True),
        f"nvfp4_quantize: x of shape (32,) and dtype f32: {ROWS_MSG}",
    ),
    (
        "quantize-amax-s32",
        quantize_case(amax=np.int32(1)),
        f"nvfp4_quantize: amax of shape () and dtype s32: {SCALAR_MSG}",
    ),
    (
        "quantize-amax-f64",
        quantize_case(amax=np.float64(1)),
        f"nvfp4_quantize: amax of shape () and dtype f64: {SCALAR_MSG}",
    ),
    (
        "quantize-amax-shape",
        quantize_case(amax=np.ones((1,), F32)),
        f"nvfp4_quantize: amax of shape (1,) and dtype f32: {SCALAR_MSG}",
    ),
    (
        "quantize-key-short",
        quantize_case(key=np.zeros(3, U32)),
        f"nvfp4_quantize: key words of shape (3,): {KEY_MSG} u32",
    ),
    (
        "quantize-key-2x2",
        quantize_case(key=np.zeros((2, 2), U32)),
        f"nvfp4_quantize: key words of shape (2, 2): {KEY_MSG} u32",
    ),
    (
        "quantize-key-s32",
        quantize_case(key=np.zeros(4, np.int32)),
        f"nvfp4_quantize: key words of shape (4,): {KEY_MSG} s32",
    ),
    (
        "quantize-codes-s8",
        quantize_case(results=with_result(quantize_results(X), 0, sds((16, 16), np.int8))),
        "nvfp4_quantize: codes of shape (16, 16) and dtype s8: expected 256 elements of dtype u8",
    ),
    (
        "quantize-codes-count",
        quantize_case(results=with_result(quantize_results(X), 0, sds((16, 8), U8))),
        "nvfp4_quantize: codes of shape (16, 8) and dtype u8: expected 256 elements of dtype u8",
    ),
    (
        "quantize-scales-u8",
        quantize_case(results=with_result(quantize_results(X), 1, sds((16, 2), U8))),
        "nvfp4_quantize: scales of shape (16, 2) and dtype u8: expected 32 elements of dtype "
        "f8e4m3fn",
    ),
    (
        "quantize-scales-count",
        quantize_case(results=with_result(quantize_results(X), 1, sds((16, 4), E4M3))),
        "nvfp4_quantize: scales of shape (16, 4) and dtype f8e4m3fn: expected 32 elements of "
        "dtype f8e4m3fn",
    ),
    (
        "quantize-stored-u32",
        quantize_case(results=with_result(quantize_results(X), 2, sds((), U32))),
        f"nvfp4_quantize: stored_amax of shape () and dtype u32: {SCALAR_MSG}",
    ),
    (
        "quantize-stored-shape",
        quantize_case(results=with_result(quantize_results(X), 2, sds((1, 1), F32))),
        f"nvfp4_quantize: stored_amax of shape (1, 1) and dtype f32: {SCALAR_MSG}",
    ),
    # nvfp4_fake_quantize
    (
        "fake-x-s32",
        fake_case(np.ones((16, 32), np.int32), results=fake_results(X)),
        f"nvfp4_fake_quantize: x of shape (16, 32) and dtype s32: {FLOAT_MSG}",
    ),
    (
        "fake-x-f64",
        fake_case(np.ones((16, 32), np.float64), results=fake_results(X)),
        f"nvfp4_fake_quantize: x of shape (16, 32) and dtype f64: {FLOAT_MSG}",
    ),
    (
        "fake-x-f8",
        fake_case(np.ones((16, 32), E4M3), results=fake_results(X)),
        f"nvfp4_fake_quantize: x of shape (16, 32) and dtype f8e4m3fn: {FLOAT_MSG}",
    ),
    (
        "fake-x-cols",
        fake_case(np.ones((16, 40), F32)),
        f"nvfp4_fake_quantize: x of shape (16, 40) and dtype f32: {COLS_MSG}",
    ),
    (
        "fake-x-2d-rows",
        fake_case(np.ones((8, 32), F32), block_2d=True),
        f"nvfp4_fake_quantize: x of shape (8, 32) and dtype f32: {ROWS_MSG}",
    ),
    (
        "fake-amax-u32",
        fake_case(amax=np.uint32(1)),
        f"nvfp4_fake_quantize: amax of shape () and dtype u32: {SCALAR_MSG}",
    ),
    (
        "fake-amax-shape",
        fake_case(amax=np.ones((2,), F32)),
        f"nvfp4_fake_quantize: amax of shape (2,) and dtype f32: {SCALAR_MSG}",
    ),
    (
        "fake-key-f32",
        fake_case(key=np.zeros(4, F32)),
        f"nvfp4_fake_quantize: key words of shape (4,): {KEY_MSG} f32",
    ),
    (
        "fake-key-long",
        fake_case(key=np.zeros(5, U32)),
        f"nvfp4_fake_quantize: key words of shape (5,): {KEY_MSG} u32",
    ),
    (
        "fake-result-s32",
        fake_case(results=fake_results(X, np.int32)),
        f"nvfp4_fake_quantize: result of shape (16, 32) and dtype s32: {FLOAT_MSG}",
    ),
    (
        "fake-result-f64",
        fake_case(results=fake_results(X, np.float64)),
        f"nvfp4_fake_quantize: result of shape (16, 32) and dtype f64: {FLOAT_MSG}",
    ),
    (
        "fake-result-f8",
        fake_case(results=fake_results(X, E4M3)),
        f"nvfp4_fake_quantize: result of shape (16, 32) and dtype f8e4m3fn: {FLOAT_MSG}",
    ),
    (
        "fake-result-count",
        fake_case(results=[sds((16, 16), F32), sds((), F32)]),
        "nvfp4_fake_quantize: result of shape (16, 16) and dtype f32: expected 512 elements",
    ),
    (
        "fake-stored-bf16",
        fake_case(results=[sds((16, 32), F32), sds((), BF16)]),
        f"nvfp4_fake_quantize: stored_amax of shape () and dtype bf16: {SCALAR_MSG}",
    ),
    # nvfp4_dequantize
    (
        "dequantize-codes-s8",
        dequantize_case(np.zeros((4, 16), np.int8)),
        "nvfp4_dequantize: codes of shape (4, 16) and dtype s8: expected dtype u8",
    ),
    (
        "dequantize-codes-f32",
        dequantize_case(np.zeros((4, 16), F32)),
        "nvfp4_dequantize: codes of shape (4, 16) and dtype f32: expected dtype u8",
    ),
    (
        "dequantize-codes-rank0",
        dequantize_case(np.zeros((), U8), result=sds((2,), F32)),
        "nvfp4_dequantize: codes of shape () and dtype u8: needs rank >= 1",
    ),
    (
        "dequantize-codes-cols",
        dequantize_case(np.zeros((4, 12), U8)),
        "nvfp4_dequantize: codes of shape (4, 12) and dtype u8: the last axis must be a "
        "multiple of 8 (16-blocks of codes, two per byte)",
    ),
    (
        "dequantize-scales-u8",
        dequantize_case(scales=np.zeros((4, 2), U8)),
        "nvfp4_dequantize: scales of shape (4, 2) and dtype u8: expected 8 elements of dtype "
        "f8e4m3fn",
    ),
    (
        "dequantize-scales-count",
        dequantize_case(scales=np.zeros((4, 1), E4M3)),
        "nvfp4_dequantize: scales of shape (4, 1) and dtype f8e4m3fn: expected 8 elements of "
        "dtype f8e4m3fn",
    ),
    (
        "dequantize-amax-f16",
        dequantize_case(amax=np.float16(1)),
        f"nvfp4_dequantize: decode_scale of shape () and dtype f16: {SCALAR_MSG}",
    ),
    (
        "dequantize-amax-shape",
        dequantize_case(amax=np.ones((1,), F32)),
        f"nvfp4_dequantize: decode_scale of shape (1,) and dtype f32: {SCALAR_MSG}",
    ),
    (
        "dequantize-result-s32",
        dequantize_case(result=sds((4, 32), np.int32)),
        f"nvfp4_dequantize: result of shape (4, 32) and dtype s32: {FLOAT_MSG}",
    ),
    (
        "dequantize-result-f64",
        dequantize_case(result=sds((4, 32), np.float64)),
        f"nvfp4_dequantize: result of shape (4, 32) and dtype f64: {FLOAT_MSG}",
    ),
    (
        "dequantize-result-f8",
        dequantize_case(result=sds((4, 32), E4M3)),
        f"nvfp4_dequantize: result of shape (4, 32) and dtype f8e4m3fn: {FLOAT_MSG}",
    ),
    (
        "dequantize-result-count",
        dequantize_case(result=sds((4, 16), F32)),
        "nvfp4_dequantize: result of shape (4, 16) and dtype f32: expected 128 elements",
    ),
    # nvfp4_rht
    (
        "rht-x-s32",
        rht_case(np.ones((4, 16), np.int32)),
        f"nvfp4_rht: x of shape (4, 16) and dtype s32: {FLOAT_MSG}",
    ),
    (
        "rht-x-f64",
        rht_case(np.ones((4, 16), np.float64)),
        f"nvfp4_rht: x of shape (4, 16) and dtype f64: {FLOAT_MSG}",
    ),
    (
        "rht-x-f8",
        rht_case(np.ones((4, 16), E4M3)),
        f"nvfp4_rht: x of shape (4, 16) and dtype f8e4m3fn: {FLOAT_MSG}",
    ),
    (
        "rht-x-cols",
        rht_case(np.ones((3, 8), F32)),
        f"nvfp4_rht: x of shape (3, 8) and dtype f32: {COLS_MSG}",
    ),
    (
        "rht-result-dtype",
        rht_case(result=sds((4, 32), np.float16)),
        "nvfp4_rht: result of shape (4, 32) and dtype f16: expected dtype f32 (the dtype of x)",
    ),
    (
        "rht-result-count",
        rht_case(result=sds((4, 16), F32)),
        "nvfp4_rht: result of shape (4, 16) and dtype f32: expected 128 elements",
    ),
    # Four Over Six (docs/NUMERICS.md section 13): the plain targets' checks, and its attributes.
    (
        "quantize_4over6-error",
        four_over_six_case(quantize_case(), error="max"),
        'nvfp4_quantize_4over6: attribute error must be "mae" or "mse", got "max"',
    ),
    (
        "quantize_4over6-x-cols",
        four_over_six_case(quantize_case(np.ones((16, 24), F32))),
        f"nvfp4_quantize_4over6: x of shape (16, 24) and dtype f32: {COLS_MSG}",
    ),
    (
        "fake_quantize_4over6-e4m3_max",
        four_over_six_case(fake_case(), e4m3_max=300),
        "nvfp4_fake_quantize_4over6: attribute e4m3_max must be 256 or 448, got 300",
    ),
    (
        "fake_quantize_4over6-amax",
        four_over_six_case(fake_case(amax=np.float64(1.0))),
        f"nvfp4_fake_quantize_4over6: amax of shape () and dtype f64: {SCALAR_MSG}",
    ),
    # MS-EDEN (docs/NUMERICS.md section 14): the plain checks, the groups and the rotation.
    (
        "amax_ms_eden-x-f64",
        ms_eden_amax_case(np.ones((2, 128), np.float64)),
        f"nvfp4_amax_ms_eden: x of shape (2, 128) and dtype f64: {FLOAT_MSG}",
    ),
    (
        "amax_ms_eden-x-groups",
        ms_eden_amax_case(np.ones((2, 64), F32)),
        f"nvfp4_amax_ms_eden: x of shape (2, 64) and dtype f32: {GROUPS_MSG}",
    ),
    (
        "amax_ms_eden-rotation-s32",
        ms_eden_amax_case(rotation=np.zeros(4, np.int32)),
        f"nvfp4_amax_ms_eden: rotation of shape (4,) and dtype s32: {ROTATION_MSG}",
    ),
    (
        "amax_ms_eden-result-shape",
        ms_eden_amax_case(result=sds((1,), F32)),
        f"nvfp4_amax_ms_eden: result of shape (1,) and dtype f32: {SCALAR_MSG}",
    ),
    (
        "quantize_ms_eden-x-cols",
        ms_eden_quantize_case(np.ones((2, 24), F32)),
        f"nvfp4_quantize_ms_eden: x of shape (2, 24) and dtype f32: {COLS_MSG}",
    ),
    (
        "quantize_ms_eden-x-groups",
        ms_eden_quantize_case(np.ones((2, 96), F32)),
        f"nvfp4_quantize_ms_eden: x of shape (2, 96) and dtype f32: {GROUPS_MSG}",
    ),
    (
        "quantize_ms_eden-key-short",
        ms_eden_quantize_case(key=np.zeros(2, U32)),
        f"nvfp4_quantize_ms_eden: key words of shape (2,): {KEY_MSG} u32",
    ),
    (
        "quantize_ms_eden-rotation-long",
        ms_eden_quantize_case(rotation=np.zeros(8, U32)),
        f"nvfp4_quantize_ms_eden: rotation of shape (8,) and dtype u32: {ROTATION_MSG}",
    ),
    (
        "quantize_ms_eden-scales-count",
        ms_eden_quantize_case(results=with_result(quantize_results(XG), 1, sds((2, 4), E4M3))),
        "nvfp4_quantize_ms_eden: scales of shape (2, 4) and dtype f8e4m3fn: expected 16 "
        "elements of dtype f8e4m3fn",
    ),
    (
        "fake_quantize_ms_eden-amax-shape",
        ms_eden_fake_case(amax=np.ones((2,), F32)),
        f"nvfp4_fake_quantize_ms_eden: amax of shape (2,) and dtype f32: {SCALAR_MSG}",
    ),
    (
        "fake_quantize_ms_eden-rotation-2x2",
        ms_eden_fake_case(rotation=np.zeros((2, 2), U32)),
        f"nvfp4_fake_quantize_ms_eden: rotation of shape (2, 2) and dtype u32: {ROTATION_MSG}",
    ),
    (
        "fake_quantize_ms_eden-result-f64",
        ms_eden_fake_case(results=fake_results(XG, np.float64)),
        f"nvfp4_fake_quantize_ms_eden: result of shape (2, 128) and dtype f64: {FLOAT_MSG}",
    ),
]


@pytest.mark.parametrize(
    "case,message", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_rejects_with_target_operand_shape_and_dtype(case, message):
    target, args, results, attrs = case
    with pytest.raises(Exception) as info:
        call(target, args, results, **attrs)
    assert message in str(info.value)
    assert "INVALID_ARGUMENT" in str(info.value)


def test_every_target_has_error_cases():
    targets = {case[0] for _, case, _ in ERROR_CASES}
    assert targets == set(kernels.TARGETS)


def test_valid_cases_run():
    """The base operands of the error cases are valid: only the override is wrong."""
    four_over_six = (four_over_six_case(quantize_case()), four_over_six_case(fake_case()))
    base = (amax_case(), quantize_case(), fake_case(), dequantize_case(), rht_case())
    ms_eden = (ms_eden_amax_case(), ms_eden_quantize_case(), ms_eden_fake_case())
    for case in base + four_over_six + ms_eden:
        target, args, results, attrs = case
        call(target, args, results, **attrs)


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


# --- the CUDA module's load-time probe ---------------------------------------------------------


def cuda_module():
    try:
        from nvfp4_jax import _nvfp4_cuda  # noqa: PLC0415
    except ImportError as e:
        pytest.skip(f"the CUDA module is not built: {e}")
    return _nvfp4_cuda


def test_cuda_probe_returns_a_reason_or_nothing():
    module = cuda_module()
    # In a fresh process, before anything else touched CUDA: must not crash or abort.
    run = subprocess.run(
        [sys.executable, "-c", "from nvfp4_jax import _nvfp4_cuda as m; print(repr(m.probe()))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    reason = module.probe()
    assert isinstance(reason, str)
    assert repr(reason) in run.stdout
    if reason and "compute capability" in reason:
        assert "CMAKE_CUDA_ARCHITECTURES" in reason


def test_probe_reason_makes_cuda_unavailable(monkeypatch):
    reason = "no kernel image for CUDA device 0 (compute capability 8.0); built for 90"
    fake = types.ModuleType("nvfp4_jax._fake_cuda")
    fake.probe = lambda: reason
    # The fake stands in for the loaded module (nothing of it is registered with XLA).
    monkeypatch.setattr(_library, "_loaded", {"cuda": fake})
    monkeypatch.setattr(_library, "_status", {})
    monkeypatch.setattr(_library, "_gpu_backend_present", lambda: True)
    assert not kernels.is_available("cuda")
    assert reason in kernels.unavailable_reason("cuda")


# --- nvfp4_threefry2x32: JAX's hash of the SR keys as one custom call ------------------------


def test_threefry_is_jax_threefry_bit_for_bit():
    rng = np.random.default_rng(3)
    k0, k1, x0, x1 = rng.integers(0, 2**32, (4, 257), dtype=np.uint64).astype(U32)
    want = jax.extend.random.threefry2x32_p.bind(*(jax.numpy.asarray(v) for v in (k0, k1, x0, x1)))
    got = call("nvfp4_threefry2x32", [k0, k1, x0, x1], (sds((257,), U32),) * 2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, np.asarray(w))
    # The wrapper: a scalar key broadcast over the counters, under jit and vmap, and no elements.
    key = (U32(7), U32(0xFFFFFFFF))
    want = jax.extend.random.threefry2x32_p.bind(
        *(jax.numpy.full((257,), v, U32) for v in key), x0, x1
    )
    with jax.default_device(CPU):
        for got in (
            kernels.threefry2x32(*key, x0, x1),
            jax.jit(kernels.threefry2x32)(*key, x0, x1),
            jax.vmap(kernels.threefry2x32, in_axes=(None, None, 0, 0))(*key, x0, x1),
        ):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        empty = kernels.threefry2x32(*key, np.zeros((0,), U32), np.zeros((0,), U32))
        assert [e.shape for e in empty] == [(0,), (0,)]


def test_threefry_rejects_bad_operands_by_name():
    ones = np.ones((4,), U32)
    cases = [
        ([ones, ones, ones.astype(np.int32), ones], (sds((4,), U32),) * 2, "x0 of shape (4,)"),
        ([ones, ones, ones, np.ones((5,), U32)], (sds((4,), U32),) * 2, "x1 of shape (5,)"),
        ([ones] * 4, (sds((4,), U32), sds((4,), F32)), "y1 of shape (4,) and dtype f32"),
    ]
    for args, results, message in cases:
        with pytest.raises(Exception) as info:
            call("nvfp4_threefry2x32", args, results)
        assert f"nvfp4_threefry2x32: {message}" in str(info.value)
        assert "expected u32 of k0's shape (4,)" in str(info.value)
    with pytest.raises(TypeError, match="threefry2x32: x1 must be uint32, got int32"):
        kernels.threefry2x32(ones, ones, ones, ones.astype(np.int32))
    with pytest.raises(ValueError, match=r"do not broadcast: k0 \(4,\), k1 \(4,\), x0 \(3,\)"):
        kernels.threefry2x32(ones, ones, np.ones((3,), U32), ones)
