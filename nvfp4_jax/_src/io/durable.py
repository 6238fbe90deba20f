"""What the checkpoint writers (`checkpoint`, `hf`) share: durable writes, leaf names, steps.

A save is durable once its files and the directories that name them are flushed to disk:
`fsync_path` flushes one file or directory (on macOS with `F_FULLFSYNC`, since its `fsync`
stops at the drive's cache), `fsync_tree` a whole directory tree.

In a multi-process JAX program every process calls the writer; `collective` runs one step on
process 0 (or on all) and shares its outcome, a failure included, with every process
(`core/multihost.py`'s `to_host` gathers a global array's value onto every host).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None


def fsync_fd(fd: int) -> None:
    """Flushes an open file descriptor to disk."""
    if fcntl is not None and hasattr(fcntl, "F_FULLFSYNC"):  # macOS: fsync stops at the drive
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def fsync_path(path: str) -> None:
    """Flushes a file or a directory to disk (a directory: its entries, e.g. a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def fsync_tree(top: str) -> None:
    """Flushes every file and directory under `top`, `top` included."""
    for root, _, files in os.walk(top):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def key_name(key) -> str:
    """The name of one entry of a pytree key path (a dict key, attribute name or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_key_array(value) -> bool:
    """Whether `value` is a typed PRNG key array."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# --- several processes ------------------------------------------------------------------------

# A step's outcome as every process shares it: JSON, in a fixed number of bytes.
_SHARED_BYTES = 8192
_SHARED_ERRORS = {
    e.__name__: e
    for e in (
        FileExistsError,
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
        OSError,
        ValueError,
        TypeError,
    )
}


def collective(op: str, what: str, step, *, primary: bool):
    """Runs `step` on process 0 (`primary`) or on every process, then waits for all.

    Returns process 0's result (JSON: a string or None) on every process. If `step` raised
    on some process, every process raises: that one its own exception, the others one of the
    same type (`RuntimeError` for an unusual one) naming the process and the step. `op` names
    the public function in messages. With one process it just runs `step`.
    """
    if jax.process_count() == 1:
        return step()
    outcome, error = {"result": None, "error": None}, None
    if not primary or jax.process_index() == 0:
        try:
            outcome["result"] = step()
        except Exception as e:  # noqa: BLE001  (shared with every process, then raised)
            error = e
            outcome["error"] = [type(e).__name__, str(e)]
    from jax.experimental import multihost_utils  # noqa: PLC0415

    rows = multihost_utils.process_allgather(_encode(op, outcome))
    outcomes = [_decode(row) for row in np.asarray(rows).reshape(jax.process_count(), -1)]
    if error is not None:
        raise error
    for index, other in enumerate(outcomes):
        if other["error"] is not None:
            kind, message = other["error"]
            raise _SHARED_ERRORS.get(kind, RuntimeError)(
                f"{message} (a {kind} of process {index} while {what})"
            )
    return outcomes[0]["result"]


def _encode(op: str, outcome: dict) -> np.ndarray:
    """`outcome` as `_SHARED_BYTES` bytes of ASCII JSON (a long error message shortened)."""
    data = json.dumps(outcome).encode()
    if len(data) > _SHARED_BYTES and outcome["error"] is not None:
        kind, message = outcome["error"]  # an escaped character takes at most 12 bytes
        outcome = {**outcome, "error": [kind[:100], message[: _SHARED_BYTES // 16] + "..."]}
        data = json.dumps(outcome).encode()
    if len(data) > _SHARED_BYTES:  # not a name the writers make
        raise ValueError(f"{op}: a result of {len(data)} bytes is too long to share")
    return np.frombuffer(data.ljust(_SHARED_BYTES, b"\0"), np.uint8)


def _decode(row: np.ndarray) -> dict:
    return json.loads(bytes(np.asarray(row, np.uint8)).rstrip(b"\0").decode())
