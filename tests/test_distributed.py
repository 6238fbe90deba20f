"""Sharded quantization and training on 8 CPU devices, bit for bit against one device.

The checks live in `distributed_checks.py`, run once as a subprocess: the 8 host devices need
`--xla_force_host_platform_device_count=8` before JAX initializes, and this pytest process
has already initialized it. Each test below reports one check of that run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("distributed_checks.py")
CHECKS = [
    "quantize_jit_sharded",
    "quantize_shard_map_global_amax",
    "quantize_shard_map_sr",
    "other_ops_jit_sharded",
    "ffi_hlo_no_all_gather",
    "data_parallel_step",
    "fsdp_step",
]


def run_script(*names, timeout):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    repo = str(SCRIPT.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def report():
    """{check name: its PASS/FAIL line}, the whole output, and the exit code."""
    run = run_script(*CHECKS, timeout=600)
    output = run.stdout + run.stderr
    lines = {}
    for line in run.stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL"):
            lines[rest.split(":")[0]] = line
    return lines, output, run.returncode


@pytest.mark.parametrize("check", CHECKS)
def test_sharded_equals_unsharded(report, check):
    lines, output, returncode = report
    assert check in lines, f"{check} did not report (exit code {returncode}):\n{output[-4000:]}"
    assert lines[check].startswith("PASS"), output[-4000:]


def test_script_fails_loudly_on_an_unknown_check():
    run = run_script("no_such_check", timeout=120)
    assert run.returncode != 0 and "FAIL no_such_check" in run.stdout
