"""`save_checkpoint`: a pytree of NVFP4Arrays, arrays and PRNG keys, saved atomically.

The format it writes is `format`'s (docs/CHECKPOINT_FORMAT.md).

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
time out). With one process, none of this happens: the save is the one described above.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core.array import is_nvfp4_array, validate_nvfp4_array
from nvfp4_jax._src.io.checkpoint.format import (
    DIGEST,
    FORMAT,
    POINTER,
    SNAPSHOT,
    abspath,
    check_layout,
    digest,
    key_dtype,
    named_leaves,
    nvfp4_meta,
    open_checkpointer,
    parts_of,
    read_pointer,
    unstorable,
)
from nvfp4_jax._src.io.durable import (
    collective,
    fsync_fd,
    fsync_path,
    fsync_tree,
    is_key_array,
)

_POINTER_TMP = "CURRENT.tmp"
# A snapshot, or the temporary directory orbax writes one into: the names a save may remove.
_SNAPSHOT_OR_TMP = re.compile(r"snapshot-[0-9]+(\.orbax-checkpoint-tmp.*)?")
# What the first format wrote at `path`; `nvfp4` (its JSON) last, as the marker.
_V1_ITEMS = ("arrays", "_CHECKPOINT_METADATA", "_METADATA", "commit_success.txt", "nvfp4")


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
    path = abspath(path)
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
    entries = [{**entry, DIGEST: digest(entry)} for entry in entries]
    meta = {"format": FORMAT, "entries": entries}
    return {**meta, DIGEST: digest(meta)}


def _arrays_and_entries(tree) -> tuple[dict, list]:
    """The flat `{stored name: array}` dict and the JSON entries; checks names are unique."""
    arrays, entries, layout = {}, [], []
    for keypath, names, leaf in named_leaves(tree):
        where = jax.tree_util.keystr(keypath) or "the root"
        entry, stored = _save_leaf(names, leaf, where)
        layout.append((where, names, [entry["key"], *stored]))
        arrays.update(stored)
        entries.append(entry)
    check_layout("save_checkpoint", layout)
    return arrays, entries


def _save_leaf(names, leaf, where) -> tuple[dict, dict]:
    key = "/".join(names)
    entry = {"key": key, "path": list(names)}
    if is_nvfp4_array(leaf):
        validate_nvfp4_array(leaf, f"save_checkpoint: {where}")
        entry.update(nvfp4_meta(leaf), kind="nvfp4", shape=list(leaf.shape))
        return entry, {f"{key}/{part}": getattr(leaf, part) for part in parts_of(leaf)}
    if is_key_array(leaf):
        impl = _key_impl_name(leaf, where)
        entry.update(kind="key", impl=impl, shape=list(leaf.shape))
        return entry, {key: jax.random.key_data(leaf)}
    value = _as_array(leaf, where)
    entry.update(kind="array", shape=list(value.shape), array_dtype=jnp.dtype(value.dtype).name)
    return entry, {key: value}


def _key_impl_name(key, where) -> str:
    """The name `jax.random.wrap_key_data` takes back for the implementation of `key`."""
    name = str(jax.random.key_impl(key))
    try:
        if key_dtype(name) == key.dtype:
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
    reason = unstorable(value.dtype)
    if reason:
        raise TypeError(f"save_checkpoint: the leaf at {where} has dtype {value.dtype}: {reason}")
    return value


def _prepare_directory(path: str, force: bool) -> str | None:
    """Creates `path` or checks it may be written; returns the current snapshot's name."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(f"save_checkpoint: {path} exists and is not a directory")
    if not os.path.isdir(path):
        _makedirs(path)
        return None
    current = read_pointer(path)
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
    numbers = [int(m.group(1)) for m in map(SNAPSHOT.match, os.listdir(path)) if m]
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


def _write_snapshot(snapshot: str, arrays: dict, meta: dict) -> None:
    import orbax.checkpoint as ocp  # noqa: PLC0415

    items = {"nvfp4": ocp.args.JsonSave(meta)}
    if arrays:  # orbax refuses an empty item (an empty tree)
        items["arrays"] = ocp.args.StandardSave(arrays)
    with open_checkpointer() as checkpointer:
        checkpointer.save(snapshot, ocp.args.Composite(**items))


def _write_pointer(path: str, name: str) -> None:
    tmp = os.path.join(path, _POINTER_TMP)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        fsync_fd(f.fileno())
    os.replace(tmp, os.path.join(path, POINTER))
    fsync_path(path)
