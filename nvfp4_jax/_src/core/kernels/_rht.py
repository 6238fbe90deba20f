"""`nvfp4_rht`: the Random Hadamard Transform kernel and its sharding rule.

Native twin: `Rht` in ffi/cpu/handlers.cc and ffi/cuda/handlers.cu (`Rht16` in
ffi/include/nvfp4/numerics.h). Each 16-group along the last axis is independent, so any
sharding with the last axis in whole 16-groups is kept.
"""

from __future__ import annotations

import functools

import jax

from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.core.kernels import _partition as part


def _call(x, *, inverse):
    call = jax.ffi.ffi_call(
        "nvfp4_rht", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="broadcast_all"
    )
    return call(x, inverse=inverse)


@functools.cache
def _partitioned(ndim: int, inverse: bool):
    raw = part.positional(_call, inverse=inverse)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        x = arg_shapes[0]
        return part.named(mesh, part.blockwise_entries(mesh, x.sharding, x.shape))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        x = arg_shapes[0]
        sharding = part.named(mesh, part.blockwise_entries(mesh, x.sharding, x.shape))
        return mesh, raw, sharding, (sharding,)

    d = part.dims(ndim)
    return part.with_rule(raw, partition, infer, f"{d} c -> {d} c")


def rht(x: jax.Array, *, inverse: bool) -> jax.Array:
    """The RHT (or its inverse) of each 16-group along the last axis, rounded to x's dtype."""
    _library.require("apply_rht")
    return part.vary_like(_partitioned(x.ndim - 1, bool(inverse))(x), x)
