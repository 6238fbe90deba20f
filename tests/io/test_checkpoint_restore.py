"""Restoring a checkpoint whose metadata disagrees with its arrays
(nvfp4_jax/_src/io/checkpoint/restore.py, every check before any array is read, and the
digests of checkpoint/format.py): each edited entry is named, consistent edits of NVFP4
metadata are caught by the digest, a downgraded format is an edit, a dtype orbax cannot store
is refused; the second format's checkpoints restore and convert.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from checkpoint_compare import same_tree
from checkpoint_crash_child import make_tree
from helpers import normal

from nvfp4_jax import quantize
from nvfp4_jax._src.io.checkpoint import save as checkpoint_save
from nvfp4_jax.checkpoint import restore_checkpoint, save_checkpoint

# --- metadata that disagrees with the arrays ------------------------------------------------------


def edit_metadata(path, edit):
    """Applies `edit` to the JSON entries (by key) of the checkpoint at `path`."""
    (meta_file,) = path.glob("**/nvfp4/metadata")  # where orbax's JsonSave wrote it
    meta = json.loads(meta_file.read_text())
    entries = {entry["key"]: entry for entry in meta["entries"]}
    edit(entries)
    meta_file.write_text(json.dumps({**meta, "entries": list(entries.values())}))


EDITS = {
    "logical shape": (lambda e: e["w"].update(shape=[32, 32]), "'w'.*logical shape"),
    "axis": (lambda e: e["w"].update(axis=-2), "'w'.*logical shape"),
    "axis type": (lambda e: e["w"].update(axis="-1"), "'w'.*axis must be an int"),
    "dtype": (lambda e: e["w"].update(dtype="int8"), "'w'.*dtype must be"),
    "block_2d": (lambda e: e["v"].update(block_2d=True), "'v'.*block_2d needs rows"),
    "rht": (lambda e: e["w"].update(rht=1), "'w'.*rht must be a bool"),
    "codes shape": (
        lambda e: e["w"].update(
            shape=[32, 16], shapes=dict(codes=[32, 8], scales=[32, 1], amax=[])
        ),
        "'w'.*'w/codes'.*stored array has",
    ),
    "amax shape": (lambda e: e["w"]["shapes"].update(amax=[7]), "'w'.*amax of shape"),
    "array dtype": (lambda e: e["b"].update(array_dtype="bfloat16"), "'b'.*stored array has"),
    "array shape": (lambda e: e["b"].update(shape=[5]), "'b'.*stored array has"),
    "kind": (lambda e: e["b"].update(kind="nvfp4"), "'b'.*shapes None"),
    "key impl": (lambda e: e["k"].update(impl="rbg"), "'k'.*stored array has"),
    "lost entry": (lambda e: e.pop("b"), r"\['b'\] belong to no entry"),
}


def save_v2(path, tree):
    """Writes `tree` as format 2 did: a snapshot and `CURRENT`, metadata without digests."""
    v2 = {"format": "nvfp4_jax.checkpoint/2"}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(checkpoint_save, "_metadata", lambda entries: {**v2, "entries": entries})
        save_checkpoint(path, tree)


def stored_metadata(path):
    (meta_file,) = path.glob("**/nvfp4/metadata")
    return json.loads(meta_file.read_text())


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@pytest.mark.parametrize("edit", EDITS)
def test_edited_metadata_raises_naming_the_entry(tmp_path, edit, fmt):
    tree = {
        "w": quantize(normal((32, 64)), axis=-1),
        "v": quantize(normal((8, 32))),
        "b": jnp.arange(4.0),
    }
    if edit == "key impl":
        tree["k"] = jax.random.key(0)
    (save_checkpoint if fmt == "v3" else save_v2)(tmp_path / "c", tree)
    change, match = EDITS[edit]
    if fmt == "v3":  # the digest saved with each entry (and all of them) finds any edit
        edited = re.search(r"'(\w)'", match).group(1)
        match = (
            rf"the metadata of the entry '{edited}' in \S*nvfp4/metadata was edited"
            if edit != "lost entry"
            else r"nvfp4/metadata was edited after the save: its entries \(2: 'v', 'w'\)"
        )
    edit_metadata(tmp_path / "c", change)
    with pytest.raises(ValueError, match=match):
        restore_checkpoint(tmp_path / "c")
    with pytest.raises(ValueError, match=match):
        restore_checkpoint(tmp_path / "c", jax.eval_shape(lambda: tree))


# Edits that leave the metadata consistent with the arrays: a different NVFP4Array.
SILENT_EDITS = {
    "dtype": {"dtype": "float16"},
    "rht": {"rht": True},
    "block_2d": {"block_2d": True},
    "axis": {"axis": -2},
}


@pytest.mark.parametrize("edit", SILENT_EDITS)
def test_consistent_edits_of_nvfp4_metadata_are_caught_by_the_digest(tmp_path, edit):
    tree = {"w": quantize(normal((64, 64)), axis=-1), "u": quantize(normal((32, 32)))}
    save_checkpoint(tmp_path / "c", tree)
    edit_metadata(tmp_path / "c", lambda e: e["w"].update(SILENT_EDITS[edit]))
    for target in (None, jax.eval_shape(lambda: tree)):
        with pytest.raises(ValueError, match=r"the entry 'w' in \S*nvfp4/metadata was edited"):
            restore_checkpoint(tmp_path / "c", target)
    # The same edit of a format-2 checkpoint (no digests) goes unnoticed: the arrays fit.
    save_v2(tmp_path / "v2", tree)
    edit_metadata(tmp_path / "v2", lambda e: e["w"].update(SILENT_EDITS[edit]))
    edited = restore_checkpoint(tmp_path / "v2")["w"]
    assert getattr(edited, edit) != getattr(tree["w"], edit)


def test_every_edited_entry_is_named_and_an_unedited_checkpoint_restores(tmp_path):
    tree = {"w": quantize(normal((64, 64))), "u": quantize(normal((32, 32))), "b": jnp.ones(3)}
    save_checkpoint(tmp_path / "c", tree)
    meta = stored_metadata(tmp_path / "c")
    assert meta["format"] == "nvfp4_jax.checkpoint/3"
    assert meta["digest"].startswith("sha256:")
    assert all(entry["digest"].startswith("sha256:") for entry in meta["entries"])
    assert same_tree(restore_checkpoint(tmp_path / "c"), tree)
    assert same_tree(restore_checkpoint(tmp_path / "c", jax.eval_shape(lambda: tree)), tree)

    def two_edits(entries):
        entries["w"].update(rht=True)
        entries["b"].pop("digest")  # an entry without its digest counts as edited

    edit_metadata(tmp_path / "c", two_edits)
    with pytest.raises(ValueError, match=r"the entries 'b', 'w' in \S*c/snapshot-000001/nvfp4"):
        restore_checkpoint(tmp_path / "c")


def test_a_downgraded_format_is_an_edit(tmp_path):
    save_checkpoint(tmp_path / "c", {"w": quantize(normal((16, 32)))})
    (meta_file,) = (tmp_path / "c").glob("**/nvfp4/metadata")
    meta = json.loads(meta_file.read_text())
    for fmt in ("nvfp4_jax.checkpoint/2", "nvfp4_jax.checkpoint/1"):
        meta_file.write_text(json.dumps({**meta, "format": fmt}))
        with pytest.raises(ValueError, match=f"has the digests of format .*but says '{fmt}'"):
            restore_checkpoint(tmp_path / "c")
    moved = {**meta, "entries": meta["entries"] * 2}  # a duplicated entry: each one intact
    meta_file.write_text(json.dumps(moved))
    with pytest.raises(ValueError, match="was edited after the save: its entries"):
        restore_checkpoint(tmp_path / "c")


def test_an_array_dtype_orbax_cannot_store_is_refused_on_restore(tmp_path):
    save_v2(tmp_path / "c", {"b": jnp.ones(3, jnp.bfloat16)})
    assert stored_metadata(tmp_path / "c")["entries"][0]["array_dtype"] == "bfloat16"
    edit_metadata(tmp_path / "c", lambda e: e["b"].update(array_dtype="object"))
    with pytest.raises(ValueError, match="entry 'b': array_dtype 'object' is not a dtype orbax"):
        restore_checkpoint(tmp_path / "c")


def test_second_format_checkpoints_restore_and_convert(tmp_path):
    old, new = make_tree(0), make_tree(1)
    save_v2(tmp_path / "v2", old)
    assert "digest" not in json.dumps(stored_metadata(tmp_path / "v2"))
    assert same_tree(restore_checkpoint(tmp_path / "v2"), old)
    assert same_tree(restore_checkpoint(tmp_path / "v2", old), old)
    save_checkpoint(tmp_path / "v2", new, force=True)
    assert stored_metadata(tmp_path / "v2")["format"] == "nvfp4_jax.checkpoint/3"
    assert len(os.listdir(tmp_path / "v2")) == 2
    assert same_tree(restore_checkpoint(tmp_path / "v2"), new)
