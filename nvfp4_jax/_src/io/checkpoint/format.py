"""The checkpoint format: its directory layout, stored names, metadata and digests.

What `save` writes and `restore` reads, and the helpers both sides
share: a tree's leaves and their stored names, the entry of an NVFP4 leaf, the dtypes
orbax stores, the digests, the `CURRENT` pointer and the orbax checkpointer.

The format itself, for readers of the files: docs/CHECKPOINT_FORMAT.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import array
from nvfp4_jax._src.core.array import NVFP4Array, is_nvfp4_array
from nvfp4_jax._src.io.durable import key_name

FORMAT = "nvfp4_jax.checkpoint/3"
FORMAT_V2 = "nvfp4_jax.checkpoint/2"
FORMAT_V1 = "nvfp4_jax.checkpoint/1"
DIGEST = "digest"  # the field of each entry, and of the whole metadata, holding its digest
POINTER = "CURRENT"
SNAPSHOT = re.compile(r"snapshot-([0-9]+)")
PARTS = array.PARTS
# `decode_scale` is an optional fourth part (None in most NVFP4Arrays): stored when present.
# The dtype names of the parts, NVFP4Array's (nvfp4_jax/_src/core/array.py).
PART_DTYPES = {part: jnp.dtype(dtype).name for part, dtype in array.PART_DTYPES.items()}


def abspath(path) -> str:
    """`path` (str, bytes or path-like) as an absolute str, relative to the current directory."""
    return os.path.abspath(os.fsdecode(path))


def digest(value) -> str:
    """sha256 of the canonical JSON of `value` (sorted keys, no spaces, ASCII)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def named_leaves(tree) -> list:
    """`(keypath, path components, leaf)` per leaf of `tree`; NVFP4Arrays are leaves."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_nvfp4_array)
    return [(path, tuple(key_name(k) for k in path), leaf) for path, leaf in flat]


def check_layout(op: str, layout: list) -> None:
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


def nvfp4_meta(q) -> dict:
    """The JSON fields of an NVFP4 leaf's static metadata and part shapes."""
    meta = q._to_metadata()
    # Four Over Six's fields (set only on such arrays) after the shapes, as files have them.
    four_over_six = {k: meta.pop(k) for k in NVFP4Array._FOUR_OVER_SIX_FIELDS if k in meta}
    shapes = {part: list(getattr(q, part).shape) for part in parts_of(q)}
    return {**meta, "shapes": shapes, **four_over_six}


def parts_of(q) -> tuple[str, ...]:
    """The array parts of an NVFP4Array: codes, scales, amax, and decode_scale if set."""
    return PARTS + (("decode_scale",) if getattr(q, "decode_scale", None) is not None else ())


def entry_parts(shapes: dict) -> tuple[str, ...]:
    """The parts an NVFP4 entry stores, from its `shapes` (decode_scale if listed)."""
    return PARTS + (("decode_scale",) if "decode_scale" in shapes else ())


@functools.cache
def key_dtype(impl: str):
    """The dtype of a typed PRNG key of the implementation named `impl`."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def unstorable(dtype) -> str | None:
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


def read_pointer(path: str) -> str | None:
    """The snapshot name `CURRENT` holds, None without `CURRENT` (format 1 or no save)."""
    try:
        with open(os.path.join(path, POINTER), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    if not SNAPSHOT.fullmatch(name):
        raise ValueError(f"{path}/{POINTER} holds {name[:80]!r}, not a snapshot name")
    return name


def open_checkpointer():
    """The orbax checkpointer of a snapshot: its `arrays` and its `nvfp4` (JSON) items."""
    import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy, and only needed here)

    handler = ocp.CompositeCheckpointHandler(
        arrays=ocp.StandardCheckpointHandler(), nvfp4=ocp.JsonCheckpointHandler()
    )
    return ocp.Checkpointer(handler)
