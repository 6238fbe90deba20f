"""The native custom calls through raw `jax.ffi.ffi_call`, independent of the Python wrappers:
`call` runs one on the CPU, and each target's operands, results and attributes (`*_case`) are
valid unless a case overrides one. Plain code for the test_kernels_*.py files.
"""

from __future__ import annotations

import jax
import jax.extend.random
import ml_dtypes
import numpy as np

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
