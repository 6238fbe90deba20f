"""Sharded NVFP4 from inside `shard_map`, and sharded master weights.

Quantization is blockwise, so it shards; only the tensor amax is global, and stochastic
rounding (SR) draws its bits from each element's position in the flattened stored layout
(docs/NUMERICS.md section 7). Under `jax.jit` with sharded inputs nothing is needed: every
op gives the bits of one device (the native kernels through their sharding rules in
`nvfp4_jax.kernels`). Inside `jax.shard_map` every array is a local shard and nothing is
partitioned for you; these helpers pass the global amax and the shard's `SRSeed`:

    def step(x_local):  # x sharded along rows over mesh axis "data"
        q = distributed.quantize_shard(x_local, axis_names="data", stochastic_rounding=True,
                                       key=key)
        ...

The result equals the matching shard of `quantize(x_global, ...)` bit for bit when the
shard is a contiguous slab of the stored layout (sharded only along the first stored axis)
or, without SR, along any axes in multiples of 16 (16-row multiples for `block_2d`).
`quantize_master_weights` does this for an FSDP-sharded weight in one call.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from nvfp4_jax._src.core import checks, formats
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.backends import Implementation
from nvfp4_jax._src.core.interception import opaque
from nvfp4_jax._src.core.kernels._partition import pmax_keep_nan
from nvfp4_jax._src.core.ops import fake_quantize, quantize, tensor_amax
from nvfp4_jax._src.core.sr_seed import SRSeed, as_seed

__all__ = [
    "fake_quantize_shard",
    "global_amax",
    "quantize_master_weights",
    "quantize_shard",
    "shard_offset",
]


def _names(axis_names) -> tuple[str, ...]:
    if axis_names is None:
        return ()
    if isinstance(axis_names, str):
        return (axis_names,)
    return tuple(axis_names)


def global_amax(
    x_local: jax.Array,
    axis_names,
    *,
    axis: int = -1,
    rht: bool = False,
    implementation: Implementation | None = None,
) -> jax.Array:
    """The tensor amax of a sharded tensor, from inside `shard_map`: `tensor_amax` + `pmax`.

    Args:
      x_local: this device's shard.
      axis_names: the mesh axis name(s) the tensor is sharded over (a str or a tuple).
      axis: the quantized axis, as in `quantize`.
      rht: the amax after the RHT, as `quantize(..., rht=True)` uses.
      implementation: as in `quantize`.

    Returns:
      The f32 amax of the whole tensor on every device; NaN if any shard holds NaN/inf.
    """
    local = tensor_amax(x_local, axis=axis, rht=rht, implementation=implementation)
    return pmax_keep_nan(local, _names(axis_names))


def shard_offset(x_local: jax.Array, row_axis_names) -> jax.Array:
    """The flat element offset of this shard in the global stored layout (a uint32 scalar).

    Correct when the global tensor is sharded only along the first axis of its stored layout
    over the mesh axes `row_axis_names`, in that (major to minor) order: the shard index
    times the shard's size. The global tensor must hold fewer than 2**32 elements.
    """
    names = _names(row_axis_names)
    if not names:
        return jnp.uint32(0)
    shards = math.prod(lax.axis_size(n) for n in names)
    if x_local.size * shards >= 2**32:
        raise ValueError(
            f"shard_offset: {x_local.size * shards} elements; SR offsets inside shard_map need "
            "fewer than 2**32"
        )
    return lax.axis_index(names).astype(jnp.uint32) * jnp.uint32(x_local.size)


def _shard_call(fn, x, axis_names, row_axis_names, amax, sr, key, kwargs):
    axis = kwargs.get("axis", -1)
    if amax is None:
        amax = global_amax(
            x,
            axis_names,
            axis=axis,
            rht=kwargs.get("rht", False),
            implementation=kwargs.get("implementation"),
        )
    seed = None
    if sr:
        rows = axis_names if row_axis_names is None else row_axis_names
        seed = as_seed(key, fn.__name__).advance(shard_offset(x, rows))
    return fn(x, amax=amax, stochastic_rounding=sr, key=seed, **kwargs)


@opaque
def quantize_shard(
    x_local: jax.Array,
    *,
    axis_names,
    row_axis_names=None,
    amax: jax.Array | None = None,
    stochastic_rounding: bool = False,
    key: jax.Array | SRSeed | None = None,
    **kwargs,
) -> NVFP4Array:
    """`quantize` of one shard inside `shard_map`, bit-identical to its part of the whole.

    Args:
      x_local: this device's shard.
      axis_names: the mesh axes the tensor is sharded over: the amax is their max.
      row_axis_names: the mesh axes sharding the first stored axis (default: `axis_names`),
        which give the shard's SR offset (`shard_offset`). With SR the shard must be a
        contiguous slab of the stored layout: sharded only along the first stored axis.
      amax: a precomputed global amax (skips `global_amax`).
      stochastic_rounding: as in `quantize`; `key` must be the same on every shard.
      key: as in `quantize`.
      **kwargs: the other arguments of `quantize` (`axis`, `block_2d`, `rht`,
        `implementation`).

    Returns:
      The shard's `NVFP4Array` (its `amax` is the global one).
    """
    return _shard_call(
        quantize, x_local, axis_names, row_axis_names, amax, stochastic_rounding, key, kwargs
    )


@opaque
def fake_quantize_shard(
    x_local: jax.Array,
    *,
    axis_names,
    row_axis_names=None,
    amax: jax.Array | None = None,
    stochastic_rounding: bool = False,
    key: jax.Array | SRSeed | None = None,
    **kwargs,
) -> jax.Array:
    """`fake_quantize` of one shard inside `shard_map`; see `quantize_shard`."""
    return _shard_call(
        fake_quantize, x_local, axis_names, row_axis_names, amax, stochastic_rounding, key, kwargs
    )


# --- master weights ---------------------------------------------------------------------------


@opaque
def quantize_master_weights(
    weights: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    mesh: Mesh | None = None,
    spec: PartitionSpec | None = None,
    implementation: Implementation | None = None,
) -> NVFP4Array:
    """Quantizes a sharded f32 master weight (FSDP style) with one global amax, shard by shard.

    Each device quantizes its own shard with the amax of the whole tensor (the max over
    shards, one `pmax`), so the result equals `quantize` of the gathered tensor bit for bit,
    and its codes and scales stay sharded like the weight (the quantized axis stored last).
    Round to nearest, no RHT: the recipe for weights.

    Args:
      weights: the global array, bf16/f16/f32, sharded along any axes. Shards along the
        quantized axis (and, with `block_2d`, along the stored row axis) must hold multiples
        of 16 elements.
      axis: the quantized axis.
      block_2d: 16x16 blocks.
      mesh: the device mesh; default `weights.sharding.mesh` (pass it, with `spec`, under
        `jax.jit`).
      spec: the `PartitionSpec` of `weights`; default `weights.sharding.spec`.
      implementation: as in `quantize` (each shard is quantized on its own device).

    Returns:
      An `NVFP4Array` whose codes and scales are sharded as `spec` with `axis` moved last.
    """
    op = "quantize_master_weights"
    weights = checks.as_float_array(weights, op, "weights")
    mesh, spec = _mesh_and_spec(weights, mesh, spec)
    axis = checks.normalize_axis(axis, weights.shape, op)
    block_2d = checks.check_flag(block_2d, op, "block_2d")
    checks.check_blocks(weights.shape, axis, block_2d, op)
    entries = list(spec) + [None] * (weights.ndim - len(spec))
    stored_entries = [e for i, e in enumerate(entries) if i != axis % weights.ndim]
    stored_spec = PartitionSpec(*stored_entries, entries[axis])
    _check_shards(weights.shape, entries, mesh, axis, block_2d)
    sharded = tuple(name for e in entries for name in _names(e))

    def local(shard):
        amax = global_amax(shard, sharded, axis=axis, implementation=implementation)
        q = quantize(shard, axis=axis, block_2d=block_2d, amax=amax, implementation=implementation)
        # The global amax, replicated: the stored one equals it (NaN when any shard is not
        # finite, since then the global amax is NaN), but is computed from the local shard.
        return q.codes, q.scales, amax

    if any(mesh.axis_types[mesh.axis_names.index(n)] == AxisType.Explicit for n in sharded):
        # Explicit axes are part of the type: shard_map wants the input exactly as in_specs.
        weights = jax.reshard(weights, NamedSharding(mesh, PartitionSpec(*entries)))
    codes, scales, amax = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=PartitionSpec(*entries),
        out_specs=(stored_spec, stored_spec, PartitionSpec()),
    )(weights)
    return NVFP4Array(
        codes=codes,
        scales=scales,
        amax=amax,
        dtype=jnp.dtype(weights.dtype),
        axis=axis,
        block_2d=block_2d,
        rht=False,
    )


def _mesh_and_spec(weights, mesh, spec):
    if mesh is None or spec is None:
        sharding = getattr(weights, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                "quantize_master_weights: pass mesh= and spec=, or a jax.Array with a "
                f"NamedSharding; got sharding {sharding!r}"
            )
        mesh = sharding.mesh if mesh is None else mesh
        spec = sharding.spec if spec is None else spec
    return mesh, spec


def _check_shards(shape, entries, mesh, axis, block_2d):
    """Every shard must split the tensor on block boundaries (multiples of 16)."""
    ndim = len(shape)
    blocked = {axis % ndim}
    if block_2d:
        rows = [d for d in range(ndim) if d != axis % ndim][-1:]
        blocked.update(rows)
    for dim in blocked:
        count = math.prod(mesh.shape[name] for name in _names(entries[dim]))
        if shape[dim] % (count * formats.BLOCK_SIZE):
            raise ValueError(
                f"quantize_master_weights: axis {dim} of shape {tuple(shape)} is split into "
                f"{count} shards, which must each hold a multiple of {formats.BLOCK_SIZE} "
                "elements (blocks may not straddle devices)"
            )
