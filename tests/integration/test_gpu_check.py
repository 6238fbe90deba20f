"""scripts/gpu_check.sh and benchmarks/bench_gpu.py on a machine without a GPU.

The script's GPU steps can only run on a GPU machine; here it must check what it can (the
modules import, the benchmark script's arguments), say there is no GPU and exit 2, and
reject bad arguments with exit 2 and its usage. The build step is skipped (--skip-build):
the suite runs against the installed build, and a rebuild would replace the modules other
test processes have loaded. On a machine that has a GPU (where gpu_check.sh itself runs this
suite) --assume-no-gpu gives the same path.

bench_gpu.py refuses to run without a GPU (exit 2) unless --allow-cpu with a small size,
which runs every part of it on the CPU kernels: that smoke test keeps the benchmark's code
working between GPU runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BENCH = ROOT / "benchmarks" / "bench_gpu.py"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def cpu_env() -> dict:
    """The environment of a child that must not start a GPU backend, whatever the machine."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def gpu_check(*args, timeout=180):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def no_gpu_flags() -> list[str]:
    return [] if shutil.which("nvidia-smi") is None else ["--assume-no-gpu"]


def test_no_gpu_path_checks_what_it_can_and_exits_2(tmp_path):
    out = tmp_path / "results"
    run = gpu_check("--skip-build", "--python", sys.executable, "--out", str(out), *no_gpu_flags())
    assert run.returncode == 2, run.stdout + run.stderr
    assert "NO GPU" in run.stdout
    assert "the build and the checks above passed" in run.stdout, run.stdout
    summaries = list(out.glob("nogpu_*_summary.txt"))
    assert len(summaries) == 1, sorted(p.name for p in out.iterdir())
    summary = summaries[0].read_text()
    for step in ("import", "bench args"):
        line = next(x for x in summary.splitlines() if x.startswith(f"| {step} "))
        assert "PASS" in line, summary
    assert "SKIPPED (--skip-build)" in summary
    # The import step saw the CPU kernels; the benchmark refused to run without a GPU.
    assert "cpu kernels: available" in next(out.glob("nogpu_*_import.log")).read_text()
    bench_log = next(out.glob("nogpu_*_bench_args.log")).read_text()
    assert "no CUDA GPU" in bench_log and "arguments ok" in bench_log
    # No GPU step ran.
    assert not list(out.glob("*sanitizer*")) and not list(out.glob("*_bench.txt"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown argument: --bogus"),
        (["--quick", "extra"], "unknown argument: extra"),
        (["--out"], "--out needs a value"),
        (["--out", "--quick"], "--out needs a value"),
        (["--python", "/nonexistent/python3"], "is not an executable"),
        (["--python="], "--python needs a value"),
        (["--python", "/bin/sh"], "is not a Python >= 3.11"),
    ],
)
def test_bad_arguments_exit_2_with_usage(args, message):
    run = gpu_check(*args, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr
    assert "usage: scripts/gpu_check.sh" in run.stderr
    assert "NO GPU" not in run.stdout  # nothing ran


def test_help_exits_0():
    run = gpu_check("--help", timeout=60)
    assert run.returncode == 0
    assert "--skip-sanitizer" in run.stdout and "--quick" in run.stdout


def bench(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=ROOT,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_bench_gpu_refuses_without_a_gpu():
    run = bench("--iters", "1")
    assert run.returncode == 2
    assert "no CUDA GPU" in run.stderr
    run = bench("--allow-cpu", "--size", "4096")
    assert run.returncode == 2
    assert "at most 1024" in run.stderr
    run = bench("--size", "100")  # not a multiple of 16: argparse's exit 2
    assert run.returncode == 2 and "multiples of 16" in run.stderr


def test_bench_gpu_smoke_on_cpu(tmp_path):
    table = tmp_path / "bench.txt"
    run = bench(
        "--allow-cpu", "--size", "128x256", "--dense-size", "64,128,32", "--iters", "2",
        "--warmup", "1", "--out", str(table),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(table.with_suffix(".json").read_text())
    assert result["platform"] == "cpu" and result["size"] == [128, 256]
    assert result["copy"]["GBps"] > 0
    ops = [row["op"] for row in result["kernels"]]
    assert ops == [
        "quantize RN", "quantize SR", "quantize RHT", "quantize MS-EDEN", "dequantize bf16"
    ]  # fmt: skip
    n = 128 * 256
    for row in result["kernels"]:
        assert row["ms"] > 0 and row["reference_ms"] > 0
        assert row["GBps"] == pytest.approx(row["bytes"] / (row["ms"] / 1e3) / 1e9)
        assert row["share_of_copy"] == pytest.approx(row["GBps"] / result["copy"]["GBps"])
        assert row["reference_over_ffi"] == pytest.approx(row["reference_ms"] / row["ms"])
    # Minimum bytes: bf16 read + codes + scales; dequantize codes + scales + bf16 written.
    assert result["kernels"][0]["bytes"] == 2 * n + n // 2 + n // 16
    assert result["kernels"][3]["bytes"] == n // 2 + n // 16 + 2 * n
    dense = {row["variant"]: row for row in result["dense"]}
    assert result["dense_size"] == [64, 128, 32]
    assert {"bf16", "nvfp4 reference", "nvfp4 ffi"} <= set(dense)
    assert dense["bf16"]["vs_bf16"] == 1.0
    for row in dense.values():
        assert row["ms"] > 0
        assert row["vs_bf16"] == pytest.approx(row["ms"] / dense["bf16"]["ms"])
    text = table.read_text()
    assert text == run.stdout  # the file holds what was printed
    assert "| quantize RHT" in text and "| nvfp4 ffi" in text and "# device: cpu" in text
