"""The types a `custom_vjp`'s cotangents must have: the primals' sharding and varying axes.

JAX types carry more than shape and dtype. Under a mesh with Explicit axes
(`jax.make_mesh`'s default, used with `jax.set_mesh`) a value's sharding is part of its
type; inside `shard_map` its type says which mesh axes it varies over. A `custom_vjp`'s
backward must return each cotangent with its primal's type, and for the `jax.lax` ops JAX's
own transposes arrange that: a replicated (invariant) weight used with sharded activations
is implicitly broadcast to every shard in the forward, and the transpose of that broadcast
sums the shards' weight gradients. `PrimalTypes` records the primals' types in the forward
(as static data: a residual without arrays) and `conform` gives the backward's cotangents
those types the same way.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.sharding import PartitionSpec as P


def varying(value) -> frozenset:
    """The mesh axes `value` varies over inside `shard_map` (empty outside)."""
    return _aval_varying(jax.typeof(value))


def _aval_varying(aval) -> frozenset:
    manual = getattr(aval, "mat", None)  # JAX 0.10: ShapedArray.mat.varying
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def axis_names(entry) -> tuple[str, ...]:
    """The mesh axis names of one partition spec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def explicit_spec(aval):
    """The sharding of `aval` when its type names Explicit mesh axes, else None."""
    sharding = _sharding_of(aval)
    if sharding is None:
        return None
    explicit = set(sharding.mesh.explicit_axes)
    if any(explicit & set(axis_names(entry)) for entry in sharding.spec):
        return sharding
    return None


def spec_entries(value) -> list:
    """The partition spec entries of `value`'s type, one per dim (None where unsharded)."""
    aval = jax.typeof(value)
    spec = list(getattr(getattr(aval, "sharding", None), "spec", None) or ())
    return (spec + [None] * aval.ndim)[: aval.ndim]


def _sharding_of(aval):
    """The sharding a value of type `aval` has in its type (None where types hold none)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    return sharding


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PrimalTypes:
    """The avals of a custom_vjp's primal inputs, as a residual with no arrays.

    Attributes:
      avals: one `jax.typeof(primal)` per primal (None for a None primal).
    """

    avals: tuple

    @classmethod
    def of(cls, *primals) -> PrimalTypes:
        """The types of `primals` (in the forward of a custom_vjp)."""
        return cls(tuple(None if p is None else jax.typeof(p) for p in primals))

    def conform(self, *cotangents):
        """`cotangents`, each given the type of its primal; None stays None.

        A cotangent that varies over shard_map axes its primal does not vary over is summed
        over them (the transpose of the forward's implicit broadcast); one that varies over
        fewer is marked varying; one whose sharding differs from an Explicit-axis primal's
        is resharded to it.
        """
        return tuple(
            ct if ct is None or aval is None else _conform_one(ct, aval)
            for ct, aval in zip(cotangents, self.avals, strict=True)
        )


def _conform_one(ct, aval):
    want, have = _aval_varying(aval), varying(ct)
    extra, missing = tuple(sorted(have - want)), tuple(sorted(want - have))
    if extra:
        ct = lax.psum(ct, extra)
    if missing:
        ct = lax.pcast(ct, missing, to="varying")
    sharding = _sharding_of(aval)
    if sharding is not None and jax.typeof(ct).sharding.spec != sharding.spec:
        ct = jax.sharding.reshard(ct, sharding.spec)
    return ct


def whole_blocks(x, dims: tuple[int, ...], block: int = 16):
    """`x` resharded so that every shard of each of `dims` holds whole blocks of `block`.

    Only under Explicit mesh axes, whose types must state every sharding: a dim whose shards
    would split a block (e.g. 8 rows per device for 16x16 tiles) is gathered, as the native
    ops' sharding rules gather it under Auto axes. Elsewhere `x` itself.
    """
    sharding = explicit_spec(jax.typeof(x))
    if sharding is None:
        return x
    spec = spec_entries(x)
    split = False
    for d in dims:
        ways = 1
        for name in axis_names(spec[d]):
            ways *= sharding.mesh.shape[name]
        if x.shape[d] % (ways * block):
            spec[d], split = None, True
    if not split:
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, P(*spec)))


def leading_axis_like(value, like):
    """`value` with its leading axis sharded as `like`'s and the rest unsharded.

    Only under Explicit mesh axes (where mapping over the leading axis needs every operand
    sharded alike along it); elsewhere `value` itself.
    """
    sharding = explicit_spec(jax.typeof(like)) or explicit_spec(jax.typeof(value))
    if sharding is None:
        return value
    spec = [spec_entries(like)[0]] + [None] * (jax.typeof(value).ndim - 1)
    if spec_entries(value) == spec:
        return value
    return jax.sharding.reshard(value, jax.sharding.NamedSharding(sharding.mesh, P(*spec)))


def replicated(value):
    """`value` gathered onto every device where its type names Explicit mesh axes, else itself."""
    sharding = explicit_spec(jax.typeof(value))
    if sharding is None:
        return value
    return jax.sharding.reshard(value, jax.sharding.NamedSharding(sharding.mesh, P()))


def mesh_of(*values):
    """The mesh the values' types are on (the context's, under `jax.set_mesh`), or None.

    Read from the types rather than the context: a traced function's types are part of
    every trace cache's key (custom_vjp's, custom_vmap's), the context is not.
    """
    for value in jax.tree.leaves(values):
        mesh = getattr(getattr(jax.typeof(value), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return None


def has_explicit_axes(*values) -> bool:
    """Whether the values' types are on a mesh with Explicit axes (ops state their shardings)."""
    mesh = mesh_of(*values)
    return mesh is not None and bool(mesh.explicit_axes)
