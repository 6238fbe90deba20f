"""`restore_checkpoint`: what `save_checkpoint` saved, checked, then restored bit-exact.

It reads every format of `format` (1, 2 and 3).

`restore_checkpoint(path, target)` checks the digests, every JSON entry against itself,
against `validate_nvfp4_array` and against the arrays orbax stored, and the checkpoint
against `target` (a pytree of arrays, `jax.ShapeDtypeStruct`s, or NVFP4Arrays of either,
e.g. the state of `nnx.eval_shape(...)`), before reading any array; it raises a `ValueError`
naming the entry on a mismatch. Without a target it rebuilds nested dicts from the paths
(keys become strings).

Several processes (`jax.distributed`): `restore_checkpoint` only reads: every process calls
it, with a target whose leaves carry the shardings (a leaf without one is restored to the
process's first device).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core.array import NVFP4Array, is_nvfp4_array, validate_nvfp4_array
from nvfp4_jax._src.io.checkpoint.format import (
    DIGEST,
    FORMAT,
    FORMAT_V1,
    FORMAT_V2,
    PART_DTYPES,
    POINTER,
    abspath,
    check_layout,
    digest,
    entry_parts,
    key_dtype,
    named_leaves,
    nvfp4_meta,
    open_checkpointer,
    parts_of,
    read_pointer,
    unstorable,
)
from nvfp4_jax._src.io.durable import is_key_array


def restore_checkpoint(path: str | os.PathLike, target: Any = None) -> Any:
    """Restores what `save_checkpoint` saved, bit-exact.

    Args:
      path: the checkpoint directory.
      target: optional pytree with the structure, shapes and dtypes to restore into (leaves:
        arrays or `jax.ShapeDtypeStruct`s, shardings respected; NVFP4Arrays of either; typed
        PRNG keys). Its NVFP4 metadata must equal the saved one, and it must have a leaf for
        every entry of the checkpoint.

    Returns:
      A pytree like `target`, or, without a target, nested dicts keyed by path components
      (the leaf itself for a checkpoint of a single leaf).

    Raises:
      FileNotFoundError: `path` holds no complete checkpoint.
      ValueError: the checkpoint's metadata was edited after the save (format 3: its
        digests), the checkpoint is inconsistent (its metadata and its arrays disagree), or
        it and `target` disagree (missing entry, shape, dtype or NVFP4 metadata); the message
        names the entry.
    """
    path = abspath(path)
    snapshot = _find_snapshot(path)
    with open_checkpointer() as checkpointer:
        entries = _read_entries(checkpointer, snapshot)
        specs = _stored_specs(entries)
        _compare(specs, _stored_metadata(checkpointer, snapshot), "the stored array")
        named = None if target is None else named_leaves(target)
        abstract = None if named is None else _abstract_arrays(named, entries)
        arrays = _read_arrays(checkpointer, snapshot, specs, abstract)
    _compare(specs, {k: (v.shape, v.dtype) for k, v in arrays.items()}, "the array read")
    if named is None:
        return _nested(entries, arrays)
    by_key = {entry["key"]: entry for entry in entries}
    leaves = [_rebuild(by_key["/".join(names)], arrays) for _, names, _ in named]
    treedef = jax.tree_util.tree_structure(target, is_leaf=is_nvfp4_array)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _find_snapshot(path: str) -> str:
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise FileNotFoundError(f"restore_checkpoint: no checkpoint at {path}: it {what}")
    name = read_pointer(path)
    if name is not None:
        snapshot = os.path.join(path, name)
        if not os.path.isdir(snapshot):
            raise FileNotFoundError(
                f"restore_checkpoint: {path}/{POINTER} names {name}, which is missing"
            )
        return snapshot
    if os.path.isfile(os.path.join(path, "nvfp4", "metadata")):
        return path  # the first format: the orbax checkpoint is `path` itself
    raise FileNotFoundError(f"restore_checkpoint: no complete checkpoint at {path}")


def _read_entries(checkpointer, snapshot: str) -> list:
    import orbax.checkpoint as ocp  # noqa: PLC0415

    args = ocp.args.Composite(nvfp4=ocp.args.JsonRestore())
    meta = checkpointer.restore(snapshot, args).nvfp4
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, FORMAT_V2, FORMAT_V1):
        raise ValueError(f"restore_checkpoint: {snapshot} is not an nvfp4_jax checkpoint")
    entries = meta.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"restore_checkpoint: {snapshot} has no list of entries")
    _check_digests(meta, os.path.join(snapshot, "nvfp4", "metadata"))
    for entry in entries:
        _check_entry_head(entry)
    return [{k: v for k, v in entry.items() if k != DIGEST} for entry in entries]


def _check_digests(meta: dict, file: str) -> None:
    """Checks that the metadata is the one its save wrote (formats 1 and 2 have no digests)."""
    entries = meta["entries"]
    sealed = [isinstance(entry, dict) and DIGEST in entry for entry in entries]
    if meta["format"] != FORMAT:
        if any(sealed) or DIGEST in meta:
            raise ValueError(
                f"restore_checkpoint: {file} was edited: it has the digests of format "
                f"{FORMAT!r} but says {meta['format']!r}"
            )
        return
    edited = []
    for entry, has_digest in zip(entries, sealed, strict=True):
        if not has_digest:
            edited.append(_entry_name(entry))
        elif entry[DIGEST] != digest({k: v for k, v in entry.items() if k != DIGEST}):
            edited.append(_entry_name(entry))
    if edited:
        which = "entry" if len(edited) == 1 else "entries"
        raise ValueError(
            f"restore_checkpoint: the metadata of the {which} {', '.join(edited)} in {file} "
            "was edited after the save (it no longer matches the sha256 digest saved with it)"
        )
    if meta.get(DIGEST) != digest({k: v for k, v in meta.items() if k != DIGEST}):
        keys = [_entry_name(entry) for entry in entries]
        raise ValueError(
            f"restore_checkpoint: {file} was edited after the save: its entries ({len(keys)}: "
            f"{', '.join(keys[:10])}{', ...' if len(keys) > 10 else ''}) or its format are "
            "not the ones saved (an entry added, removed or moved?)"
        )


def _entry_name(entry) -> str:
    key = entry.get("key") if isinstance(entry, dict) else None
    return repr(key) if isinstance(key, str) else str(entry)[:200]


def _check_entry_head(entry) -> None:
    path = entry.get("path") if isinstance(entry, dict) else None
    if not isinstance(path, list) or not all(isinstance(name, str) for name in path):
        raise ValueError(f"restore_checkpoint: entry {str(entry)[:200]} has no valid path")
    if entry.get("key") != "/".join(path):
        raise ValueError(f"restore_checkpoint: entry {entry.get('key')!r} has path {path}")


def _stored_specs(entries: list) -> dict:
    """`{stored name: (shape, dtype name, entry key)}`; checks each entry is consistent."""
    specs, layout = {}, []
    for entry in entries:
        stored = _entry_specs(entry)
        layout.append((repr(entry["key"]), tuple(entry["path"]), [entry["key"], *stored]))
        specs.update({name: (*spec, entry["key"]) for name, spec in stored.items()})
    check_layout("restore_checkpoint", layout)
    return specs


def _entry_specs(entry: dict) -> dict:
    key, kind = entry["key"], entry.get("kind")
    if kind == "array":
        dtype = _dtype_field(entry, "array_dtype")
        if unstorable(dtype):
            raise _bad(key, f"array_dtype {dtype.name!r} is not a dtype orbax stores")
        return {key: (_shape_field(entry, "shape"), dtype.name)}
    if kind == "key":
        data_shape = _shape_field(entry, "shape") + _key_data_shape(entry)
        return {key: (data_shape, "uint32")}
    if kind == "nvfp4":
        _abstract_nvfp4(entry)  # checks the metadata, `shapes` included
        shapes = entry["shapes"]
        return {
            f"{key}/{p}": (_shape_field(shapes, p, key), PART_DTYPES[p])
            for p in entry_parts(shapes)
        }
    raise _bad(key, f"unknown kind {kind!r}")


def _abstract_nvfp4(entry: dict) -> NVFP4Array:
    """The NVFP4Array of `jax.ShapeDtypeStruct`s the entry describes, validated."""
    key, shapes = entry["key"], entry.get("shapes")
    if not isinstance(shapes, dict):
        raise _bad(key, f"shapes {shapes!r} is not a dict")
    parts = {
        p: jax.ShapeDtypeStruct(_shape_field(shapes, p, key), jnp.dtype(PART_DTYPES[p]))
        for p in entry_parts(shapes)
    }
    q = _validated(key, lambda: _nvfp4_array(entry, parts))
    if "shape" in entry and _shape_field(entry, "shape") != q.shape:  # format 1 has no shape
        raise _bad(key, f"the logical shape {entry['shape']} does not fit the parts {shapes}")
    return q


def _nvfp4_array(entry: dict, parts: dict) -> NVFP4Array:
    """The NVFP4Array of `parts` with the entry's static metadata (`NVFP4Array._to_metadata`).

    Checked by the caller (`validate_nvfp4_array`); an entry without `four_over_six` is a
    plain NVFP4 array (e4m3_max 448).
    """
    return NVFP4Array._from_metadata({**entry, "dtype": _dtype_field(entry, "dtype")}, **parts)


def _validated(key: str, make) -> NVFP4Array:
    """`validate_nvfp4_array(make())`, its errors as a `ValueError` naming the entry."""
    try:
        return validate_nvfp4_array(make(), f"restore_checkpoint: entry {key!r}")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e} (the checkpoint's metadata and arrays disagree)") from e


def _key_data_shape(entry: dict) -> tuple[int, ...]:
    impl = entry.get("impl")
    try:
        return _key_data_trailing_shape(impl)
    except (TypeError, ValueError):
        raise _bad(entry["key"], f"impl {impl!r} is not a PRNG implementation") from None


@functools.cache
def _key_data_trailing_shape(impl: str) -> tuple[int, ...]:
    if not isinstance(impl, str):
        raise TypeError(impl)
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape


def _shape_field(fields: dict, name: str, key: str | None = None) -> tuple[int, ...]:
    value = fields.get(name)
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise _bad(key or fields["key"], f"{name} {value!r} is not a shape")
    return tuple(value)


def _dtype_field(entry: dict, name: str) -> np.dtype:
    value = entry.get(name)
    try:
        if isinstance(value, str):
            return jnp.dtype(value)
    except TypeError:
        pass
    raise _bad(entry["key"], f"{name} {value!r} is not a dtype")


def _bad(key: str, what: str) -> ValueError:
    return ValueError(f"restore_checkpoint: entry {key!r}: {what}")


def _stored_metadata(checkpointer, snapshot: str) -> dict:
    """`{stored name: (shape, dtype)}` from orbax's own record of the arrays it stored."""
    items = checkpointer.metadata(snapshot).item_metadata or {}
    stored = items["arrays"] if "arrays" in items else None
    return {} if stored is None else {k: (v.shape, v.dtype) for k, v in stored.items()}


def _compare(specs: dict, found: dict, what: str) -> None:
    """Checks that `found` (`{name: (shape, dtype)}`) holds exactly the arrays of `specs`."""
    for name, (shape, dtype, key) in specs.items():
        if name not in found:
            raise _bad(key, f"the checkpoint has no stored array {name!r}")
        got = (tuple(found[name][0]), jnp.dtype(found[name][1]).name)
        if got != (shape, dtype):
            raise _bad(
                key,
                f"the metadata gives {name!r} (shape, dtype) {(shape, dtype)}, {what} has {got}",
            )
    extra = sorted(set(found) - set(specs))
    if extra:
        raise ValueError(f"restore_checkpoint: stored arrays {extra[:5]} belong to no entry")


def _read_arrays(checkpointer, snapshot: str, specs: dict, abstract) -> dict:
    import orbax.checkpoint as ocp  # noqa: PLC0415

    if not specs:
        return {}
    args = ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
    return dict(checkpointer.restore(snapshot, args).arrays)


def _abstract_arrays(named, entries) -> dict:
    """The orbax restore target; checks every target leaf against the saved entry first."""
    by_key = {entry["key"]: entry for entry in entries}
    abstract = {}
    for _, names, leaf in named:
        key = "/".join(names)
        if key not in by_key:
            raise ValueError(f"restore_checkpoint: the checkpoint has no entry {key!r}")
        abstract.update(_abstract_leaf(key, by_key[key], leaf))
    unused = sorted(set(by_key) - {"/".join(names) for _, names, _ in named})
    if unused:
        raise ValueError(f"restore_checkpoint: the target has no leaf for the entries {unused}")
    return abstract


def _abstract_leaf(key: str, entry: dict, leaf) -> dict:
    if is_nvfp4_array(leaf):
        _check_nvfp4_entry(key, entry, leaf)
        return {f"{key}/{part}": _abstract(getattr(leaf, part)) for part in parts_of(leaf)}
    if is_key_array(leaf):
        _check_key_entry(key, entry, leaf)
        data = jax.eval_shape(jax.random.key_data, leaf)
        return {key: _abstract(leaf, data.shape, data.dtype)}
    found = (entry.get("kind"), tuple(entry.get("shape", ())), entry.get("array_dtype"))
    wanted = ("array", tuple(leaf.shape), jnp.dtype(leaf.dtype).name)
    if found != wanted:
        raise ValueError(
            f"restore_checkpoint: {key!r} was saved as (kind, shape, dtype) {found}, "
            f"the target wants {wanted}"
        )
    if isinstance(leaf, (np.ndarray, np.generic)):
        return {key: np.asarray(leaf)}  # restored as NumPy, keeping a 64-bit dtype
    return {key: _abstract(leaf)}


def _check_key_entry(key, entry, leaf):
    found = (entry.get("kind"), tuple(entry.get("shape", ())), entry.get("impl"))
    if found[0] != "key" or found[1] != tuple(leaf.shape) or key_dtype(found[2]) != leaf.dtype:
        raise ValueError(
            f"restore_checkpoint: {key!r} was saved as (kind, shape, impl) {found}, the "
            f"target wants a key of shape {tuple(leaf.shape)} and dtype {leaf.dtype}"
        )


def _check_nvfp4_entry(key, entry, leaf):
    validate_nvfp4_array(leaf, f"restore_checkpoint target {key!r}")
    if entry.get("kind") != "nvfp4":
        raise ValueError(f"restore_checkpoint: {key!r} was saved as {entry.get('kind')}, not NVFP4")
    wanted = nvfp4_meta(leaf)
    # A Four Over Six entry against a plain target (or the reverse) differs too.
    names = [*wanted, *(name for name in NVFP4Array._FOUR_OVER_SIX_FIELDS if name in entry)]
    found = {name: entry.get(name) for name in names}
    wanted = {name: wanted.get(name) for name in names}
    if found != wanted:
        raise ValueError(
            f"restore_checkpoint: NVFP4 entry {key!r} was saved with {found}, the target "
            f"wants {wanted}"
        )


def _abstract(leaf, shape=None, dtype=None) -> jax.ShapeDtypeStruct:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:  # on this process's first device (with several processes, its own)
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shape = leaf.shape if shape is None else shape
    return jax.ShapeDtypeStruct(shape, leaf.dtype if dtype is None else dtype, sharding=sharding)


def _rebuild(entry, arrays):
    key = entry["key"]
    if entry["kind"] == "array":
        return arrays[key]
    if entry["kind"] == "key":
        return jax.random.wrap_key_data(arrays[key], impl=entry["impl"])
    parts = {part: arrays[f"{key}/{part}"] for part in entry_parts(entry["shapes"])}
    return _validated(key, lambda: _nvfp4_array(entry, parts))


def _nested(entries, arrays):
    """Nested dicts from the saved paths (no target to give the original containers)."""
    if len(entries) == 1 and not entries[0]["path"]:
        return _rebuild(entries[0], arrays)  # the tree was a single leaf
    root: dict = {}
    for entry in entries:
        *parents, last = entry["path"]  # not empty: `check_layout` allows that only alone
        node = root
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = _rebuild(entry, arrays)
    return root
