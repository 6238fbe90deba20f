"""One of the JAX processes of `tests/integration/test_multiprocess.py` (not a test module itself).

    python tests/integration/multiprocess_child.py \
        PROCESS_ID NUM_PROCESSES PORT WORKDIR TASK [TASK ...]

Each process sees 4 CPU devices; `jax.distributed.initialize` on a coordinator at
127.0.0.1:PORT joins them into one runtime of NUM_PROCESSES * 4 devices with gloo
collectives. Every task runs in every process (they are collective programs) and returns
`{name: NumPy array}` of GLOBAL values, gathered across the processes; process 0 writes
them to `WORKDIR/<task>.npz` for the parent test to compare with one process's results.
Files a task shares between the processes (checkpoints) go under `WORKDIR` too.
"""

from __future__ import annotations

import os
import sys

DEVICES_PER_PROCESS = 4
# The parent's compile flags (XLA_FLAGS without its device count), and this process's count.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
    ]
).strip()

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(argv: list[str]) -> None:
    process_id, num_processes, port = int(argv[0]), int(argv[1]), int(argv[2])
    workdir, tasks = argv[3], argv[4:]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == num_processes
    assert jax.local_device_count() == DEVICES_PER_PROCESS
    # The shared test code (training/distributed_setup.py), imported after the runtime
    # started: it sees the global 8 devices.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # tasks, and tests/ (helpers, training/)
    import multiprocess_tasks  # noqa: PLC0415

    for task in tasks:
        results = multiprocess_tasks.TASKS[task](workdir)
        if jax.process_index() == 0:
            import numpy as np  # noqa: PLC0415

            tmp = os.path.join(workdir, f"{task}.tmp.npz")
            np.savez(tmp, **results)
            os.replace(tmp, os.path.join(workdir, f"{task}.npz"))
        print(f"process {process_id}: {task} done", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
