"""The native custom calls (nvfp4_jax/_src/core/kernels/, ffi/) through raw `jax.ffi.ffi_call`,
independent of the Python wrappers, with what the wrappers never send: every unsupported
dtype and bad shape must come back as an error naming the target, the operand, its shape and
dtype. Runs on the CPU kernels; the CUDA handlers share the same argument checks
(ffi/include/nvfp4/checks.h). The calls and their valid operands are ffi_calls.py's.
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
    XG,
    amax_case,
    call,
    dequantize_case,
    fake_case,
    fake_results,
    four_over_six_case,
    ms_eden_amax_case,
    ms_eden_fake_case,
    ms_eden_quantize_case,
    quantize_case,
    quantize_results,
    rht_case,
    sds,
    with_result,
)

from nvfp4_jax import kernels

if not kernels.is_available("cpu"):  # registers the targets
    pytest.skip(
        f"native CPU kernels not built: {kernels.unavailable_reason('cpu')}",
        allow_module_level=True,
    )


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
