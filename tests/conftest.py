"""Shared test data generators and fixtures (generic: no package imports here)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

DTYPE_NAMES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for a short name: f32, bf16, f16."""
    return np.dtype(DTYPE_NAMES[name])


def heavy_tailed(shape, dtype="f32", *, seed=0, outliers=True, row_axis=-1) -> np.ndarray:
    """Standard normal times a lognormal factor per row (rows along ``row_axis``), + outliers.

    The per-row factor spans several decades (sigma=1.5), so tensor and block amaxes differ
    widely; about 0.1% of the elements are multiplied by 30 to 300 (outliers). The values
    are representable in ``dtype`` (rounded once, here) and returned in that dtype.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float64)
    fshape = list(shape)
    fshape[row_axis % len(shape)] = 1  # one factor per row: constant along the row axis
    x *= rng.lognormal(0.0, 1.5, size=fshape)
    if outliers:
        mask = rng.random(shape) < 1e-3
        x = np.where(mask, x * rng.uniform(30, 300, size=shape), x)
    if np_dtype(dtype) == np.float16:
        x = x / np.max(np.abs(x)) * 3e4  # keep inside f16 range
    return x.astype(np.float32).astype(np_dtype(dtype))


def with_underflow_block(x: np.ndarray, *, row=0, block=0, scale=1e-7) -> np.ndarray:
    """Overwrite one 16-block along the last axis with values far below the tensor amax."""
    x = x.copy()
    amax = float(np.max(np.abs(x.astype(np.float32))))
    rng = np.random.default_rng(123)
    vals = rng.uniform(0.5, 1.0, 16) * rng.choice([-1.0, 1.0], 16) * amax * scale
    idx = (row,) * (x.ndim - 1) if x.ndim > 1 else ()
    x[idx + (slice(16 * block, 16 * block + 16),)] = vals.astype(x.dtype)
    return x


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _run_check_script(script: str, names, timeout: float):
    """Runs tests/<script> with `names` in a fresh Python on the CPU platform.

    Multi-device checks need `--xla_force_host_platform_device_count=8` before JAX starts,
    which this pytest process has already done, so they run in a subprocess. Returns
    ({check name: its PASS/FAIL line}, stdout + stderr, exit code).
    """
    import os  # noqa: PLC0415
    import pathlib  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    path = pathlib.Path(__file__).with_name(script)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(path.parent.parent), env.get("PYTHONPATH")])
    )
    run = subprocess.run(
        [sys.executable, str(path), *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    lines = {}
    for line in run.stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL"):
            lines[rest.split(":")[0]] = line
    return lines, run.stdout + run.stderr, run.returncode


@pytest.fixture(scope="session")
def run_check_script():
    """The function `_run_check_script(script, names, timeout)`, for multi-device checks."""
    return _run_check_script
