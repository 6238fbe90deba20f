"""Sharded quantization and training on 8 CPU devices, bit for bit against one device.

The checks live in `distributed_checks.py`, run once as a subprocess: the 8 host devices need
`--xla_force_host_platform_device_count=8` before JAX initializes, and this pytest process
has already initialized it. Each test below reports one check of that run.
"""

from __future__ import annotations

import pytest

SCRIPT = "distributed_checks.py"
CHECKS = [
    "quantize_jit_sharded",
    "quantize_shard_map_global_amax",
    "quantize_shard_map_sr",
    "other_ops_jit_sharded",
    "ffi_hlo_no_all_gather",
    "data_parallel_step",
    "fsdp_step",
]


@pytest.fixture(scope="module")
def report(run_check_script):
    """{check name: its PASS/FAIL line}, the whole output, and the exit code."""
    return run_check_script(SCRIPT, CHECKS, timeout=600)


@pytest.mark.parametrize("check", CHECKS)
def test_sharded_equals_unsharded(report, check):
    lines, output, returncode = report
    assert check in lines, f"{check} did not report (exit code {returncode}):\n{output[-4000:]}"
    assert lines[check].startswith("PASS"), output[-4000:]


def test_script_fails_loudly_on_an_unknown_check(run_check_script):
    lines, _, returncode = run_check_script(SCRIPT, ["no_such_check"], timeout=120)
    assert returncode != 0 and lines["no_such_check"].startswith("FAIL")
