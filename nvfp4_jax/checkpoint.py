"""Saving and restoring NVFP4Arrays (and pytrees or Flax nnx states holding them) with orbax.

Orbax saves array leaves; an `NVFP4Array`'s static metadata (dtype, axis, block_2d, rht) is
not a leaf. So a checkpoint has two items (an orbax `Composite`):

* `arrays`: a flat `{name: array}` dict. A plain leaf at path `a/b` is saved as `a/b`; an
  `NVFP4Array` at `a/w` as `a/w/codes` (uint8), `a/w/scales` (float8_e4m3fn), `a/w/amax` (f32).
  The bytes are saved as they are: restoring is bit-exact.
* `nvfp4`: JSON, one entry per leaf in flattening order: its path, kind ("array" or
  "nvfp4"), shapes and dtypes, and for NVFP4 leaves the static metadata.

`restore_checkpoint(path, target)` checks the JSON against `target` (a pytree of arrays,
`jax.ShapeDtypeStruct`s, or NVFP4Arrays of either, e.g. the state of `nnx.eval_shape(...)`)
before reading any array, and raises a `ValueError` naming the entry on a mismatch; without a
target it rebuilds nested dicts from the paths. Every restored `NVFP4Array` passes
`validate_nvfp4_array`.

Example (an nnx model):
    save_checkpoint(path, nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Model(...)))
    model = nnx.merge(graphdef, restore_checkpoint(path, abstract))
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_jax.array import NVFP4Array, is_nvfp4_array, validate_nvfp4_array

FORMAT = "nvfp4_jax.checkpoint/1"
_PARTS = ("codes", "scales", "amax")


def save_checkpoint(path: str | os.PathLike, tree: Any, *, force: bool = False) -> None:
    """Saves a pytree (NVFP4Arrays, arrays, an nnx state) to the orbax checkpoint `path`.

    Args:
      path: a directory; it must not exist unless `force`.
      tree: any pytree whose leaves are arrays; NVFP4Arrays keep their static metadata.
      force: overwrite an existing checkpoint.
    """
    import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy, and only needed here)

    arrays, entries = {}, []
    for names, leaf in _named_leaves(tree):
        key = "/".join(names)
        if is_nvfp4_array(leaf):
            validate_nvfp4_array(leaf, key)
            arrays.update({f"{key}/{part}": getattr(leaf, part) for part in _PARTS})
        else:
            arrays[key] = jnp.asarray(leaf)
        entries.append(_entry(names, leaf if is_nvfp4_array(leaf) else arrays[key]))
    if len({e["key"] for e in entries}) != len(entries):
        raise ValueError("save_checkpoint: two leaves map to the same name (a '/' in a key?)")
    meta = {"format": FORMAT, "entries": entries}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            os.path.abspath(path),
            ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), nvfp4=ocp.args.JsonSave(meta)),
            force=force,
        )


def restore_checkpoint(path: str | os.PathLike, target: Any = None) -> Any:
    """Restores what `save_checkpoint` saved, bit-exact.

    Args:
      path: the checkpoint directory.
      target: optional pytree with the structure, shapes and dtypes to restore into (leaves:
        arrays or `jax.ShapeDtypeStruct`s, shardings respected; NVFP4Arrays of either). Its
        NVFP4 metadata must equal the saved one.

    Returns:
      A pytree like `target`, or, without a target, nested dicts keyed by path components.

    Raises:
      ValueError: the checkpoint and `target` disagree (missing entry, shape, dtype or NVFP4
        metadata); the message names the entry.
    """
    import orbax.checkpoint as ocp  # noqa: PLC0415

    path = os.path.abspath(path)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        meta = checkpointer.restore(path, ocp.args.Composite(nvfp4=ocp.args.JsonRestore())).nvfp4
        if meta.get("format") != FORMAT:
            raise ValueError(f"restore_checkpoint: {path} is not an nvfp4_jax checkpoint")
        saved = {e["key"]: e for e in meta["entries"]}
        if target is None:
            abstract = None
        else:
            named = _named_leaves(target)
            abstract = _abstract_arrays(named, saved)
        arrays = checkpointer.restore(
            path, ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
        ).arrays
    if target is None:
        return _nested(meta["entries"], arrays)
    leaves = [_rebuild(saved["/".join(names)], arrays) for names, _ in named]
    treedef = jax.tree_util.tree_structure(target, is_leaf=is_nvfp4_array)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _named_leaves(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_nvfp4_array)
    return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in flat]


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _entry(names, leaf) -> dict:
    entry = {"key": "/".join(names), "path": list(names)}
    if is_nvfp4_array(leaf):
        entry.update(
            kind="nvfp4",
            dtype=jnp.dtype(leaf.dtype).name,
            axis=leaf.axis,
            block_2d=leaf.block_2d,
            rht=leaf.rht,
            shapes={part: list(getattr(leaf, part).shape) for part in _PARTS},
        )
    else:
        entry.update(kind="array", shape=list(leaf.shape), array_dtype=jnp.dtype(leaf.dtype).name)
    return entry


def _abstract_arrays(named, saved) -> dict:
    """The orbax restore target; checks every target leaf against the saved entry first."""
    abstract = {}
    for names, leaf in named:
        key = "/".join(names)
        entry = saved.get(key)
        if entry is None:
            raise ValueError(f"restore_checkpoint: the checkpoint has no entry {key!r}")
        if is_nvfp4_array(leaf):
            _check_nvfp4_entry(key, entry, leaf)
            abstract.update({f"{key}/{part}": _abstract(getattr(leaf, part)) for part in _PARTS})
        else:
            found = (entry.get("kind"), tuple(entry.get("shape", ())), entry.get("array_dtype"))
            wanted = ("array", tuple(leaf.shape), jnp.dtype(leaf.dtype).name)
            if found != wanted:
                raise ValueError(
                    f"restore_checkpoint: {key!r} was saved as (kind, shape, dtype) {found}, "
                    f"the target wants {wanted}"
                )
            abstract[key] = _abstract(leaf)
    return abstract


def _check_nvfp4_entry(key, entry, leaf):
    validate_nvfp4_array(leaf, f"restore_checkpoint target {key!r}")
    if entry.get("kind") != "nvfp4":
        raise ValueError(f"restore_checkpoint: {key!r} was saved as a plain array, not NVFP4")
    wanted = {
        "dtype": jnp.dtype(leaf.dtype).name,
        "axis": leaf.axis,
        "block_2d": leaf.block_2d,
        "rht": leaf.rht,
        "shapes": {part: list(getattr(leaf, part).shape) for part in _PARTS},
    }
    found = {name: entry.get(name) for name in wanted}
    if found != wanted:
        raise ValueError(
            f"restore_checkpoint: NVFP4 entry {key!r} was saved with {found}, the target "
            f"wants {wanted}"
        )


def _abstract(leaf) -> jax.ShapeDtypeStruct:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _rebuild(entry, arrays):
    key = entry["key"]
    if entry["kind"] != "nvfp4":
        return arrays[key]
    q = NVFP4Array(
        **{part: arrays[f"{key}/{part}"] for part in _PARTS},
        dtype=jnp.dtype(entry["dtype"]),
        axis=int(entry["axis"]),
        block_2d=bool(entry["block_2d"]),
        rht=bool(entry["rht"]),
    )
    return validate_nvfp4_array(q, f"restored {key!r}")


def _nested(entries, arrays) -> dict:
    """Nested dicts from the saved paths (no target to give the original containers)."""
    root: dict = {}
    for entry in entries:
        *parents, last = entry["path"] or [""]
        node = root
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = _rebuild(entry, arrays)
    return root
