"""What the checkpoint writers (`checkpoint`, `hf`) share: durable writes and leaf names.

A save is durable once its files and the directories that name them are flushed to disk:
`fsync_path` flushes one file or directory (on macOS with `F_FULLFSYNC`, since its `fsync`
stops at the drive's cache), `fsync_tree` a whole directory tree.
"""

from __future__ import annotations

import os

import jax

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
