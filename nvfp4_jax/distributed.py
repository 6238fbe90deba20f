"""Sharded NVFP4 quantization: partitioning rules for the FFI kernels, and shard_map helpers.

Quantization is blockwise, so it shards; only the tensor amax is global, and stochastic
rounding (SR) draws its bits from each element's position n in the flattened stored layout
(NUMERICS section 7). Two ways to run sharded, both bit-identical to one device:

**jit with sharded inputs (automatic).** The reference path is plain jnp and XLA partitions
it by itself. The FFI custom calls are opaque to XLA's partitioner, so `nvfp4_jax.kernels`
routes each of them through a `jax.experimental.custom_partitioning` rule defined here; XLA
then runs the kernel on each device's shard instead of all-gathering its operands:

* `tensor_amax`: the local amax kernel on any sharding (the last axis in multiples of 16),
  then a `lax.pmax` over the mesh axes that shard the input (one scalar all-reduce).
* `quantize` / `fake_quantize` (stored layout `(..., C)`, the quantized axis last): every
  leading dim keeps its sharding, and so does the quantized axis when each shard holds a
  multiple of 16 of it; the kernel runs on the local shard with the global amax. With SR
  only the first stored axis may stay sharded (a shard must be a contiguous slab of the
  flattened layout); its shard's SR counter offset is `axis_index * local size / 8`, so
  the random bits are the global ones. Other sharded axes are all-gathered along that
  axis only (e.g. SR on a tensor sharded along the quantized axis, or along a middle axis).
  16x16 blocks (`block_2d`) keep the second-to-last axis sharded only when each shard
  holds a multiple of 16 rows.
* `dequantize`: leading dims keep their sharding; the last axis too when codes and scales
  are sharded alike on it.
* `apply_rht`: each 16-group is independent: any sharding with the last axis in multiples
  of 16.

Axes whose size is not divisible by their mesh axes, and anything this module does not
recognise, are replicated (XLA gathers them): correct, only slower. On one device the
rules are not used: the plain custom call is lowered, with unchanged bits. Under `vmap` the
kernels run as before (one call per example), without these rules.

**Inside shard_map (explicit).** Inside `jax.shard_map` every array is a local shard and
nothing is partitioned for you. Use `global_amax` for the tensor amax, and `quantize_shard`
/ `fake_quantize_shard`, which pass that amax and the shard's SR offset to `quantize`:

    def step(x_local):  # x sharded along rows over mesh axis "data"
        q = distributed.quantize_shard(x_local, axis_names="data", stochastic_rounding=True,
                                       key=key)
        ...

The result equals the matching shard of `quantize(x_global, ...)` bit for bit when the
shard is a contiguous slab of the stored layout (sharded only along the first stored axis)
or, without SR, along any axes in multiples of 16 (16-row multiples for `block_2d`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax import kernels
from nvfp4_jax.quantize import fake_quantize, quantize, tensor_amax

_BLOCK = 16
_F32 = jnp.float32
# SR counters of a partitioned tensor are 32-bit offsets here: fewer than 2**35 elements.
_MAX_SR_COUNTERS = 2**32

__all__ = [
    "fake_quantize_shard",
    "global_amax",
    "quantize_shard",
    "shard_offset",
]


# --- public helpers for shard_map -------------------------------------------------------------


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
    implementation: str | None = None,
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
    return _max_with_nan(local, _names(axis_names))


def shard_offset(x_local: jax.Array, row_axis_names, *, axis: int = -1) -> jax.Array:
    """The flat element offset of this shard in the global stored layout (a uint32 scalar).

    Correct when the global tensor is sharded only along the first axis of its stored layout
    (`x` with `axis` moved last) over the mesh axes `row_axis_names`, in that (major to
    minor) order: the shard index times the shard's size. The global tensor must hold fewer
    than 2**32 elements.
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
    del axis  # the size of a shard does not depend on which axis is stored last
    return lax.axis_index(names).astype(jnp.uint32) * jnp.uint32(x_local.size)


def quantize_shard(
    x_local: jax.Array,
    *,
    axis_names,
    row_axis_names=None,
    amax: jax.Array | None = None,
    stochastic_rounding: bool = False,
    key: jax.Array | None = None,
    **kwargs,
):
    """`quantize` of one shard inside `shard_map`, bit-identical to its part of the whole.

    Args:
      x_local: this device's shard.
      axis_names: the mesh axes the tensor is sharded over: the amax is their `pmax`.
      row_axis_names: the mesh axes sharding the first stored axis (default: `axis_names`),
        which give the SR offset (`shard_offset`). With SR the shard must be a contiguous
        slab of the stored layout: sharded only along the first stored axis.
      amax: a precomputed global amax (skips `global_amax`).
      stochastic_rounding: as in `quantize`; `key` must be the same on every shard.
      key: as in `quantize`.
      **kwargs: the other arguments of `quantize` (`axis`, `block_2d`, `rht`,
        `implementation`).

    Returns:
      The shard's `NVFP4Array` (its `amax` is the global one).
    """
    return _shard_call(
        quantize,
        x_local,
        axis_names,
        row_axis_names,
        amax,
        stochastic_rounding,
        key,
        kwargs,
    )


def fake_quantize_shard(
    x_local: jax.Array,
    *,
    axis_names,
    row_axis_names=None,
    amax: jax.Array | None = None,
    stochastic_rounding: bool = False,
    key: jax.Array | None = None,
    **kwargs,
) -> jax.Array:
    """`fake_quantize` of one shard inside `shard_map`; see `quantize_shard`."""
    return _shard_call(
        fake_quantize,
        x_local,
        axis_names,
        row_axis_names,
        amax,
        stochastic_rounding,
        key,
        kwargs,
    )


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
    rows = axis_names if row_axis_names is None else row_axis_names
    offset = shard_offset(x, rows, axis=axis) if sr else 0
    return fn(x, amax=amax, stochastic_rounding=sr, key=key, _sr_offset=offset, **kwargs)


def _max_with_nan(local: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """`pmax` that gives NaN when any device's value is NaN (independent of NaN semantics)."""
    if not names:
        return local
    bad = lax.pmax(jnp.isnan(local).astype(_F32), names)
    top = lax.pmax(jnp.where(jnp.isnan(local), _F32(0), local), names)
    return jnp.where(bad > 0, _F32(jnp.nan), top)


# --- partitioning rules for the kernels -------------------------------------------------------


def _entries(sharding, ndim: int) -> list:
    """The partition spec entries of `sharding`, one per dim (None for a replicated dim)."""
    if not isinstance(sharding, NamedSharding):
        return [None] * ndim
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    return spec[:ndim]


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _ways(mesh, entry) -> int:
    return math.prod(mesh.shape[a] for a in _axes(entry))


def _divisible(mesh, entries, shape) -> list:
    pairs = zip(entries, shape, strict=True)
    return [e if e is None or n % _ways(mesh, e) == 0 else None for e, n in pairs]


def _keep_last(mesh, entries, shape) -> list:
    """Keeps the last axis sharded only when every shard holds whole 16-blocks."""
    if entries and entries[-1] is not None:
        if (shape[-1] // _ways(mesh, entries[-1])) % _BLOCK:
            entries[-1] = None
    return entries


def _quantize_entries(mesh, sharding, shape, *, block_2d: bool, sr: bool) -> list:
    entries = _keep_last(mesh, _divisible(mesh, _entries(sharding, len(shape)), shape), shape)
    if sr:
        # A shard must be a contiguous slab of the flattened layout: only axis 0 stays
        # sharded, and its shard offsets must fit the 32-bit counter arithmetic below.
        entries = [entries[0]] + [None] * (len(shape) - 1)
        if len(shape) == 1 or math.prod(shape) // 8 >= _MAX_SR_COUNTERS:
            entries = [None] * len(shape)
    if block_2d and entries[-2] is not None:
        if (shape[-2] // _ways(mesh, entries[-2])) % _BLOCK:
            entries[-2] = None
    return entries


def _used_axes(entries) -> tuple[str, ...]:
    return tuple(a for e in entries for a in _axes(e))


def _named(mesh, entries) -> NamedSharding:
    return NamedSharding(mesh, P(*entries))


def _replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _dims(ndim: int) -> str:
    return " ".join(f"d{i}" for i in range(ndim))


def _positional(fn, **static):
    """`fn` with `static` bound, called with positional arguments only.

    `custom_partitioning` cannot resolve keyword arguments, so no `functools.partial`.
    """

    def call(*args):
        return fn(*args, **static)

    return call


def _wrap(raw, partition, infer, rule: str, **rule_options):
    """`raw` with the custom partitioning rule, and vmap running `raw` itself (as before)."""
    partitioned = custom_partitioning(raw)
    partitioned.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        **rule_options,
    )

    @custom_vmap
    def call(*args):
        return partitioned(*args)

    @call.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        del axis_size
        out = jax.vmap(raw, in_axes=tuple(0 if b else None for b in in_batched))(*args)
        return out, jax.tree.map(lambda _: True, out)

    return call


# amax ----------------------------------------------------------------------------------------


@functools.cache
def _amax_op(ndim: int, rht: bool):
    # XLA does not call a custom partitioner whose results are all replicated, so the
    # partitioned op returns the amax broadcast along axis 0 of x (sharded like it), and
    # `amax_kernel` takes the max of that vector: XLA's own all-reduce over axis 0's mesh
    # axes. The other sharded axes are reduced in the rule with a pmax.
    def raw(x):
        return jnp.broadcast_to(kernels._call_amax(x, rht=rht), x.shape[:1])  # noqa: SLF001

    def entries_of(mesh, x):
        return _keep_last(mesh, _divisible(mesh, _entries(x.sharding, ndim), x.shape), x.shape)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return _named(mesh, entries_of(mesh, arg_shapes[0])[:1])

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        entries = entries_of(mesh, arg_shapes[0])
        others = _used_axes(entries[1:])

        def lower(x):
            local = _max_with_nan(kernels._call_amax(x, rht=rht), others)  # noqa: SLF001
            return jnp.broadcast_to(local, x.shape[:1])

        return mesh, lower, _named(mesh, entries[:1]), (_named(mesh, entries),)

    dims = [f"d{i}" for i in range(ndim - 1)] + ["c"]
    return _wrap(
        raw, partition, infer, f"{' '.join(dims)} -> d0", reduction_factors=tuple(dims[1:])
    )


def amax_kernel(x: jax.Array, *, rht: bool) -> jax.Array:
    """`kernels._call_amax` with the sharding rule (the public entry is `kernels.amax_ffi`)."""
    if x.ndim == 1:
        x = x.reshape(-1, _BLOCK)  # the same 16-groups, with a leading axis to shard
    per_row = _amax_op(x.ndim, rht)(x)
    # All entries are equal on one device; sharded, the max over shards. XLA's max
    # reduction across devices may drop NaN, so NaN (a non-finite input) is kept explicitly.
    return jnp.where(jnp.any(jnp.isnan(per_row)), _F32(jnp.nan), jnp.max(per_row))


# quantize and fake quantize ------------------------------------------------------------------


def _sr_shard_words(words, entries, local_shape):
    """Adds this shard's SR counter offset (axis 0 index * local elements / 8) to `words`."""
    names = _axes(entries[0])
    if not names:
        return words
    per_shard = math.prod(local_shape) // 8
    step = lax.axis_index(names).astype(jnp.uint32) * jnp.uint32(per_shard)
    low = words[2] + step
    high = words[3] + (low < step).astype(jnp.uint32)
    return jnp.stack([words[0], words[1], low, high])


def _any_bad(flag: jax.Array, names: tuple[str, ...]) -> jax.Array:
    return lax.pmax(flag.astype(_F32), names) > 0 if names else flag


@functools.cache
def _quantize_op(ndim: int, block_2d: bool, rht: bool, sr: bool):
    raw = _positional(
        kernels._call_quantize,  # noqa: SLF001
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=sr,
    )

    def layout(mesh, arg_shapes):
        x = arg_shapes[0]
        return _quantize_entries(mesh, x.sharding, x.shape, block_2d=block_2d, sr=sr)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        out = _named(mesh, layout(mesh, arg_shapes))
        return (out, out, _replicated(mesh))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        entries = layout(mesh, arg_shapes)
        names = _used_axes(entries)
        x_sharding, rep = _named(mesh, entries), _replicated(mesh)

        def lower(x, amax, words):
            if sr:
                words = _sr_shard_words(words, entries, x.shape)
            codes, scales, stored = raw(x, amax, words)
            bad = _any_bad(jnp.isnan(stored), names)
            return codes, scales, jnp.where(bad, _F32(jnp.nan), stored)

        return mesh, lower, (x_sharding, x_sharding, rep), (x_sharding, rep, rep)

    d = _dims(ndim)
    rule = f"{d} (s k), , w -> {d} (s h), {d} s, "
    return _wrap(raw, partition, infer, rule, k=_BLOCK, h=_BLOCK // 2)


def quantize_kernel(x, amax, words, *, block_2d: bool, rht: bool, stochastic_rounding: bool):
    """`kernels._call_quantize` with the sharding rule (public entry: `kernels.quantize_ffi`)."""
    op = _quantize_op(x.ndim - 1, block_2d, rht, stochastic_rounding)
    return tuple(op(x, amax, words))


@functools.cache
def _fake_quantize_op(ndim, block_2d, rht, sr, global_scale, dtype):
    raw = _positional(
        kernels._call_fake_quantize,  # noqa: SLF001
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=sr,
        global_scale=global_scale,
        dtype=dtype,
    )

    def layout(mesh, arg_shapes):
        x = arg_shapes[0]
        return _quantize_entries(mesh, x.sharding, x.shape, block_2d=block_2d, sr=sr)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return _named(mesh, layout(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        entries = layout(mesh, arg_shapes)
        names = _used_axes(entries)
        x_sharding, rep = _named(mesh, entries), _replicated(mesh)

        def lower(x, amax, words):
            if sr:
                words = _sr_shard_words(words, entries, x.shape)
            out = raw(x, amax, words)
            if not global_scale or not names or out.size == 0:
                return out
            # The kernel fills its shard with NaN when its input (or A) is not finite; one
            # such shard makes the whole tensor NaN, as on one device.
            bad = _any_bad(jnp.isnan(out.reshape(-1)[0]), names)
            return lax.cond(bad, lambda o: jnp.full_like(o, jnp.nan), lambda o: o, out)

        return mesh, lower, x_sharding, (x_sharding, rep, rep)

    d = _dims(ndim)
    return _wrap(raw, partition, infer, f"{d} c, , w -> {d} c")


def fake_quantize_kernel(
    x, amax, words, *, block_2d, rht, stochastic_rounding, global_scale, dtype
) -> jax.Array:
    """`kernels._call_fake_quantize` with the sharding rule (`kernels.fake_quantize_ffi`)."""
    op = _fake_quantize_op(
        x.ndim - 1, block_2d, rht, stochastic_rounding, global_scale, jnp.dtype(dtype)
    )
    return op(x, amax, words)


# dequantize and RHT --------------------------------------------------------------------------


@functools.cache
def _dequantize_op(ndim: int, rht: bool, dtype):
    raw = _positional(kernels._call_dequantize, rht=rht, dtype=dtype)  # noqa: SLF001

    def layout(mesh, arg_shapes):
        codes, scales = arg_shapes[0], arg_shapes[1]
        entries = _divisible(mesh, _entries(codes.sharding, ndim + 1), codes.shape)
        last = entries[-1]
        scales_last = _entries(scales.sharding, ndim + 1)[-1]
        if last is not None and (last != scales_last or scales.shape[-1] % _ways(mesh, last)):
            entries[-1] = None
        return entries

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return _named(mesh, layout(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        sharding = _named(mesh, layout(mesh, arg_shapes))
        return mesh, raw, sharding, (sharding, sharding, _replicated(mesh))

    d = _dims(ndim)
    rule = f"{d} (s h), {d} s,  -> {d} (s k)"
    return _wrap(raw, partition, infer, rule, k=_BLOCK, h=_BLOCK // 2)


def dequantize_kernel(codes, scales, amax, *, rht: bool, dtype) -> jax.Array:
    """`kernels._call_dequantize` with the sharding rule (`kernels.dequantize_ffi`)."""
    return _dequantize_op(codes.ndim - 1, rht, jnp.dtype(dtype))(codes, scales, amax)


@functools.cache
def _rht_op(ndim: int, inverse: bool):
    raw = _positional(kernels._call_rht, inverse=inverse)  # noqa: SLF001

    def layout(mesh, arg_shapes):
        x = arg_shapes[0]
        return _keep_last(mesh, _divisible(mesh, _entries(x.sharding, ndim + 1), x.shape), x.shape)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return _named(mesh, layout(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        sharding = _named(mesh, layout(mesh, arg_shapes))
        return mesh, raw, sharding, (sharding,)

    d = _dims(ndim)
    return _wrap(raw, partition, infer, f"{d} c -> {d} c")


def rht_kernel(x: jax.Array, *, inverse: bool) -> jax.Array:
    """`kernels._call_rht` with the sharding rule (public entry: `kernels.rht_ffi`)."""
    return _rht_op(x.ndim - 1, inverse)(x)
