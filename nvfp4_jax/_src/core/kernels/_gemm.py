"""`nvfp4_gemm`: the exact NVFP4 x NVFP4 GEMM of the CPU and its sharding rule.

Native twin: `GemmImpl` in ffi/cpu/gemm.cc, the kernels in ffi/cpu/gemm_isa.cc (CPU
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

`nvfp4_w4a16`: the weight-only GEMM (`ffi/cpu/w4a16_isa.cc`), bf16/f16/f32 activations
`(..., M, K)` times a stored NVFP4 weight, codes `(..., N, K/2)`, scales `(..., N, K/16)` and
its decode factor `D` f32 `(...)`; f32 `(..., M, N)`. Sharded, N and the weight's batch dims
keep the weight's sharding (the weight is the large operand: it is never gathered when only
N and its batch dims are sharded), M and the other batch dims follow x; K is gathered (each
output element sums all of K in one kernel call, in its fixed order: the unsharded bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.core.kernels import _partition as part

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


def _call_weight_only(x, codes, scales, decode):
    shape = (
        *jnp.broadcast_shapes(x.shape[:-2], codes.shape[:-2]),
        x.shape[-2],
        codes.shape[-2],
    )
    call = jax.ffi.ffi_call(
        "nvfp4_w4a16", jax.ShapeDtypeStruct(shape, _F32), vmap_method="expand_dims"
    )
    return call(x, codes, scales, decode)


def _batch_factors(x_batch_one, w_batch_one) -> tuple[str, str, str]:
    """The Shardy factors of the batch dims of x, of the weight and of the result.

    A dim broadcast from 1 on one side gets a factor of its own there: Shardy would give a
    factor shared by sizes 1 and B the smaller size, and shard the dim nowhere.
    """
    xs, ws, outs = [], [], []
    for i, (x_one, w_one) in enumerate(zip(x_batch_one, w_batch_one, strict=True)):
        xs.append(f"x{i}" if x_one and not w_one else f"d{i}")
        ws.append(f"w{i}" if w_one and not x_one else f"d{i}")
        outs.append(f"d{i}")
    return " ".join(xs), " ".join(ws), " ".join(outs)


@functools.cache
def _partitioned_weight_only(x_batch_one: tuple[bool, ...], w_batch_one: tuple[bool, ...]):
    """The rule of `nvfp4_w4a16` for batch dims of size 1 (broadcast) where marked True.

    Each dim of the result takes one spec entry, and each mesh axis shards one dim at most:
    first the weight's (its batch dims, then N), then x's (its batch dims where the weight's
    are unsharded, then M); what a dim cannot keep is gathered (Shardy, JAX's default
    partitioner, settles such a conflict in its propagation, before this rule sees the
    operands, and may keep x's axis instead: the bits are the same either way). K is
    replicated on both sides, gathered where sharded: partial sums over K shards and a psum
    would add in another order than the kernel's, other bits. Every output element (i, j)
    is computed from row i of x and row j of the weight alone, in an order that does not
    depend on M or N (w4a16_isa.cc: the threads and the passes over rows split M and N,
    never K; the decode table depends on the batch element's D only), so each shard's
    result is the unsharded result's bits.
    """
    raw = part.positional(_call_weight_only)
    batch_ndim = len(x_batch_one)

    def layout(mesh, arg_shapes):
        x, codes = arg_shapes[0], arg_shapes[1]
        xs = part.divisible(mesh, part.entries(x.sharding, batch_ndim + 2), x.shape)
        ws = part.divisible(mesh, part.entries(codes.sharding, batch_ndim + 2), codes.shape)
        out, used = [None] * (batch_ndim + 2), set()
        claims = [*enumerate(ws[:batch_ndim]), (batch_ndim + 1, ws[-2])]
        claims += [*enumerate(xs[:batch_ndim]), (batch_ndim, xs[-2])]
        for dim, entry in claims:  # size-1 dims are unsharded (divisible)
            if entry is not None and out[dim] is None and not set(part.axes(entry)) & used:
                out[dim] = entry
                used.update(part.axes(entry))
        return out

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return part.named(mesh, layout(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        out = layout(mesh, arg_shapes)
        batch, m, n = out[:batch_ndim], out[batch_ndim], out[batch_ndim + 1]
        x_batch = [None if one else e for e, one in zip(batch, x_batch_one, strict=True)]
        w_batch = [None if one else e for e, one in zip(batch, w_batch_one, strict=True)]
        weight = part.named(mesh, [*w_batch, n, None])
        args = (part.named(mesh, [*x_batch, m, None]), weight, weight, part.named(mesh, w_batch))
        return mesh, raw, part.named(mesh, out), args

    xb, wb, d = _batch_factors(x_batch_one, w_batch_one)
    rule = f"{xb} m k, {wb} n h, {wb} n s, {wb} -> {d} m n"
    return part.with_rule(raw, partition, infer, rule, need_replication_factors=("k", "h", "s"))


def weight_only_matmul(x, codes, scales, decode) -> jax.Array:
    """The weight-only GEMM: `x @ dequantize(W, x.dtype)` in f32, the weight decoded in registers.

    Native twin: `W4a16Impl` in ffi/cpu/w4a16.cc, the kernels in ffi/cpu/w4a16_isa.cc (CPU
    only). `x`: bf16, f16 or f32 `(..., M, K)`; the weight in its stored layout quantized
    along K, codes uint8 `(..., N, K/2)`, scales float8_e4m3fn `(..., N, K/16)`, and its
    decode factor `D` f32 (a scalar or the weight's batch shape); batch dims broadcast (equal
    or 1). Each weight element is `dequantize`'s `x.dtype(value(code) * (f32(s) * D))`; the
    sum over K is f32 in 16 slots (k mod 16, ascending k) and a fixed tree over the slots
    (docs/NUMERICS.md section 9). Returns f32 `(..., M, N)`.

    Sharded under `jit` (`_partitioned_weight_only`), the kernel runs on each device's shard: the
    rows of x (M and the batch dims) and the rows of the weight (N: tensor parallelism over
    the output features, the weight never gathered) keep their sharding, which the result
    takes (one dim per mesh axis; in a conflict one operand is gathered along it). K is
    replicated: gathered where sharded, never summed across devices, so the result is the
    unsharded call's bits in every layout. Under `vmap` the raw call runs (one call, the
    batch in the kernel), without the rule.
    """
    _library.require("nvfp4_w4a16")
    if _library.current_platform() != "cpu":
        raise ValueError(
            "nvfp4_w4a16: the native weight-only GEMM runs on the CPU only, not "
            f"{_library.current_platform()!r}"
        )
    decode = jnp.broadcast_to(jnp.asarray(decode, _F32), codes.shape[:-2])
    args = (x, codes, scales, decode)
    if x.ndim != codes.ndim:
        return _call_weight_only(*args)  # the kernel names the mismatch
    x_batch, w_batch = x.shape[:-2], codes.shape[:-2]
    op = _partitioned_weight_only(tuple(d == 1 for d in x_batch), tuple(d == 1 for d in w_batch))
    return part.vary_like(op(*args), *args)
