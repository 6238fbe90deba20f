"""The child process of the checkpoint fault test: saves checkpoints and dies during the saves.

    python checkpoint_crash_child.py WORKDIR PLAN_JSON

WORKDIR holds `base-<name>` directories, each an existing checkpoint of `make_tree(0)` (or
absent: a first save). For every run of the plan the child copies a base to
`WORKDIR/runs/<name>-<run>`, forks (JAX is imported but not started yet, so forking is safe
and costs no import), and the fork saves `make_tree(1)` there with `force=True` and dies in
the middle:

* kill points: the fork wraps the filesystem functions a save goes through (`os.rename`,
  `os.replace`, `os.fsync`, `os.mkdir`, `os.remove`, `os.unlink`, `os.rmdir`, `shutil.rmtree`,
  `open` for writing; orbax's finalize is an `os.rename`) and calls `os._exit(9)` instead of
  the k-th call of one of them whose first argument contains a given text. With no list of
  points, k = 1, 2, ... for every function until a save completes without reaching k.
* random kills: an unarmed fork gets SIGKILL a random time after it starts its save (up to
  the longest save seen); the native writes of tensorstore happen in that window.

Prints one JSON list: per run its directory, base, kind, kill point or delay, the call it
died in and its outcome ("killed" or "completed").
"""

from __future__ import annotations

import builtins
import json
import os
import random
import shutil
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax.checkpoint import save_checkpoint

KILLED = 9
_FS_CALLS = [
    (os, "rename"),
    (os, "replace"),
    (os, "fsync"),
    (os, "mkdir"),
    (os, "remove"),
    (os, "unlink"),
    (os, "rmdir"),
    (shutil, "rmtree"),
]


def make_tree(seed: int, *, with_key: bool = True) -> dict:
    """A small tree of every kind of leaf; `seed` changes every value (not the structure)."""
    rng = np.random.default_rng(seed)
    scale_bytes = rng.integers(0, 0x7E, (32, 4), dtype=np.uint8)  # finite E4M3 values
    q = NVFP4Array(
        codes=rng.integers(0, 256, (32, 32), dtype=np.uint8),
        scales=scale_bytes.view(ml_dtypes.float8_e4m3fn),
        amax=np.float32(rng.uniform(1, 10)).reshape(()),
        dtype=jnp.dtype(jnp.bfloat16),
        axis=-1,
        block_2d=False,
        rht=False,
    )
    tree = {
        "w": q,
        "b": jnp.asarray(rng.standard_normal(32), jnp.float32),
        "layers": {"0": rng.standard_normal((8, 8))},  # float64: stays NumPy
    }
    if with_key:
        tree["rng"] = jax.random.key(seed)
    return tree


def _arm(kill: tuple[str, int, str], report: int) -> None:
    """Wraps the filesystem functions so that the process dies at the kill point."""
    target, k, text = kill
    lock, calls = threading.Lock(), [0]

    def wrap(fn, label, counts=lambda *a, **kw: True):
        def call(*args, **kwargs):
            if label == target and text in str(args[0]) and counts(*args, **kwargs):
                with lock:
                    calls[0] += 1
                    hit = calls[0] == k
                if hit:
                    os.write(report, f"kill {label} {k} {args[0]!s:.200}\n".encode())
                    os._exit(KILLED)
            return fn(*args, **kwargs)

        return call

    for module, name in _FS_CALLS:
        setattr(module, name, wrap(getattr(module, name), name))
    builtins.open = wrap(builtins.open, "open", _opens_for_writing)


def _opens_for_writing(file, mode="r", *args, **kwargs) -> bool:
    return any(c in mode for c in "wax+")


def _save_in_fork(run_dir: str, kill, report: int) -> None:
    """The fork: builds the new tree (starting JAX), arms, saves, exits without cleanup."""
    try:
        tree = make_tree(1)
        if kill is not None:
            _arm(kill, report)
        os.write(report, b"start\n")
        save_checkpoint(run_dir, tree, force=True)
        os.write(report, b"done\n")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001  (any exception is a failure of the test)
        os.write(report, f"error {type(e).__name__}: {e}\n".encode())
        os._exit(3)


def _run(run_dir: str, kill=None, delay: float | None = None) -> dict:
    """One fork saving to `run_dir`, dying at the kill point or by SIGKILL `delay` s in."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _save_in_fork(run_dir, kill, write)
    os.close(write)
    with os.fdopen(read, "r") as report:
        first = report.readline()
        started = time.monotonic()
        if delay is not None and first == "start\n":
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
        rest = report.read()
        save_s = time.monotonic() - started
    _, status = os.waitpid(pid, 0)
    lines = (first + rest).splitlines()
    return {
        "dir": run_dir,
        "kill": kill,
        "delay": delay,
        "outcome": "completed" if "done" in lines else "killed",
        "exit": os.waitstatus_to_exitcode(status),
        "report": [line for line in lines if line not in ("start", "done")],
        "save_s": save_s,
    }


def _fresh_copy(workdir: str, base: str, run: str) -> str:
    run_dir = os.path.join(workdir, "runs", f"{base}-{run}")
    source = os.path.join(workdir, f"base-{base}")
    if os.path.isdir(source):
        shutil.copytree(source, run_dir)
    else:
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    return run_dir


def _kill_point_runs(workdir: str, base: str, points: list | None) -> list:
    if points is not None:
        return [
            _run(_fresh_copy(workdir, base, f"{i:03d}"), kill=tuple(p))
            for i, p in enumerate(points)
        ]
    results = []
    for label in [name for _, name in _FS_CALLS] + ["open"]:
        for k in range(1, 1000):
            results.append(
                _run(_fresh_copy(workdir, base, f"{label}-{k:03d}"), kill=(label, k, ""))
            )
            if results[-1]["outcome"] == "completed":
                break
    return results


def _base_runs(workdir: str, base: str, spec: dict, rng) -> list:
    results = [{**run, "kind": "call"} for run in _kill_point_runs(workdir, base, spec["points"])]
    longest = max([run["save_s"] for run in results], default=0.5)
    for i in range(spec["random"]):
        run = _run(_fresh_copy(workdir, base, f"sigkill-{i}"), delay=rng.uniform(0.0, longest))
        results.append({**run, "kind": "sigkill"})
    return [{**run, "base": base} for run in results]


def main() -> None:
    """Runs the plan: `{"seed": s, "bases": {name: {"points": [...] or None, "random": n}}}`.

    A point is `[function, k, text]`: the k-th call of `function` whose first argument
    contains `text`.
    """
    workdir, plan = sys.argv[1], json.loads(sys.argv[2])
    rng = random.Random(plan["seed"])
    results = []
    for base, spec in plan["bases"].items():
        results += _base_runs(workdir, base, spec, rng)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
