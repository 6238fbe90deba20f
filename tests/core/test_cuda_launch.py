"""The CUDA kernels' launch geometry, checked on the host (no GPU needed).

ffi/include/nvfp4/launch.h holds the grid sizes of every CUDA launch and the thread -> block
mapping of the 16x16 quantize kernel as plain C++; tests/cuda_launch_check.cc exercises them
(1-element to 2^31+-element tensors, the 2^31 - 1 grid limit, every block covered exactly
once). This test builds that program with the host C++ compiler and runs it.
"""

from __future__ import annotations

import subprocess

from helpers import build_host_check


def test_launch_geometry(tmp_path):
    binary = build_host_check("cuda_launch_check.cc", tmp_path / "cuda_launch_check")
    run = subprocess.run([binary], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout
    # The program ran its checks (a build that skipped them would print "ok 0").
    assert run.stdout.startswith("ok ") and int(run.stdout.split()[1]) > 1000, run.stdout
