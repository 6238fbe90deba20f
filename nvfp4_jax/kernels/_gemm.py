"""`nvfp4_gemm`: the exact NVFP4 x NVFP4 GEMM of the CPU and its sharding rule.

Native twin: `GemmImpl` in ffi/cpu/handlers.cc, the kernels in ffi/cpu/gemm_isa.cc (CPU
only: the CUDA library has no such target). Operands: both sides in their stored layout,
quantized along K, codes uint8 `(..., M, K/2)` and `(..., N, K/2)`, scales float8_e4m3fn
`(..., M, K/16)` and `(..., N, K/16)`, and the decode factors `D_a`, `D_b` f32 of the batch
shape `(...)`; the result is `(0.25 * sum_g d_g * s_a * s_b) * alpha` in f32, `(..., M, N)`,
with the f32 sum taken over the K/16 blocks in ascending order and `alpha = D_a * D_b`
formed in the kernel (under `jit` XLA may reassociate a product of products of constants,
so alpha is not computed in the graph; docs/NUMERICS.md section 9). Under `vmap`
the operands are broadcast to a common batch (one call, the batch looped in the kernel).
Sharded, the batch and M follow the lhs, N the rhs; K is gathered (never split: the order
of the sum is fixed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax.kernels import _library
from nvfp4_jax.kernels import _partition as part

_F32 = jnp.float32


def _call(a_codes, a_scales, b_codes, b_scales, a_decode, b_decode):
    shape = (*a_codes.shape[:-1], b_codes.shape[-2])
    call = jax.ffi.ffi_call(
        "nvfp4_gemm", jax.ShapeDtypeStruct(shape, _F32), vmap_method="broadcast_all"
    )
    return call(a_codes, a_scales, b_codes, b_scales, a_decode, b_decode)


@functools.cache
def _partitioned(batch_ndim: int):
    raw = part.positional(_call)

    def layout(mesh, arg_shapes):
        a, b = arg_shapes[0], arg_shapes[2]
        lhs = part.divisible(mesh, part.entries(a.sharding, batch_ndim + 2), a.shape)
        rhs = part.divisible(mesh, part.entries(b.sharding, batch_ndim + 2), b.shape)
        batch, m, n = lhs[:batch_ndim], lhs[batch_ndim], rhs[batch_ndim]
        used = set(part.used_axes([*batch, m]))
        if n is not None and set(part.axes(n)) & used:
            n = None  # a mesh axis can shard one dim of the result only
        return batch, m, n

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        batch, m, n = layout(mesh, arg_shapes)
        return part.named(mesh, [*batch, m, n])

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        batch, m, n = layout(mesh, arg_shapes)
        lhs = part.named(mesh, [*batch, m, None])
        rhs = part.named(mesh, [*batch, n, None])
        args = (lhs, lhs, rhs, rhs, part.named(mesh, batch), part.named(mesh, batch))
        return mesh, raw, part.named(mesh, [*batch, m, n]), args

    d = part.dims(batch_ndim)
    rule = f"{d} m h, {d} m s, {d} n h, {d} n s, {d}, {d} -> {d} m n"
    return part.with_rule(raw, partition, infer, rule, need_replication_factors=("h", "s"))


def gemm(a_codes, a_scales, b_codes, b_scales, a_decode, b_decode) -> jax.Array:
    """The NVFP4 GEMM of two stored operands: `alpha * a @ b^T` in f32, `(..., M, N)`.

    `a_decode`, `b_decode`: the f32 decode factors D (scalars, or of the batch shape);
    `alpha = D_a * D_b`.
    """
    _library.require("nvfp4_gemm")
    if _library.current_platform() != "cpu":
        raise ValueError(
            f"nvfp4_gemm: the native GEMM runs on the CPU only, not {_library.current_platform()!r}"
        )
    batch = a_codes.shape[:-2]
    a_decode = jnp.broadcast_to(jnp.asarray(a_decode, _F32), batch)
    b_decode = jnp.broadcast_to(jnp.asarray(b_decode, _F32), batch)
    args = (a_codes, a_scales, b_codes, b_scales, a_decode, b_decode)
    return part.vary_like(_partitioned(len(batch))(*args), *args)


def w4a16(x, codes, scales, decode) -> jax.Array:
    """The weight-only GEMM: `x @ dequantize(W, x.dtype)` in f32, the weight decoded in registers.

    Native twin: `W4a16Impl` in ffi/cpu/handlers.cc, the kernels in ffi/cpu/w4a16_isa.cc (CPU
    only). `x`: bf16, f16 or f32 `(..., M, K)`; the weight in its stored layout quantized
    along K, codes uint8 `(..., N, K/2)`, scales float8_e4m3fn `(..., N, K/16)`, and its
    decode factor `D` f32 (a scalar or the weight's batch shape); batch dims broadcast (equal
    or 1). Each weight element is `dequantize`'s `x.dtype(value(code) * (f32(s) * D))`; the
    sum over K is f32 in 16 slots (k mod 16, ascending k) and a fixed tree over the slots
    (docs/NUMERICS.md section 9). Returns f32 `(..., M, N)`. No sharding rule: under a mesh
    XLA gathers the operands (correct, not fast).
    """
    _library.require("nvfp4_w4a16")
    if _library.current_platform() != "cpu":
        raise ValueError(
            "nvfp4_w4a16: the native weight-only GEMM runs on the CPU only, not "
            f"{_library.current_platform()!r}"
        )
    decode = jnp.broadcast_to(jnp.asarray(decode, _F32), codes.shape[:-2])
    shape = (
        *jnp.broadcast_shapes(x.shape[:-2], codes.shape[:-2]),
        x.shape[-2],
        codes.shape[-2],
    )
    call = jax.ffi.ffi_call(
        "nvfp4_w4a16", jax.ShapeDtypeStruct(shape, _F32), vmap_method="expand_dims"
    )
    return call(x, codes, scales, decode)
