"""Two JAX processes on this machine against one: the multi-process runtime, bit for bit.

The fixture starts two processes (`multiprocess_child.py`) that join one JAX runtime through
`jax.distributed.initialize` on a local coordinator, 4 CPU devices each, gloo collectives,
and run the tasks of `multiprocess_tasks.py` on a mesh of all 8 devices. The same tasks run
here, in this one process with 8 devices, and the results must agree. Marked `multiprocess`
(run by default; `-m "not multiprocess"` leaves it out).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import multiprocess_tasks
import numpy as np
import pytest
from helpers import assert_same_bits, xla_compile_flags
from training.distributed_setup import EXACT_LEAVES, F32_SUM_TOLERANCE

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(jax.device_count("cpu") < 8, reason="needs 8 CPU devices"),
]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_child.py")
NUM_PROCESSES = 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Runs every task in two processes; returns the directory of their results."""
    workdir = str(tmp_path_factory.mktemp("multiprocess"))
    port = _free_port()
    # The children set their own device count and compile as this process does.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_compile_flags())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                CHILD,
                str(i),
                str(NUM_PROCESSES),
                str(port),
                workdir,
                *multiprocess_tasks.TASKS,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(NUM_PROCESSES)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for i, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {i} exited {proc.returncode}:\n{output[-6000:]}"
    return workdir


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same tasks in this process (8 devices), computed once per task on first use."""
    workdir = str(tmp_path_factory.mktemp("one_process"))
    cache: dict[str, dict] = {}

    def results(task: str) -> dict[str, np.ndarray]:
        if task not in cache:
            cache[task] = multiprocess_tasks.TASKS[task](workdir)
        return cache[task]

    return results


def _load(workdir: str, task: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(workdir, f"{task}.npz")) as f:
        return dict(f)


def test_sharded_quantization_matches_one_process(two_processes, one_process):
    got, want = _load(two_processes, "quantize"), one_process("quantize")
    assert sorted(got) == sorted(want)
    for name in want:
        assert_same_bits(got[name], want[name], name)


def test_train_steps_match_one_process(two_processes, one_process):
    """The NVFP4 weight gradients bit for bit (every quantized operand is the same bits however
    the devices are split between processes); the loss and the bias gradient are plain f32
    sums that gloo's all-reduce adds in another order than one process's: f32 rounding."""
    got, want = _load(two_processes, "train"), one_process("train")
    assert sorted(got) == sorted(want)
    for name in want:
        leaf = name.rsplit("/", 1)[1]
        if leaf in EXACT_LEAVES:
            assert_same_bits(got[name], want[name], name)
        else:
            scale = np.max(np.abs(want[name]))
            np.testing.assert_allclose(
                got[name], want[name], rtol=0, atol=F32_SUM_TOLERANCE * scale, err_msg=name
            )


def test_load_hf_checkpoint_reads_each_process_slices(two_processes, one_process):
    """The fixture's tensors, sharded along their output axis over 8 devices in 2 processes:
    the same bits as one process, and each process read about half of the files' bytes (the
    replicated norms and scalars in full, the rest only its own shards)."""
    got, want = _load(two_processes, "hf_load"), one_process("hf_load")
    per_process = got.pop("bytes read by each process")
    (everything,) = want.pop("bytes read by each process")
    assert sorted(got) == sorted(want)
    for name in want:
        assert_same_bits(got[name], want[name], name)
    assert len(per_process) == NUM_PROCESSES
    for count in per_process:
        assert everything / NUM_PROCESSES <= count < 0.55 * everything, (per_process, everything)


def test_export_hf_checkpoint_of_a_sharded_model_is_written_once(two_processes, one_process):
    """Two processes export one model sharded over their 8 devices (float kernels quantized
    by the exporter, NVFP4 ones written as loaded): one folder, the same bytes as one
    process's export of the same model."""
    got, want = _load(two_processes, "hf_export"), one_process("hf_export")
    assert sorted(got) == sorted(want)
    assert "model.safetensors" in want
    for name in want:
        assert_same_bits(got[name], want[name], name)
    leftovers = [n for n in os.listdir(two_processes) if n.startswith(".export")]
    assert leftovers == [], leftovers  # no temporary folder of a second writer
