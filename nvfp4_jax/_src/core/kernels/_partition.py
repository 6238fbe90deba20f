"""What the sharding rules of the custom calls share.

The FFI custom calls are opaque to XLA's SPMD partitioner, which would all-gather their
operands. Each target's module wraps its `ffi_call` in a `custom_partitioning` rule that
runs the kernel on each device's shard instead; these are the pieces the rules share.
Blockwise quantization shards along any axis in multiples of 16; only the tensor amax is
global, and stochastic rounding needs each shard's counter offset (`SRSeed.advance`).

Axes whose size is not divisible by their mesh axes, and anything a rule does not
recognise, are replicated (XLA gathers them): correct, only slower. On one device the rules
are not used. Under `vmap` the raw call runs (one call per example), without the rule.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import sharding_impls  # parse_flatten_op_sharding: see `decoded`
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax._src.core import formats, primal_types

_F32 = jnp.float32
# SR counters of a partitioned tensor are 32-bit offsets here: fewer than 2**35 elements.
MAX_SR_COUNTERS = 2**32


def entries(sharding, ndim: int) -> list:
    """The partition spec entries of `sharding`, one per dim (None for a replicated dim)."""
    if not isinstance(sharding, NamedSharding):
        return [None] * ndim
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    return spec[:ndim]


def axes(entry) -> tuple[str, ...]:
    """The mesh axis names of one spec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def ways(mesh, entry) -> int:
    """How many shards one spec entry makes."""
    return math.prod(mesh.shape[a] for a in axes(entry))


def used_axes(spec_entries) -> tuple[str, ...]:
    """Every mesh axis a spec uses."""
    return tuple(a for e in spec_entries for a in axes(e))


def divisible(mesh, spec_entries, shape) -> list:
    """Drops the sharding of dims whose size the mesh axes do not divide."""
    pairs = zip(spec_entries, shape, strict=True)
    return [e if e is None or n % ways(mesh, e) == 0 else None for e, n in pairs]


def keep_whole_blocks(
    mesh, spec_entries, shape, dim: int = -1, block: int = formats.BLOCK_SIZE
) -> list:
    """Keeps `dim` sharded only when every shard holds whole blocks (of `block`) of it."""
    if spec_entries and spec_entries[dim] is not None:
        if (shape[dim] // ways(mesh, spec_entries[dim])) % block:
            spec_entries[dim] = None
    return spec_entries


def blockwise_entries(mesh, sharding, shape, block: int = formats.BLOCK_SIZE) -> list:
    """The sharding a blockwise op keeps: divisible dims, the last one in whole blocks.

    `block`: 16 (NVFP4's blocks), or MS-EDEN's 128-element rotation groups.
    """
    spec_entries = divisible(mesh, entries(sharding, len(shape)), shape)
    return keep_whole_blocks(mesh, spec_entries, shape, block=block)


def named(mesh, spec_entries) -> NamedSharding:
    """A NamedSharding of `mesh` with these spec entries."""
    return NamedSharding(mesh, P(*spec_entries))


def replicated(mesh) -> NamedSharding:
    """The replicated sharding of `mesh`."""
    return NamedSharding(mesh, P())


def dims(ndim: int) -> str:
    """Shardy factor names of `ndim` leading dims: "d0 d1 ..."."""
    return " ".join(f"d{i}" for i in range(ndim))


def pmax_keep_nan(local: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """`lax.pmax` over `names` that gives NaN when any device's value is NaN.

    XLA's max reduction may drop NaN (docs/NUMERICS.md section 8), so NaN is carried as a
    separate flag.
    """
    if not names:
        return local
    bad = lax.pmax(jnp.isnan(local).astype(_F32), names)
    top = lax.pmax(jnp.where(jnp.isnan(local), _F32(0), local), names)
    return jnp.where(bad > 0, _F32(jnp.nan), top)


def any_device(flag: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """True on every device when `flag` is True on any device of `names`."""
    return lax.pmax(flag.astype(_F32), names) > 0 if names else flag


def vary_like(outputs, *inputs):
    """`outputs` marked as varying over every mesh axis any of `inputs` varies over.

    Inside `shard_map`, JAX tracks which mesh axes a value varies over, to reject a result
    that differs between shards but is returned as replicated. A custom call's results
    claim to vary over nothing, which would defeat that check; this restores what jnp code
    would have: the results vary wherever the operands do. Outside `shard_map`, a no-op.
    """
    axes = frozenset().union(*(primal_types.varying(a) for a in jax.tree.leaves(inputs)))

    def mark(out):
        missing = tuple(sorted(axes - primal_types.varying(out)))
        return lax.pcast(out, missing, to="varying") if missing else out

    return jax.tree.map(mark, outputs)


def positional(fn, **static):
    """`fn` with `static` bound, called with positional arguments only.

    `custom_partitioning` cannot resolve keyword arguments, so no `functools.partial`.
    """

    def call(*args):
        return fn(*args, **static)

    return call


def explicit_mesh(operands):
    """The mesh of the operands' types when any is sharded over an Explicit axis, else None.

    Under a mesh with Explicit axes (`jax.make_mesh`'s default; `jax.set_mesh`) the sharding
    is part of each value's type, and XLA does not run a custom partitioner as it does for
    Auto axes: it would run the kernel on each shard and call the result global.
    """
    for operand in jax.tree.leaves(operands):
        sharding = primal_types.explicit_spec(jax.typeof(operand))
        if sharding is not None:
            return sharding.mesh
    return None


def whole_under_explicit_axes() -> bool:
    """Whether operands sharded over no Explicit axis (`explicit_mesh` None) are whole here.

    True under a context mesh whose axes are all Explicit (or Manual, inside `shard_map`):
    the operands' types say they are replicated, so the kernel runs on them as they are. A
    custom partitioning rule would have nothing to split, and on jax 0.12 (Shardy) its
    lowering under such a mesh leaves a `Sharding` custom call that XLA's CPU backend cannot
    run ("No registered implementation for untyped custom call to Sharding for Host").
    """
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and not mesh.auto_axes and bool(mesh.explicit_axes)


def _explicit_call(partition, mesh, args):
    """The partition rule run as a `shard_map` over the Explicit axes of `mesh`.

    The same rule decides the shardings and the per-shard computation as under Auto axes
    (where XLA calls it through `custom_partitioning`): the operands are resharded to the
    shardings it asks for, its per-shard function runs in `shard_map`, and the results carry
    the shardings it gives them in their types.
    """
    manual = set(mesh.explicit_axes)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.typeof(a).sharding) for a in args]
    _, lower, out_shardings, in_shardings = partition(mesh, shapes, None)
    in_specs = tuple(_manual_spec(s, manual) for s in in_shardings)
    out_specs = jax.tree.map(lambda s: _manual_spec(s, manual), out_shardings)
    args = [
        jax.sharding.reshard(a, NamedSharding(mesh, spec))
        for a, spec in zip(args, in_specs, strict=True)
    ]
    mapped = jax.shard_map(
        lower,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=manual,
        check_vma=False,  # the rule makes replicated results equal on every shard
    )
    return mapped(*args)


def _explicit_vmap(raw, mesh, in_axes, args):
    """`jax.vmap(raw, in_axes)(*args)` with the batch axis sharded over Explicit mesh axes.

    The examples are independent: each device runs `raw` on the whole examples it holds
    (`shard_map` over the batch axis's mesh axes; every other dim gathered), and the results
    stay sharded along the batch axis.
    """
    first = next(a for a, axis in zip(args, in_axes, strict=True) if axis == 0)
    batch = primal_types.spec_entries(first)[0]
    manual = set(axes(batch))
    if not manual:  # sharded, but not along the batch axis: gather, one device's loop
        specs = [P() for _ in args]
        manual = set(mesh.explicit_axes)
    else:
        specs = [P(batch) if axis == 0 else P() for axis in in_axes]
    args = [
        jax.sharding.reshard(a, NamedSharding(mesh, spec))
        for a, spec in zip(args, specs, strict=True)
    ]
    out_spec = P(batch) if axes(batch) else P()
    mapped = jax.shard_map(
        jax.vmap(raw, in_axes=in_axes),
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=out_spec,  # a prefix of every result: the batch axis
        axis_names=manual,
        check_vma=False,
    )
    return mapped(*args)


def _manual_spec(sharding, manual: set) -> P:
    """`sharding`'s spec, keeping only the axes `shard_map` makes manual."""
    kept = []
    for entry in sharding.spec:
        names = tuple(a for a in axes(entry) if a in manual)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*kept)


def decoded(rule_fn):
    """`rule_fn(mesh, arg_shapes, result_shape)`, given the operands as `NamedSharding`s.

    JAX would decode the shardings XLA hands a rule itself (`decode_shardings=True`), but
    raises before the rule runs where XLA's propagation sharded an operand or a result over
    part of a mesh axis. Shardy splits an axis into sub-axes where it shards a dim in pieces
    smaller than the axis: x's last dim in shards of fewer than 16 values gives the 16-blocks
    (the scales' last dim) a sub-axis. No `NamedSharding` says that, so such an operand is
    taken as replicated: the rule asks for it gathered where it would shard it, and XLA
    reshards it (correct, only slower; the rules shard only whole blocks anyway). The rules
    ignore the shardings proposed for their results.
    """

    def call(mesh, arg_shapes, result_shape):
        return rule_fn(mesh, [_as_named(mesh, a) for a in arg_shapes], result_shape)

    return call


def _as_named(mesh, shape):
    sharding = shape.sharding
    if isinstance(sharding, NamedSharding) or mesh is None or mesh.empty:
        return shape
    try:
        spec = sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0]
    except (ValueError, AttributeError):  # IndivisibleError is a ValueError
        spec = P()
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec))


def with_rule(raw, partition, infer, rule: str, **rule_options):
    """`raw` with a custom partitioning rule; under `vmap`, `raw` itself runs per example.

    Under a mesh with Explicit axes the same rule runs through `shard_map` instead
    (`explicit_mesh`). Under Auto axes XLA calls the rule with the operands' shardings
    (`decoded`).

    The wrapper is an inlined `jax.jit`: the same graph, traced once per operand shape
    instead of at every call (a model calls each kernel with a few shapes many times).
    """
    partitioned = custom_partitioning(raw)
    partitioned.def_partition(
        partition=decoded(partition),
        infer_sharding_from_operands=decoded(infer),
        decode_shardings=False,
        sharding_rule=rule,
        **rule_options,
    )

    @custom_vmap
    def call(*args):
        mesh = explicit_mesh(args)
        if mesh is not None:
            return _explicit_call(partition, mesh, args)
        if whole_under_explicit_axes():
            return raw(*args)
        return partitioned(*args)

    @call.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        del axis_size
        in_axes = tuple(0 if b else None for b in in_batched)
        mesh = explicit_mesh([a for a, b in zip(args, in_batched, strict=True) if b])
        if mesh is None:
            out = jax.vmap(raw, in_axes=in_axes)(*args)
        else:
            out = _explicit_vmap(raw, mesh, in_axes, args)
        return out, jax.tree.map(lambda _: True, out)

    return jax.jit(call, inline=True)
