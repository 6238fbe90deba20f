"""Export: the files written, all or nothing: shards, a temporary directory, one writer.

The units go into safetensors shards of at most `max_shard_size` bytes (with an index when
there are several) and the configs beside them, in a temporary sibling of the checkpoint
directory that is moved into place when complete; files of an existing directory besides
weights and configs (a tokenizer) are carried over. In a program of several processes,
process 0 writes and the others take part in the same gathers of sharded arrays.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import jax

from nvfp4_jax._src.io.durable import collective, fsync_path
from nvfp4_jax._src.io.hf.format import (
    CONFIG_NAME,
    INDEX_NAME,
    QUANT_CONFIG_NAME,
    WEIGHTS_NAME,
    write_json,
)
from nvfp4_jax._src.io.hf.safetensors_files import Unit, write_safetensors

_EXPORT = "export_hf_checkpoint"
_WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")


def _shards(units: list[Unit], max_size: int) -> list[list[Unit]]:
    shards: list[list[Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes
    return shards


def write_weights(tmp: str, units: list[Unit], max_size: int) -> tuple[list[str], int]:
    shards = _shards(units, max_size)
    n = len(shards)
    names = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(os.path.join(tmp, name), shard, {"format": "pt"})
        weight_map.update({spec[0]: name for unit in shard for spec in unit.specs})
    total = sum(unit.nbytes for unit in units)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(os.path.join(tmp, INDEX_NAME), index)
    return names, total


def check_target(directory: str, force: bool) -> None:
    """`_check_target` on process 0, its outcome raised on every process."""
    collective(
        _EXPORT, "checking the directory", lambda: _check_target(directory, force), primary=True
    )


def _check_target(directory: str, force: bool) -> None:
    """A folder holding weights needs `force`; one holding configs and a tokenizer does not."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"export_hf_checkpoint: {directory} exists and is not a directory")
    if not os.path.isdir(directory) or force:
        return
    weights = sorted(n for n in os.listdir(directory) if _replaced(n))
    if weights:
        raise FileExistsError(
            f"export_hf_checkpoint: {directory} is not empty: it holds weights {weights} "
            "(force=True replaces them; its other files, e.g. the tokenizer, are kept)"
        )


def _replaced(name: str) -> bool:
    """Whether an export replaces the file `name` as weights (config.json is merged, not)."""
    return name == QUANT_CONFIG_NAME or name.endswith(_WEIGHT_FILES)


def _carry_over(old: str, new: str) -> None:
    """Copies what `old` holds besides weights and the configs we write (tokenizer, ...)."""
    if not os.path.isdir(old):
        return
    for name in os.listdir(old):
        source, target = os.path.join(old, name), os.path.join(new, name)
        if name == CONFIG_NAME or _replaced(name) or os.path.lexists(target):
            continue  # (what the export wrote itself, e.g. tokenizer="bytes", wins)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True)
        else:
            shutil.copy2(source, target, follow_symlinks=False)


def _move_into_place(tmp: str, directory: str) -> None:
    """Renames the finished `tmp` to `directory`, replacing what was there."""
    parent = os.path.dirname(directory)
    if not os.path.lexists(directory) or not os.listdir(directory):
        os.replace(tmp, directory)  # atomic; replaces an empty directory
    else:
        old = os.path.join(parent, f".{os.path.basename(directory)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(directory, old)
        try:
            os.rename(tmp, directory)
        except BaseException:
            os.rename(old, directory)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(parent)


def _write_directory(directory: str, write: Callable[[str], Any]):
    """Runs `write(tmp)` in a temporary sibling of `directory`, then moves it into place."""
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)  # (not mkdtemp: the checkpoint keeps the umask's permissions)
    try:
        result = write(tmp)
        _carry_over(directory, tmp)
        fsync_path(tmp)
        _move_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def write_once(directory: str, write: Callable[[str], Any], units: list[Unit]):
    """`_write_directory(directory, write)`, once, in a program of one or several processes.

    With several processes (all calling `export_hf_checkpoint` alike), process 0 writes; the
    others produce every unit in the same order, which takes part in the gathers of sharded
    arrays (collectives). If process 0 fails, it still produces the units it did not reach,
    so the gathers stay in step, and then every process raises its error.
    """
    if jax.process_count() == 1:
        return _write_directory(directory, write)
    produced = [0]
    counted = [Unit(u.specs, _counting(u.produce, produced)) for u in units]
    done = None
    if jax.process_index() == 0:
        try:
            done = _write_directory(directory, lambda tmp: write(tmp, counted))
        except Exception as error:  # noqa: BLE001  (raised on every process below)
            done = error
    for unit in counted[produced[0] :]:
        unit.produce()
    if isinstance(done, Exception):
        failed = done

        def fail():
            raise failed

        collective(_EXPORT, "writing the checkpoint", fail, primary=True)
    files = collective(_EXPORT, "writing the checkpoint", lambda: done, primary=True)
    return files


def _counting(produce: Callable, produced: list) -> Callable:
    def counted():
        produced[0] += 1
        return produce()

    return counted
