"""`nvfp4_dequantize`: the decoding kernel and its sharding rule.

Native twin: `Dequantize` in ffi/cpu/handlers.cc and ffi/cuda/handlers.cu. Operands:
codes uint8 `(..., C/2)`, scales float8_e4m3fn `(..., C/16)`, the f32 tensor decode scale D
(`A * RCP2688`, or an imported checkpoint's own); the result is `value(code) * (f32(s_b) *
D)` in f32, the inverse RHT with `rht`, cast to the result dtype. Leading dims keep their
sharding; the last one too when codes and scales are sharded alike on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.core.kernels import _partition as part

_BLOCK = formats.BLOCK_SIZE


def _call(codes, scales, decode_scale, *, rht, dtype):
    shape = (*codes.shape[:-1], 2 * codes.shape[-1])
    call = jax.ffi.ffi_call(
        "nvfp4_dequantize", jax.ShapeDtypeStruct(shape, dtype), vmap_method="sequential"
    )
    return call(codes, scales, decode_scale, rht=rht)


@functools.cache
def _partitioned(ndim: int, rht: bool, dtype, one_block: bool):
    raw = part.positional(_call, rht=rht, dtype=dtype)

    def layout(mesh, arg_shapes):
        codes, scales = arg_shapes[0], arg_shapes[1]
        entries = part.divisible(mesh, part.entries(codes.sharding, ndim + 1), codes.shape)
        last = entries[-1]
        scales_last = part.entries(scales.sharding, ndim + 1)[-1]
        if last is not None and (last != scales_last or scales.shape[-1] % part.ways(mesh, last)):
            entries[-1] = None
        return entries

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return part.named(mesh, layout(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        sharding = part.named(mesh, layout(mesh, arg_shapes))
        return mesh, raw, sharding, (sharding, sharding, part.replicated(mesh))

    d = part.dims(ndim)
    if one_block:  # (..., 16): Shardy refuses a compound factor (s h) whose s has size 1
        return part.with_rule(raw, partition, infer, f"{d} h, {d} s,  -> {d} k")
    rule = f"{d} (s h), {d} s,  -> {d} (s k)"
    return part.with_rule(raw, partition, infer, rule, k=_BLOCK, h=_BLOCK // 2)


def dequantize(codes: jax.Array, scales: jax.Array, decode_scale, *, rht: bool, dtype):
    """Decodes codes uint8 (..., C/2) and scales (..., C/16) with the f32 decode scale D."""
    _library.require("dequantize")
    decode_scale = jnp.asarray(decode_scale, jnp.float32).reshape(())
    one_block = codes.shape[-1] == _BLOCK // 2
    op = _partitioned(codes.ndim - 1, bool(rht), jnp.dtype(dtype), one_block)
    return part.vary_like(op(codes, scales, decode_scale), codes, scales, decode_scale)
