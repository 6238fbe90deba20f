"""Saving and restoring NVFP4Arrays (and pytrees or Flax nnx states holding them) with orbax.

On-disk layout (format `nvfp4_jax.checkpoint/3`). `path` is a directory:

    path/
      CURRENT                 one line: the name of the current snapshot
      snapshot-000007/        the current snapshot, an orbax `Composite` checkpoint:
        arrays/               a flat `{name: array}` dict (orbax `StandardSave`)
        nvfp4/metadata        JSON: the format, one entry per leaf, digests
        ...                   orbax's own bookkeeping files
      snapshot-000006/, snapshot-000008.orbax-checkpoint-tmp-*/, CURRENT.tmp
                              leftovers of an interrupted save, removed by the next save

Inside a snapshot, a plain leaf at path `a/b` is stored as `a/b`; an `NVFP4Array` at `a/w` as
`a/w/codes` (uint8), `a/w/scales` (float8_e4m3fn), `a/w/amax` (f32) and, when it has one,
`a/w/decode_scale` (f32); a typed PRNG key array
(an nnx rng stream's key) as its `jax.random.key_data` (uint32) under its own name. The bytes
are stored as they are: restoring is bit-exact. NumPy leaves stay NumPy (a float64 stays
float64, a bfloat16 one a NumPy bfloat16 array) unless the target gives a jax leaf for them.
The JSON entry of a leaf holds its path, kind ("array", "nvfp4" or "key"), shapes
and dtypes, the static metadata of an NVFP4 leaf (dtype, axis, block_2d, rht, logical shape)
and the implementation of a key (e.g. "threefry2x32"). Every stored name belongs to exactly
one leaf: `save_checkpoint` raises before writing anything if two leaves would share one
(a "/" in a dict key, a plain leaf at `w/codes` beside an NVFP4Array at `w`).

Dtypes: a plain leaf may have any boolean or numeric dtype that tensorstore (orbax's writer)
stores: NumPy's, and those of ml_dtypes that JAX uses, bfloat16, float8_e4m3fn, float8_e5m2,
float8_e4m3fnuz, float8_e5m2fnuz, float8_e4m3b11fnuz, float8_e3m4, float8_e8m0fnu,
float4_e2m1fn, int4 and int2 (NumPy calls their kind "V", like a structured dtype's), every
bit pattern kept (NaN payloads, negative zeros). Others (ml_dtypes' float8_e4m3, float6_*,
int1, uint1/2/4; object, string, structured, void or datetime dtypes) are a `TypeError`
naming the leaf and its dtype, raised before anything is written.

Edited metadata (format 3): each entry carries `digest`, the sha256 of the canonical JSON
(sorted keys, no spaces, ASCII) of the rest of the entry, and the metadata a `digest` of the
canonical JSON of its format and entries (theirs included). `restore_checkpoint` recomputes
them before using anything: an entry whose fields were changed (any field: dtype, axis,
block_2d, rht, shapes, kind, impl, path...) or that lost its digest is a `ValueError` naming
the entry (all such entries) and the file; entries added, removed, duplicated or reordered,
or a changed format, are a `ValueError` naming the file; so is a format-1/2 header on metadata
that has digests. The digests catch edits and corruption, not forgery: whoever edits the file
can recompute them. Formats 1 and 2 have no digests: there only edits that make the metadata
inconsistent (with itself, `validate_nvfp4_array` or the stored arrays) are caught.

Atomicity: a save never touches the current snapshot nor `CURRENT` until its very end. It
writes a new snapshot under a fresh name (orbax writes it into a temporary directory and
renames it into place once complete), fsyncs every file and directory of it and `path`,
writes the new name into `CURRENT.tmp`, fsyncs it and `os.replace`s it over `CURRENT` (an
atomic rename on POSIX: Linux and macOS), and fsyncs `path`. Until that replace `CURRENT` names
the old, complete snapshot; after it, the new, complete one. Only then are other snapshots
deleted. So a crash at any point (an exception, SIGKILL, power loss) leaves the old or the new
checkpoint, whole. One program saves to a `path` at a time. A forced save replaces the
checkpoint only: other files in `path` stay.

Several processes (`jax.distributed`, `jax.process_count() > 1`): every process calls
`save_checkpoint` with the same `path` and tree (global jax.Arrays, sharded as they are; NumPy
leaves are written by process 0) on a file system they share. Process 0 alone creates and
checks `path`, picks the snapshot name, removes leftovers, writes `CURRENT` and removes the
old snapshot; orbax writes the snapshot, each process its shards, then every process fsyncs
the snapshot; collectives (`jax.experimental.multihost_utils.process_allgather`) separate
these steps and give every process the snapshot name of process 0. `CURRENT` is replaced only
after all processes have written and flushed their shards, and no process returns before it
is, so a process killed at any point leaves the old or the new checkpoint, whole. An error of
one process in these steps (e.g. process 0's `FileExistsError`) is raised on every process,
with the same type; an error inside orbax's own writing is orbax's to handle (its barriers
time out). `restore_checkpoint` only reads: every process calls it, with a target whose
leaves carry the shardings (a leaf without one is restored to the process's first device).
With one process, none of this happens: the save is the one described above.

The first format, `nvfp4_jax.checkpoint/1` (the orbax `Composite` at `path` itself, no
`CURRENT`), and the second (this layout, no digests) are still restored; a forced save over
them writes format 3, atomically as above.

`restore_checkpoint(path, target)` checks the digests, every JSON entry against itself,
against `validate_nvfp4_array` and against the arrays orbax stored, and the checkpoint
against `target` (a pytree of arrays, `jax.ShapeDtypeStruct`s, or NVFP4Arrays of either,
e.g. the state of `nnx.eval_shape(...)`), before reading any array; it raises a `ValueError`
naming the entry on a mismatch. Without a target it rebuilds nested dicts from the paths
(keys become strings).

Example (an nnx model):
    save_checkpoint(path, nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Model(...)))
    model = nnx.merge(graphdef, restore_checkpoint(path, abstract))
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core.array import NVFP4Array, is_nvfp4_array, validate_nvfp4_array
from nvfp4_jax._src.io.storage import (
    collective,
    fsync_fd,
    fsync_path,
    fsync_tree,
    is_key_array,
    key_name,
)

FORMAT = "nvfp4_jax.checkpoint/3"
FORMAT_V2 = "nvfp4_jax.checkpoint/2"
FORMAT_V1 = "nvfp4_jax.checkpoint/1"
_DIGEST = "digest"  # the field of each entry, and of the whole metadata, holding its digest
POINTER = "CURRENT"
_POINTER_TMP = "CURRENT.tmp"
_SNAPSHOT = re.compile(r"snapshot-([0-9]+)")
# A snapshot, or the temporary directory orbax writes one into: the names a save may remove.
_SNAPSHOT_OR_TMP = re.compile(r"snapshot-[0-9]+(\.orbax-checkpoint-tmp.*)?")
# What the first format wrote at `path`; `nvfp4` (its JSON) last, as the marker.
_V1_ITEMS = ("arrays", "_CHECKPOINT_METADATA", "_METADATA", "commit_success.txt", "nvfp4")
_PARTS = ("codes", "scales", "amax")
# `decode_scale` is an optional fourth part (None in most NVFP4Arrays): stored when present.
_PART_DTYPES = {
    "codes": "uint8",
    "scales": "float8_e4m3fn",
    "amax": "float32",
    "decode_scale": "float32",
}


# --- save ----------------------------------------------------------------------------------


def save_checkpoint(path: str | os.PathLike, tree: Any, *, force: bool = False) -> None:
    """Saves a pytree (NVFP4Arrays, arrays, PRNG keys, an nnx state) to the checkpoint `path`.

    The save is atomic: whatever happens during it, `path` afterwards holds the old checkpoint
    or the new one, complete (see the module docstring).

    Args:
      path: a directory; relative paths are taken relative to the current directory now.
      tree: any pytree whose leaves are arrays (jax, NumPy or Python scalars) or typed PRNG
        key arrays; NVFP4Arrays keep their static metadata.
      force: replace an existing checkpoint at `path`.

    Raises:
      FileExistsError: `path` is not a directory, or (without `force`) already holds a
        checkpoint or other files.
      ValueError: two leaves would be stored under the same name (the message names both).
      TypeError: a leaf is not an array, has a dtype orbax cannot store (the message names
        the leaf and the dtype), or an NVFP4Array is invalid.

    With several JAX processes every process calls it with the same `path` and tree; process
    0 alone touches `path` itself, and an error of one process is raised on all (see the
    module docstring).
    """
    path = _abspath(path)
    arrays, entries = _arrays_and_entries(tree)
    meta = _metadata(entries)
    if jax.process_count() > 1:
        _save_multiprocess(path, arrays, meta, force)
        return
    current = _prepare_directory(path, force)
    name = _next_snapshot_name(path)
    _remove_leftovers(path, keep=current)
    snapshot = os.path.join(path, name)
    _write_snapshot(snapshot, arrays, meta)
    fsync_tree(snapshot)
    fsync_path(path)
    _write_pointer(path, name)
    _remove_leftovers(path, keep=name)


def _save_multiprocess(path: str, arrays: dict, meta: dict, force: bool) -> None:
    """The save of every process of a multi-process JAX program (all call it, same `path`).

    Process 0 alone touches `path` itself (checks, snapshot name, leftovers, `CURRENT`);
    orbax writes the snapshot, each process its own shards. Every step ends in a collective
    that also carries a failure of any process to all of them, so all raise it.
    """
    op = "save_checkpoint"
    name = collective(op, "preparing the save", lambda: _begin_save(path, force), primary=True)
    snapshot = os.path.join(path, name)
    _write_snapshot(snapshot, arrays, meta)
    # Each process flushes the snapshot (on a shared file system, what it wrote is flushed
    # only by itself); `CURRENT` names it only once all have.
    collective(op, "flushing the snapshot", lambda: fsync_tree(snapshot), primary=False)
    collective(op, "committing the save", lambda: _commit(path, name), primary=True)


def _begin_save(path: str, force: bool) -> str:
    current = _prepare_directory(path, force)
    name = _next_snapshot_name(path)
    _remove_leftovers(path, keep=current)
    return name


def _commit(path: str, name: str) -> None:
    fsync_path(path)
    _write_pointer(path, name)
    _remove_leftovers(path, keep=name)


def _metadata(entries: list) -> dict:
    """The JSON a save writes: the format, the entries, and a digest of each and of all."""
    entries = [{**entry, _DIGEST: _digest(entry)} for entry in entries]
    meta = {"format": FORMAT, "entries": entries}
    return {**meta, _DIGEST: _digest(meta)}


def _digest(value) -> str:
    """sha256 of the canonical JSON of `value` (sorted keys, no spaces, ASCII)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _abspath(path) -> str:
    return os.path.abspath(os.fsdecode(path))


def _arrays_and_entries(tree) -> tuple[dict, list]:
    """The flat `{stored name: array}` dict and the JSON entries; checks names are unique."""
    arrays, entries, layout = {}, [], []
    for keypath, names, leaf in _named_leaves(tree):
        where = jax.tree_util.keystr(keypath) or "the root"
        entry, stored = _save_leaf(names, leaf, where)
        layout.append((where, names, [entry["key"], *stored]))
        arrays.update(stored)
        entries.append(entry)
    _check_layout("save_checkpoint", layout)
    return arrays, entries


def _save_leaf(names, leaf, where) -> tuple[dict, dict]:
    key = "/".join(names)
    entry = {"key": key, "path": list(names)}
    if is_nvfp4_array(leaf):
        validate_nvfp4_array(leaf, f"save_checkpoint: {where}")
        entry.update(_nvfp4_meta(leaf), kind="nvfp4", shape=list(leaf.shape))
        return entry, {f"{key}/{part}": getattr(leaf, part) for part in _parts_of(leaf)}
    if is_key_array(leaf):
        impl = _key_impl_name(leaf, where)
        entry.update(kind="key", impl=impl, shape=list(leaf.shape))
        return entry, {key: jax.random.key_data(leaf)}
    value = _as_array(leaf, where)
    entry.update(kind="array", shape=list(value.shape), array_dtype=jnp.dtype(value.dtype).name)
    return entry, {key: value}


def _nvfp4_meta(q) -> dict:
    meta = {
        "dtype": jnp.dtype(q.dtype).name,
        "axis": q.axis,
        "block_2d": q.block_2d,
        "rht": q.rht,
        "shapes": {part: list(getattr(q, part).shape) for part in _parts_of(q)},
    }
    if q.four_over_six is not None:  # plain arrays keep the metadata of earlier versions
        meta.update(four_over_six=q.four_over_six, e4m3_max=q.e4m3_max)
    return meta


def _parts_of(q) -> tuple[str, ...]:
    """The array parts of an NVFP4Array: codes, scales, amax, and decode_scale if set."""
    return _PARTS + (("decode_scale",) if getattr(q, "decode_scale", None) is not None else ())


def _entry_parts(shapes: dict) -> tuple[str, ...]:
    return _PARTS + (("decode_scale",) if "decode_scale" in shapes else ())


def _key_impl_name(key, where) -> str:
    """The name `jax.random.wrap_key_data` takes back for the implementation of `key`."""
    name = str(jax.random.key_impl(key))
    try:
        if _key_dtype(name) == key.dtype:
            return name
    except (TypeError, ValueError):
        pass
    raise TypeError(f"save_checkpoint: the key at {where} has an unnamed PRNG impl ({name})")


def _as_array(leaf, where):
    if isinstance(leaf, (jax.Array, np.ndarray)):
        value = leaf
    elif isinstance(leaf, np.generic):
        value = np.asarray(leaf)  # keeps a NumPy scalar's dtype (jnp would narrow float64)
    else:
        try:
            value = jnp.asarray(leaf)
        except TypeError as e:
            raise TypeError(f"save_checkpoint: the leaf at {where} is not an array: {e}") from e
    reason = _unstorable(value.dtype)
    if reason:
        raise TypeError(f"save_checkpoint: the leaf at {where} has dtype {value.dtype}: {reason}")
    return value


def _unstorable(dtype) -> str | None:
    """Why orbax cannot store arrays of `dtype`, or None when it can.

    Storable: booleans and numbers, NumPy's and the ones JAX takes from ml_dtypes (bfloat16,
    the float8 types, int4, ...) alike (NumPy's kind of the latter is "V", as for a
    structured dtype), as far as tensorstore, which writes orbax's arrays, has them.
    """
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        return "not a dtype"
    if dtype != np.bool_ and not jax.dtypes.issubdtype(dtype, np.number):
        return "not a boolean or numeric dtype"
    import tensorstore  # noqa: PLC0415  (orbax writes with it)

    try:
        tensorstore.dtype(dtype.name)
    except (TypeError, ValueError):
        return "tensorstore (which orbax writes arrays with) has no such data type"
    return None


def _prepare_directory(path: str, force: bool) -> str | None:
    """Creates `path` or checks it may be written; returns the current snapshot's name."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(f"save_checkpoint: {path} exists and is not a directory")
    if not os.path.isdir(path):
        _makedirs(path)
        return None
    current = _read_pointer(path)
    if not force and not all(_is_leftover(name) for name in os.listdir(path)):
        raise FileExistsError(
            f"save_checkpoint: {path} already holds a checkpoint or other files "
            "(force=True replaces the checkpoint)"
        )
    return current


def _makedirs(path: str) -> None:
    created, parent = [], path
    while not os.path.lexists(parent):
        created.append(parent)
        parent = os.path.dirname(parent)
    os.makedirs(path)
    for directory in reversed(created):
        fsync_path(os.path.dirname(directory))


def _is_leftover(name: str) -> bool:
    """A name only saves write (while `CURRENT` does not name it, nothing refers to it)."""
    return name == _POINTER_TMP or _SNAPSHOT_OR_TMP.fullmatch(name) is not None


def _next_snapshot_name(path: str) -> str:
    numbers = [int(m.group(1)) for m in map(_SNAPSHOT.match, os.listdir(path)) if m]
    return f"snapshot-{max(numbers, default=0) + 1:06d}"


def _remove_leftovers(path: str, keep: str | None) -> None:
    """Removes every snapshot but `keep`, and, once `CURRENT` exists, a first-format one."""
    for name in os.listdir(path):
        if name != keep and _is_leftover(name):
            _remove(os.path.join(path, name))
    if os.path.isfile(os.path.join(path, POINTER)) and os.path.isdir(os.path.join(path, "nvfp4")):
        for name in _V1_ITEMS:
            if os.path.lexists(os.path.join(path, name)):
                _remove(os.path.join(path, name))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _checkpointer():
    import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy, and only needed here)

    handler = ocp.CompositeCheckpointHandler(
        arrays=ocp.StandardCheckpointHandler(), nvfp4=ocp.JsonCheckpointHandler()
    )
    return ocp.Checkpointer(handler)


def _write_snapshot(snapshot: str, arrays: dict, meta: dict) -> None:
    import orbax.checkpoint as ocp  # noqa: PLC0415

    items = {"nvfp4": ocp.args.JsonSave(meta)}
    if arrays:  # orbax refuses an empty item (an empty tree)
        items["arrays"] = ocp.args.StandardSave(arrays)
    with _checkpointer() as checkpointer:
        checkpointer.save(snapshot, ocp.args.Composite(**items))


def _write_pointer(path: str, name: str) -> None:
    tmp = os.path.join(path, _POINTER_TMP)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        fsync_fd(f.fileno())
    os.replace(tmp, os.path.join(path, POINTER))
    fsync_path(path)


# --- restore -------------------------------------------------------------------------------


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
    path = _abspath(path)
    snapshot = _find_snapshot(path)
    with _checkpointer() as checkpointer:
        entries = _read_entries(checkpointer, snapshot)
        specs = _stored_specs(entries)
        _compare(specs, _stored_metadata(checkpointer, snapshot), "the stored array")
        named = None if target is None else _named_leaves(target)
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
    name = _read_pointer(path)
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


def _read_pointer(path: str) -> str | None:
    try:
        with open(os.path.join(path, POINTER), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    if not _SNAPSHOT.fullmatch(name):
        raise ValueError(f"{path}/{POINTER} holds {name[:80]!r}, not a snapshot name")
    return name


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
    return [{k: v for k, v in entry.items() if k != _DIGEST} for entry in entries]


def _check_digests(meta: dict, file: str) -> None:
    """Checks that the metadata is the one its save wrote (formats 1 and 2 have no digests)."""
    entries = meta["entries"]
    sealed = [isinstance(entry, dict) and _DIGEST in entry for entry in entries]
    if meta["format"] != FORMAT:
        if any(sealed) or _DIGEST in meta:
            raise ValueError(
                f"restore_checkpoint: {file} was edited: it has the digests of format "
                f"{FORMAT!r} but says {meta['format']!r}"
            )
        return
    edited = []
    for entry, has_digest in zip(entries, sealed, strict=True):
        if not has_digest:
            edited.append(_entry_name(entry))
        elif entry[_DIGEST] != _digest({k: v for k, v in entry.items() if k != _DIGEST}):
            edited.append(_entry_name(entry))
    if edited:
        which = "entry" if len(edited) == 1 else "entries"
        raise ValueError(
            f"restore_checkpoint: the metadata of the {which} {', '.join(edited)} in {file} "
            "was edited after the save (it no longer matches the sha256 digest saved with it)"
        )
    if meta.get(_DIGEST) != _digest({k: v for k, v in meta.items() if k != _DIGEST}):
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
    _check_layout("restore_checkpoint", layout)
    return specs


def _entry_specs(entry: dict) -> dict:
    key, kind = entry["key"], entry.get("kind")
    if kind == "array":
        dtype = _dtype_field(entry, "array_dtype")
        if _unstorable(dtype):
            raise _bad(key, f"array_dtype {dtype.name!r} is not a dtype orbax stores")
        return {key: (_shape_field(entry, "shape"), dtype.name)}
    if kind == "key":
        data_shape = _shape_field(entry, "shape") + _key_data_shape(entry)
        return {key: (data_shape, "uint32")}
    if kind == "nvfp4":
        _abstract_nvfp4(entry)  # checks the metadata, `shapes` included
        shapes = entry["shapes"]
        return {
            f"{key}/{p}": (_shape_field(shapes, p, key), _PART_DTYPES[p])
            for p in _entry_parts(shapes)
        }
    raise _bad(key, f"unknown kind {kind!r}")


def _abstract_nvfp4(entry: dict) -> NVFP4Array:
    """The NVFP4Array of `jax.ShapeDtypeStruct`s the entry describes, validated."""
    key, shapes = entry["key"], entry.get("shapes")
    if not isinstance(shapes, dict):
        raise _bad(key, f"shapes {shapes!r} is not a dict")
    parts = {
        p: jax.ShapeDtypeStruct(_shape_field(shapes, p, key), jnp.dtype(_PART_DTYPES[p]))
        for p in _entry_parts(shapes)
    }
    q = _validated(key, lambda: NVFP4Array(**parts, **_static_meta(entry)))
    if "shape" in entry and _shape_field(entry, "shape") != q.shape:  # format 1 has no shape
        raise _bad(key, f"the logical shape {entry['shape']} does not fit the parts {shapes}")
    return q


def _static_meta(entry: dict) -> dict:
    """dtype, axis, block_2d, rht (and Four Over Six's fields) as the JSON has them.

    Checked by the caller (`validate_nvfp4_array`); an entry without `four_over_six` is a
    plain NVFP4 array (e4m3_max 448).
    """
    meta = {name: entry.get(name) for name in ("axis", "block_2d", "rht")}
    meta.update(four_over_six=entry.get("four_over_six"), e4m3_max=entry.get("e4m3_max", 448))
    return {"dtype": _dtype_field(entry, "dtype"), **meta}


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


@functools.cache
def _key_dtype(impl: str):
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


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


def _named_leaves(tree) -> list:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_nvfp4_array)
    return [(path, tuple(key_name(k) for k in path), leaf) for path, leaf in flat]


def _check_layout(op: str, layout: list) -> None:
    """Every name is claimed by one leaf, and no leaf's path is a parent of another's.

    `layout` holds `(where, path, names)` per leaf: a description, the path components and
    the names the leaf claims (its key and its stored arrays).
    """
    owner, leaves = {}, {}
    for where, path, names in layout:
        for name in dict.fromkeys(names):
            if name in owner:
                raise ValueError(
                    f"{op}: the leaves at {owner[name]} and {where} are both stored as {name!r}"
                )
            owner[name] = where
        leaves[tuple(path)] = where
    for path, where in leaves.items():
        for depth in range(len(path)):
            if path[:depth] in leaves:
                raise ValueError(
                    f"{op}: the leaf at {leaves[path[:depth]]} has the same path as a parent "
                    f"of the leaf at {where}"
                )


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
        return {f"{key}/{part}": _abstract(getattr(leaf, part)) for part in _parts_of(leaf)}
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
    if found[0] != "key" or found[1] != tuple(leaf.shape) or _key_dtype(found[2]) != leaf.dtype:
        raise ValueError(
            f"restore_checkpoint: {key!r} was saved as (kind, shape, impl) {found}, the "
            f"target wants a key of shape {tuple(leaf.shape)} and dtype {leaf.dtype}"
        )


def _check_nvfp4_entry(key, entry, leaf):
    validate_nvfp4_array(leaf, f"restore_checkpoint target {key!r}")
    if entry.get("kind") != "nvfp4":
        raise ValueError(f"restore_checkpoint: {key!r} was saved as {entry.get('kind')}, not NVFP4")
    wanted = _nvfp4_meta(leaf)
    # A Four Over Six entry against a plain target (or the reverse) differs too.
    names = [*wanted, *(name for name in ("four_over_six", "e4m3_max") if name in entry)]
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
    parts = {part: arrays[f"{key}/{part}"] for part in _entry_parts(entry["shapes"])}
    return _validated(key, lambda: NVFP4Array(**parts, **_static_meta(entry)))


def _nested(entries, arrays):
    """Nested dicts from the saved paths (no target to give the original containers)."""
    if len(entries) == 1 and not entries[0]["path"]:
        return _rebuild(entries[0], arrays)  # the tree was a single leaf
    root: dict = {}
    for entry in entries:
        *parents, last = entry["path"]  # not empty: `_check_layout` allows that only alone
        node = root
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = _rebuild(entry, arrays)
    return root
