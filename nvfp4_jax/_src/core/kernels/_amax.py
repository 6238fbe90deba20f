"""`nvfp4_amax` and `nvfp4_amax_ms_eden`: the tensor amax kernels and their sharding rule.

Native twins: `Amax` in ffi/cpu/handlers.cc and ffi/cuda/handlers.cu; MS-EDEN's in
ffi/cpu/ms_eden.cc and ffi/cuda/ms_eden.cu. The operand is the stored layout `x (..., C)`,
C a multiple of 16; the result `max |x|` as f32 (after the RHT of each 16-group, rounded to
x's dtype, with `rht`), NaN if any element is not finite. MS-EDEN's takes the rotation
(uint32 (4,)) too, C a multiple of 128, and gives `max |y|` of the rotated f32 values
(docs/NUMERICS.md section 14).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.core.kernels import _partition as part

_F32 = jnp.float32


def _call(x, *rotation, rht: bool) -> jax.Array:
    out = jax.ShapeDtypeStruct((), _F32)
    if rotation:  # MS-EDEN's rotation
        return jax.ffi.ffi_call("nvfp4_amax_ms_eden", out, vmap_method="sequential")(x, *rotation)
    call = jax.ffi.ffi_call("nvfp4_amax", out, vmap_method="sequential")
    return call(x, rht=bool(rht))


@functools.cache
def _partitioned(ndim: int, rht: bool, ms_eden: bool = False):
    # XLA does not call a custom partitioner whose results are all replicated, so the
    # partitioned op returns the amax broadcast along axis 0 of x (sharded like it), and
    # `amax` takes the max of that vector: XLA's own all-reduce over axis 0's mesh axes.
    # The other sharded axes are reduced in the rule, NaN kept. MS-EDEN's rotation operand
    # is replicated, and its groups are whole on every shard.
    block = formats.MS_EDEN_GROUP if ms_eden else formats.BLOCK_SIZE

    def raw(x, *rotation):
        return jnp.broadcast_to(_call(x, *rotation, rht=rht), x.shape[:1])

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        x = arg_shapes[0]
        return part.named(mesh, part.blockwise_entries(mesh, x.sharding, x.shape, block)[:1])

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        x = arg_shapes[0]
        entries = part.blockwise_entries(mesh, x.sharding, x.shape, block)
        others = part.used_axes(entries[1:])

        def lower(x, *rotation):
            local = part.pmax_keep_nan(_call(x, *rotation, rht=rht), others)
            return jnp.broadcast_to(local, x.shape[:1])

        operands = (part.named(mesh, entries),) + (part.replicated(mesh),) * ms_eden
        return mesh, lower, part.named(mesh, entries[:1]), operands

    factors = [f"d{i}" for i in range(ndim - 1)] + ["c"]
    rule = f"{' '.join(factors)}{', r' if ms_eden else ''} -> d0"
    return part.with_rule(raw, partition, infer, rule, reduction_factors=tuple(factors[1:]))


def amax(x: jax.Array, *, rht: bool, rotation: jax.Array | None = None) -> jax.Array:
    """Returns max |x| of the stored layout `x` as an f32 scalar; NaN if x is not finite.

    With `rht`, the max over the RHT of x rounded to x's dtype (what quantize with rht uses).
    With `rotation` (uint32 (4,)), the max over MS-EDEN's rotated f32 values (`rht` False;
    the last axis a multiple of 128). 0 for a zero-size x.
    """
    _library.require("tensor_amax")
    group = formats.BLOCK_SIZE if rotation is None else formats.MS_EDEN_GROUP
    if x.ndim == 1 or x.shape[0] == 0:
        # The same groups, with a non-empty leading axis to shard (and to hold the result).
        x = x.reshape(-1, group) if x.size else x.reshape(1, 0)
    if rotation is not None:
        per_row = _partitioned(x.ndim, False, True)(x, jnp.asarray(rotation, jnp.uint32))
        bits = jnp.max(lax.bitcast_convert_type(per_row, jnp.int32))
        return part.vary_like(lax.bitcast_convert_type(bits, _F32), x, rotation)
    per_row = _partitioned(x.ndim, bool(rht))(x)
    # All entries are equal on one device; sharded, the max over shards, NaN kept: each entry
    # is finite and non-negative or the NaN 0x7FC00000 (the kernels' and `pmax_keep_nan`'s),
    # whose int32 bits order as the floats do with NaN above all. XLA's float max may drop
    # NaN; an integer max never does, and takes one reduction where a NaN flag takes two.
    bits = jnp.max(lax.bitcast_convert_type(per_row, jnp.int32))
    return part.vary_like(lax.bitcast_convert_type(bits, _F32), x)
