"""Checkpoints saved and restored by a two-process JAX program (arrays over 8 global devices).

The test starts two processes (this file run as a script), each with 4 CPU devices and gloo
collectives, joined by `jax.distributed` through a local coordinator. Both call
`save_checkpoint` and `restore_checkpoint` with the same path, on arrays sharded over all 8
devices, so each process holds half of every array. Each process checks the values it
restores, shard by shard, against the full NumPy values; the test then restores the
checkpoint in this (single) process and checks every bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax.checkpoint import restore_checkpoint, save_checkpoint

PROCESSES, LOCAL_DEVICES = 2, 4
KILLED = 37  # the exit code of the process that dies in the middle of a save


def full_values(seed: int) -> dict:
    """The tree's values as NumPy (`w` an NVFP4Array's parts); `seed` changes every value."""
    rng = np.random.default_rng(seed)
    return {
        "w": {
            "codes": rng.integers(0, 256, (64, 32), dtype=np.uint8),
            "scales": rng.integers(0, 0x7E, (64, 4), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
            "amax": np.float32(rng.uniform(1, 10)).reshape(()),
        },
        # bfloat16 with NaN payloads and a negative zero: restored bit for bit.
        "b": np.concatenate(
            [
                rng.integers(0, 1 << 16, 60, dtype=np.uint16),
                np.array([0x7FC1, 0xFF81, 0x8000, 0x7F80], np.uint16),
            ]
        ).view(ml_dtypes.bfloat16),
        "n": rng.standard_normal((3, 5)),  # NumPy float64: every process has it, stays NumPy
    }


def sharded_tree(values: dict, mesh) -> dict:
    """The tree of global arrays, sharded over the mesh's 8 devices (`amax` replicated)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("devices"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def make(value, where):
        return jax.make_array_from_callback(value.shape, where, lambda index: value[index])

    w = values["w"]
    q = NVFP4Array(
        codes=make(w["codes"], sharding),
        scales=make(w["scales"], sharding),
        amax=make(w["amax"], replicated),
        dtype=jnp.dtype(jnp.bfloat16),
        axis=-1,
        block_2d=False,
        rht=False,
    )
    return {"w": q, "b": make(values["b"], sharding), "n": values["n"]}


def same_bytes(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return (a.shape, a.dtype) == (b.shape, b.dtype) and a.tobytes() == b.tobytes()


def check_restored(restored: dict, values: dict, target: dict) -> list[str]:
    """What in `restored` (this process's shards) differs from `values`; [] when all agree."""
    problems = []
    pairs = {
        **{f"w/{p}": (getattr(restored["w"], p), values["w"][p]) for p in values["w"]},
        "b": (restored["b"], values["b"]),
    }
    shardings = {
        **{f"w/{p}": getattr(target["w"], p).sharding for p in values["w"]},
        "b": target["b"].sharding,
    }
    for name, (array, full) in pairs.items():
        if not isinstance(array, jax.Array) or array.sharding != shardings[name]:
            problems.append(f"{name}: {type(array).__name__} {getattr(array, 'sharding', '')}")
            continue
        for shard in array.addressable_shards:
            if not same_bytes(shard.data, full[shard.index]):
                problems.append(f"{name}: the shard {shard.index} differs")
    if not isinstance(restored["n"], np.ndarray) or not same_bytes(restored["n"], values["n"]):
        problems.append("n differs or is not NumPy")
    meta = [getattr(restored["w"], m) for m in ("dtype", "axis", "block_2d", "rht")]
    if meta != [jnp.dtype(jnp.bfloat16), -1, False, False]:
        problems.append(f"w's metadata {meta}")
    return problems


def child(process_id: int, port: int, workdir: str, mode: str = "save") -> None:
    """One of the two processes: saves, fails to save without force, saves again, restores.

    In `mode` "kill", it saves once, then saves again and process 1 dies in the middle of
    that save (after orbax wrote its shards, before the processes agree to commit).
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=PROCESSES,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == PROCESSES and jax.device_count() == 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
    path = os.path.join(workdir, "ckpt")
    if mode == "kill":
        save_checkpoint(path, sharded_tree(full_values(0), mesh))
        if process_id == 1:
            from nvfp4_jax._src.io.checkpoint import save as checkpoint_save  # noqa: PLC0415

            checkpoint_save.fsync_tree = lambda top: os._exit(KILLED)
        save_checkpoint(path, sharded_tree(full_values(1), mesh), force=True)
        raise AssertionError("the save went on after process 1 died")
    report = {"process": process_id, "problems": []}

    save_checkpoint(path, sharded_tree(full_values(0), mesh))
    try:  # only process 0 looks at the directory; both must raise
        save_checkpoint(path, sharded_tree(full_values(1), mesh))
        report["problems"].append("a save over a checkpoint without force did not raise")
    except FileExistsError as e:
        report["exists_error"] = str(e)
    new = full_values(1)
    save_checkpoint(path, sharded_tree(new, mesh), force=True)
    report["listing"] = sorted(os.listdir(path))
    target = sharded_tree(full_values(2), mesh)
    restored = restore_checkpoint(path, target)
    report["problems"] += check_restored(restored, new, target)
    abstract = jax.tree.map(  # ShapeDtypeStructs with the shardings; `n` stays NumPy
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        target,
    )
    report["problems"] += check_restored(restore_checkpoint(path, abstract), new, target)
    with open(os.path.join(workdir, f"report-{process_id}.json"), "w") as f:
        json.dump(report, f)
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(workdir, mode: str) -> list[subprocess.Popen]:
    from helpers import xla_compile_flags  # noqa: PLC0415 (this file also runs as a child)

    devices = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{xla_compile_flags()} {devices}".strip()
    )
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(workdir), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(PROCESSES)
    ]


def restore_in_this_process(path, values: dict) -> None:
    """Restores `path` here and checks every bit against `values` (of `full_values`)."""
    parts = {p: jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in values["w"].items()}
    meta = dict(dtype=jnp.dtype(jnp.bfloat16), axis=-1, block_2d=False, rht=False)
    target = {
        "w": NVFP4Array(**parts, **meta),
        "b": jax.ShapeDtypeStruct(values["b"].shape, values["b"].dtype),
        "n": np.zeros_like(values["n"]),
    }
    restored = restore_checkpoint(path, target)
    for part, value in values["w"].items():
        assert same_bytes(getattr(restored["w"], part), value), part
    assert same_bytes(restored["b"], values["b"])
    assert isinstance(restored["n"], np.ndarray) and same_bytes(restored["n"], values["n"])


@pytest.mark.multiprocess
def test_two_processes_save_and_restore_one_sharded_checkpoint(tmp_path):
    started = time.monotonic()
    procs = start_processes(tmp_path, "save")
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-5000:]
    print(f"two processes took {time.monotonic() - started:.1f} s")

    reports = [json.loads((tmp_path / f"report-{i}.json").read_text()) for i in range(PROCESSES)]
    for report in reports:
        assert report["problems"] == [], report
        assert "already holds a checkpoint" in report["exists_error"], report
        assert report["listing"] == reports[0]["listing"]
    assert "process 0" in reports[1]["exists_error"]  # process 1 raised process 0's error
    current = (tmp_path / "ckpt" / "CURRENT").read_text().strip()
    assert reports[0]["listing"] == ["CURRENT", current]  # the first snapshot is gone

    # In this single process: every bit of the checkpoint the two processes wrote.
    restore_in_this_process(tmp_path / "ckpt", full_values(1))


@pytest.mark.multiprocess
def test_a_process_killed_in_the_middle_of_a_save_leaves_the_old_checkpoint(tmp_path):
    """Process 1 dies after writing its shards of a second save; process 0, left waiting for
    it, is killed too. The checkpoint is the first save, whole, and a later save (here, one
    process) replaces it and removes what the dead save left."""
    procs = start_processes(tmp_path, "kill")
    try:
        output = procs[1].communicate(timeout=90)[0]
        assert procs[1].returncode == KILLED, output[-5000:]
        try:  # process 0 waits for the dead one until JAX's coordination gives up, or we do
            procs[0].communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    path = tmp_path / "ckpt"
    leftovers = sorted(n for n in os.listdir(path) if n != "CURRENT")
    assert len(leftovers) == 2, leftovers  # the current snapshot and the dead save's
    restore_in_this_process(path, full_values(0))
    save_checkpoint(path, {"b": jnp.zeros(3)}, force=True)
    current = (path / "CURRENT").read_text().strip()
    assert sorted(os.listdir(path)) == ["CURRENT", current]


if __name__ == "__main__":
    child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
