"""The CUDA kernels' launch geometry, checked on the host (no GPU needed).

ffi/include/nvfp4/launch.h holds the grid sizes of every CUDA launch and the thread -> block
mapping of the 16x16 quantize kernel as plain C++; tests/cuda_launch_check.cc exercises them
(1-element to 2^31+-element tensors, the 2^31 - 1 grid limit, every block covered exactly
once). This test builds that program with the host C++ compiler and runs it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def compiler() -> str:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    pytest.skip("no host C++ compiler")


def test_launch_geometry(tmp_path):
    binary = tmp_path / "cuda_launch_check"
    build = subprocess.run(
        [
            compiler(),
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
            str(ROOT / "ffi" / "include"),
            str(ROOT / "tests" / "cuda_launch_check.cc"),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([binary], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout
    # The program ran its checks (a build that skipped them would print "ok 0").
    assert run.stdout.startswith("ok ") and int(run.stdout.split()[1]) > 1000, run.stdout
