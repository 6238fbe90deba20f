"""Checkpoints of NVFP4Arrays, pytrees and nnx states with orbax."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from checkpoint_compare import is_key, same_leaf, same_tree
from checkpoint_crash_child import make_tree
from flax import nnx
from helpers import assert_same_q, normal, same_bits

import nvfp4_jax.checkpoint
import nvfp4_jax.nnx
from nvfp4_jax import quantize
from nvfp4_jax._src.core.array import NVFP4Array, is_nvfp4_array, validate_nvfp4_array
from nvfp4_jax.checkpoint import restore_checkpoint, save_checkpoint


def test_checkpoint_round_trip_of_a_pytree(tmp_path):
    tree = {
        "w": quantize(normal((64, 32), dtype=jnp.bfloat16), axis=0, block_2d=True),
        "layers": [quantize(normal((16, 48), 1), rht=True), jnp.arange(5.0)],
    }
    save_checkpoint(tmp_path / "ckpt", tree)
    target = jax.eval_shape(lambda: tree)
    restored = restore_checkpoint(tmp_path / "ckpt", target)
    assert_same_q(restored["w"], tree["w"])
    assert_same_q(restored["layers"][0], tree["layers"][0])
    assert same_bits(restored["layers"][1], tree["layers"][1])
    untargeted = restore_checkpoint(tmp_path / "ckpt")
    assert_same_q(untargeted["layers"]["0"], tree["layers"][0])


class QuantizedMLP(nnx.Module):
    def __init__(self, seed):
        keys = jax.random.split(jax.random.key(seed))
        self.up = nnx.Variable(
            quantize(jax.random.normal(keys[0], (64, 32)), axis=0, block_2d=True)
        )
        self.down = nnx.Variable(quantize(jax.random.normal(keys[1], (32, 64)), axis=0))
        self.bias = nnx.Param(jnp.zeros((64,)))

    def __call__(self, x):
        h = jax.nn.relu(x @ self.up.get_value().dequantize())
        return h @ self.down.get_value().dequantize() + self.bias[...]


def test_checkpoint_round_trip_of_an_nnx_model(tmp_path):
    model = QuantizedMLP(0)
    save_checkpoint(tmp_path / "model", nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: QuantizedMLP(1)))
    restored = nnx.merge(graphdef, restore_checkpoint(tmp_path / "model", abstract))
    assert_same_q(restored.up.get_value(), model.up.get_value())
    assert_same_q(restored.down.get_value(), model.down.get_value())
    x = normal((4, 64), 7)
    assert same_bits(restored(x), model(x))


def test_restore_with_wrong_shape_or_metadata_raises(tmp_path):
    save_checkpoint(tmp_path / "c", {"w": quantize(normal((64, 32)), axis=0)})
    wrong_shape = jax.eval_shape(lambda: {"w": quantize(normal((64, 64)), axis=0)})
    with pytest.raises(ValueError, match="'w' was saved with"):
        restore_checkpoint(tmp_path / "c", wrong_shape)
    wrong_meta = jax.eval_shape(lambda: {"w": quantize(normal((64, 32)), axis=0, block_2d=True)})
    with pytest.raises(ValueError, match="block_2d"):
        restore_checkpoint(tmp_path / "c", wrong_meta)
    with pytest.raises(ValueError, match="no entry 'v'"):
        restore_checkpoint(tmp_path / "c", {"v": jax.ShapeDtypeStruct((3,), jnp.float32)})


@pytest.mark.parametrize("e4m3_max", [256, 448])
def test_four_over_six_arrays_keep_their_metadata(tmp_path, e4m3_max):
    q = quantize(normal((64, 32)), four_over_six="mse", four_over_six_e4m3_max=e4m3_max)
    save_checkpoint(tmp_path / "c", {"w": q, "plain": quantize(normal((32, 32)))})
    restored = restore_checkpoint(tmp_path / "c")
    assert restored["w"].four_over_six == "mse" and restored["w"].e4m3_max == e4m3_max
    assert_same_q(restored["w"], q)
    assert restored["plain"].four_over_six is None and restored["plain"].e4m3_max == 448
    plain = quantize(normal((32, 32)))
    for target in ({"w": quantize(normal((64, 32))), "plain": plain}, {"w": q, "plain": q}):
        with pytest.raises(ValueError, match="four_over_six"):
            restore_checkpoint(tmp_path / "c", jax.eval_shape(lambda t=target: t))


def test_validate_rejects_wrong_dtypes_and_shapes():
    q = quantize(normal((32, 64)))
    with pytest.raises(TypeError, match="scales must be float8_e4m3fn"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "scales": q.scales.astype(jnp.float32)}))
    with pytest.raises(ValueError, match="need scales of shape"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "scales": q.scales[:, :2]}))
    with pytest.raises(TypeError, match="codes must be uint8"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "codes": q.codes.astype(jnp.int32)}))
    assert validate_nvfp4_array(q) is q


def test_save_rejects_an_invalid_array(tmp_path):
    q = quantize(normal((32, 64)))
    bad = q.__class__(**{**vars(q), "amax": q.amax.astype(jnp.bfloat16)})
    with pytest.raises(TypeError, match="amax must be float32"):
        save_checkpoint(tmp_path / "bad", {"w": bad})


# --- nnx models with rng streams -------------------------------------------------------------


class TwoLinear(nnx.Module):
    """Two NVFP4 layers with stochastic rounding: each holds an rng stream (key and count)."""

    def __init__(self, seed):
        rngs = nnx.Rngs(seed, quantize=seed + 1)
        self.first = nvfp4_jax.nnx.Linear(32, 64, rngs=rngs)
        self.second = nvfp4_jax.nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.second(jax.nn.relu(self.first(x)))


@nnx.jit
def loss_and_grads(model, x):
    return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)


def test_nnx_model_with_rng_streams_round_trips_and_continues_its_streams(tmp_path):
    model = TwoLinear(0)
    x = normal((8, 32), 3)
    loss_and_grads(model, x)  # advance the streams: count 1
    save_checkpoint(tmp_path / "m", nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TwoLinear(5)))
    restored = nnx.merge(graphdef, restore_checkpoint(tmp_path / "m", abstract))
    assert same_tree(nnx.state(restored), nnx.state(model))
    assert int(restored.first.quantize_rngs.count[...]) == 1
    assert is_key(restored.second.quantize_rngs.key[...])
    (loss, grads), (loss_r, grads_r) = loss_and_grads(model, x), loss_and_grads(restored, x)
    assert same_bits(loss_r, loss) and same_tree(grads_r, grads)
    assert same_tree(nnx.state(restored), nnx.state(model))  # the streams moved alike


def test_typed_keys_round_trip_without_target_and_check_the_target(tmp_path):
    tree = {"k": jax.random.split(jax.random.key(1, impl="rbg"), 3), "raw": jax.random.PRNGKey(2)}
    save_checkpoint(tmp_path / "k", tree)
    assert same_tree(restore_checkpoint(tmp_path / "k"), tree)
    assert same_tree(restore_checkpoint(tmp_path / "k", jax.eval_shape(lambda: tree)), tree)
    wrong_impl = {**tree, "k": jax.eval_shape(lambda: jax.random.split(jax.random.key(1), 3))}
    with pytest.raises(ValueError, match="'k' was saved as"):
        restore_checkpoint(tmp_path / "k", wrong_impl)


# --- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree, paths",
    [
        ({"w": quantize(normal((16, 32))), "w/codes": jnp.zeros(3)}, ("['w']", "['w/codes']")),
        ({"a/b": jnp.zeros(2), "a": {"b": jnp.ones(2)}}, ("['a']['b']", "['a/b']")),
        ({"a/b": quantize(normal((16, 32))), "a": {"b": jnp.ones(2)}}, ("['a']['b']", "['a/b']")),
    ],
)
def test_colliding_names_raise_before_anything_is_written(tmp_path, tree, paths):
    with pytest.raises(ValueError, match="both stored as") as info:
        save_checkpoint(tmp_path / "new", tree)
    assert all(p in str(info.value) for p in paths), str(info.value)
    assert not (tmp_path / "new").exists()
    save_checkpoint(tmp_path / "old", {"x": jnp.arange(3.0)})
    with pytest.raises(ValueError, match="both stored as"):
        save_checkpoint(tmp_path / "old", tree, force=True)
    assert same_tree(restore_checkpoint(tmp_path / "old"), {"x": jnp.arange(3.0)})


# --- atomic saves, the layout, missing checkpoints ----------------------------------------------


def test_a_forced_save_replaces_the_snapshot_and_keeps_one(tmp_path):
    path = tmp_path / "c"
    save_checkpoint(path, {"x": jnp.arange(3.0)})
    first = (path / "CURRENT").read_text().strip()
    assert sorted(os.listdir(path)) == ["CURRENT", first]
    save_checkpoint(path, {"y": jnp.ones(2)}, force=True)
    second = (path / "CURRENT").read_text().strip()
    assert second != first and sorted(os.listdir(path)) == ["CURRENT", second]
    assert same_tree(restore_checkpoint(path), {"y": jnp.ones(2)})


def test_saving_over_a_checkpoint_needs_force(tmp_path):
    save_checkpoint(tmp_path / "c", {"x": jnp.arange(3.0)})
    with pytest.raises(FileExistsError, match=str(tmp_path / "c")):
        save_checkpoint(tmp_path / "c", {"x": jnp.zeros(3)})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="other"):
        save_checkpoint(tmp_path / "other", {"x": jnp.zeros(3)})
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", {"x": jnp.zeros(3)})  # an empty directory is fine
    assert same_tree(restore_checkpoint(tmp_path / "c"), {"x": jnp.arange(3.0)})


def test_an_exception_during_a_forced_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path, old = tmp_path / "c", {"x": jnp.arange(3.0)}
    save_checkpoint(path, old)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    for function in ("rename", "replace"):  # orbax's finalize; the pointer
        with monkeypatch.context() as m:
            m.setattr(os, function, fail)
            with pytest.raises(OSError, match="disk full"):
                save_checkpoint(path, {"x": jnp.ones(3)}, force=True)
        assert same_tree(restore_checkpoint(path), old)
    save_checkpoint(path, {"y": jnp.ones(1)}, force=True)  # removes the leftovers
    assert len(os.listdir(path)) == 2
    assert same_tree(restore_checkpoint(path), {"y": jnp.ones(1)})


def test_restore_of_no_checkpoint_raises_file_not_found(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a checkpoint")
    for name in ("missing", "empty", "file"):
        with pytest.raises(FileNotFoundError, match=str(tmp_path / name)):
            restore_checkpoint(tmp_path / name)
    with pytest.raises(FileExistsError, match="not a directory"):
        save_checkpoint(tmp_path / "file", {"x": jnp.zeros(1)}, force=True)
    assert (tmp_path / "file").read_text() == "not a checkpoint"


def test_relative_paths_and_moved_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = {"w": quantize(normal((16, 32)))}
    save_checkpoint("rel/c", tree)
    os.rename(tmp_path / "rel", tmp_path / "moved")  # the pointer names the snapshot relatively
    monkeypatch.chdir(tmp_path / "moved")
    assert same_tree(restore_checkpoint("c"), tree)
    assert same_tree(
        restore_checkpoint(tmp_path / "moved" / "c", jax.eval_shape(lambda: tree)), tree
    )


def save_v1(path, tree):
    """Writes `tree` as format 1 did: an orbax Composite at `path` itself."""
    arrays, entries = {}, []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_nvfp4_array)[0]:
        names = [str(k.key) for k in keypath]
        key, entry = "/".join(names), {"key": "/".join(names), "path": names}
        if is_nvfp4_array(leaf):
            arrays.update({f"{key}/{p}": getattr(leaf, p) for p in ("codes", "scales", "amax")})
            shapes = {p: list(getattr(leaf, p).shape) for p in ("codes", "scales", "amax")}
            meta = dict(dtype=jnp.dtype(leaf.dtype).name, axis=leaf.axis, shapes=shapes)
            entry.update(kind="nvfp4", block_2d=leaf.block_2d, rht=leaf.rht, **meta)
        else:
            arrays[key] = leaf
            entry.update(kind="array", shape=list(leaf.shape), array_dtype=leaf.dtype.name)
        entries.append(entry)
    meta = {"format": "nvfp4_jax.checkpoint/1", "entries": entries}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        items = dict(arrays=ocp.args.StandardSave(arrays), nvfp4=ocp.args.JsonSave(meta))
        checkpointer.save(os.path.abspath(path), ocp.args.Composite(**items))


def test_first_format_checkpoints_restore_and_convert(tmp_path):
    old, new = make_tree(0, with_key=False), make_tree(1)
    save_v1(tmp_path / "v1", old)
    assert same_tree(restore_checkpoint(tmp_path / "v1"), old)
    assert same_tree(restore_checkpoint(tmp_path / "v1", old), old)  # NumPy f64: no eval_shape
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path / "v1", new)
    save_checkpoint(tmp_path / "v1", new, force=True)
    assert len(os.listdir(tmp_path / "v1")) == 2  # CURRENT and the snapshot: no format-1 files
    assert same_tree(restore_checkpoint(tmp_path / "v1"), new)


# --- the fault test: a save killed at many points ------------------------------------------------

CHILD = os.path.join(os.path.dirname(__file__), "checkpoint_crash_child.py")
# Where a save is killed by default: `[function, k, text]`, the k-th call of `function` whose
# first argument contains `text`; each leaves a different state on disk.
# NVFP4_CHECKPOINT_FAULTS=full kills at every call of every function, plus random SIGKILLs.
KILL_POINTS = {
    "v2": [
        ["open", 1, ""],  # orbax's first file
        ["rename", 1, ""],  # orbax's finalize of its two items,
        ["rename", 2, ""],
        ["rename", 3, ""],  # and of the snapshot
        ["fsync", 1, ""],  # the new snapshot is complete, in place and not yet current
        ["open", 1, "CURRENT.tmp"],
        ["replace", 1, ""],  # the pointer
        ["rmtree", 1, ""],  # removing the old snapshot: before it starts,
        ["rmdir", 1, "snapshot-"],  # and at its end
    ],
    "v1": [  # a format-1 checkpoint at `path` itself, converted
        ["rename", 3, ""],
        ["replace", 1, ""],
        ["rmtree", 1, ""],  # removing the format-1 files: the first one,
        ["rmtree", 1, "nvfp4"],  # and the last one, the marker
    ],
    "none": [  # a first save
        ["mkdir", 1, ""],  # `path` itself
        ["rename", 3, ""],
        ["replace", 1, ""],
    ],
}


def fault_plan():
    if os.environ.get("NVFP4_CHECKPOINT_FAULTS") == "full":
        return {"seed": 0, "bases": {b: {"points": None, "random": 10} for b in KILL_POINTS}}
    bases = {b: {"points": p, "random": 3 if b == "v2" else 0} for b, p in KILL_POINTS.items()}
    return {"seed": 0, "bases": bases}


def run_crash_child(workdir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, CHILD, str(workdir), json.dumps(fault_plan())],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.splitlines()[-1])


def check_killed_run(run, old, new, latest):
    """The old or the new tree, whole; then a save over the leftovers leaves them clean."""
    assert run["exit"] in (0, 9, -9) and not any(
        line.startswith("error") for line in run["report"]
    ), run
    try:
        restored = restore_checkpoint(run["dir"])
    except FileNotFoundError:
        assert old is None, run  # only a first save may leave no checkpoint
        restored = None
    assert restored is None or same_tree(restored, new) or same_tree(restored, old), run
    assert run["outcome"] != "completed" or same_tree(restored, new), run
    save_checkpoint(run["dir"], latest, force=restored is not None)
    assert len(os.listdir(run["dir"])) == 2, (run, os.listdir(run["dir"]))
    assert same_tree(restore_checkpoint(run["dir"]), latest), run


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the crash child forks")
def test_a_save_killed_at_any_point_leaves_the_old_or_the_new_checkpoint(tmp_path):
    old = {"v2": make_tree(0), "v1": make_tree(0, with_key=False), "none": None}
    save_checkpoint(tmp_path / "base-v2", old["v2"])
    save_v1(tmp_path / "base-v1", old["v1"])
    new, latest = make_tree(1), {"x": jnp.arange(4.0)}
    runs = run_crash_child(tmp_path)
    killed = [run for run in runs if run["outcome"] == "killed"]
    print(f"{len(runs)} runs, {len(killed)} killed during the save")
    for run in runs:
        check_killed_run(run, old[run["base"]], new, latest)
    kills = {line.split()[1] for run in killed for line in run["report"] if "kill" in line}
    assert {"rename", "replace", "rmtree", "rmdir", "open", "fsync", "mkdir"} <= kills, kills
    assert len(killed) >= 16


# --- other trees --------------------------------------------------------------------------------


def test_empty_trees_single_leaves_and_none_leaves(tmp_path):
    save_checkpoint(tmp_path / "empty", {})
    assert restore_checkpoint(tmp_path / "empty") == {}
    assert restore_checkpoint(tmp_path / "empty", {"a": None}) == {"a": None}
    q = quantize(normal((16, 32)))
    save_checkpoint(tmp_path / "leaf", q)
    assert same_leaf(restore_checkpoint(tmp_path / "leaf"), q)
    assert same_leaf(restore_checkpoint(tmp_path / "leaf", jax.eval_shape(lambda: q)), q)
    tree = {"a": None, "b": [None, jnp.ones(2)]}
    save_checkpoint(tmp_path / "none", tree)
    assert same_tree(restore_checkpoint(tmp_path / "none", tree), tree)


def test_numpy_leaves_keep_their_dtype(tmp_path):
    tree = {"f64": np.linspace(0, 1, 7), "i64": np.arange(3), "scalar": np.float64(0.1)}
    save_checkpoint(tmp_path / "c", tree)
    restored = restore_checkpoint(tmp_path / "c")
    assert all(same_bits(restored[k], tree[k]) for k in tree)
    assert same_tree(restore_checkpoint(tmp_path / "c", tree), jax.tree.map(np.asarray, tree))


def test_non_string_keys_round_trip_with_a_target(tmp_path):
    tree = {0: jnp.zeros(2), 1: {(2, 3): jnp.ones(3)}}
    save_checkpoint(tmp_path / "c", tree)
    assert same_tree(restore_checkpoint(tmp_path / "c", tree), tree)
    assert same_bits(restore_checkpoint(tmp_path / "c")["1"]["(2, 3)"], tree[1][(2, 3)])


def test_a_target_must_cover_every_entry(tmp_path):
    save_checkpoint(tmp_path / "c", {"w": jnp.ones(2), "extra": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"no leaf for the entries \['extra'\]"):
        restore_checkpoint(tmp_path / "c", {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_a_leaf_that_is_not_an_array_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"\['b'\]\[1\] is not an array"):
        save_checkpoint(tmp_path / "c", {"b": [jnp.ones(1), "text"]})
    assert not (tmp_path / "c").exists()


def test_a_decode_scale_is_kept(tmp_path):
    if "decode_scale" not in {field.name for field in dataclasses.fields(NVFP4Array)}:
        pytest.skip("this NVFP4Array has no decode_scale")
    q = dataclasses.replace(quantize(normal((16, 32))), decode_scale=jnp.float32(0.25))
    save_checkpoint(tmp_path / "c", {"q": q, "plain": quantize(normal((16, 32)))})
    restored = restore_checkpoint(tmp_path / "c")
    assert same_leaf(restored["q"], q) and restored["plain"].decode_scale is None
    assert same_leaf(restore_checkpoint(tmp_path / "c", jax.eval_shape(lambda: restored))["q"], q)
