"""Loading the native modules (nvfp4_jax/_src/core/kernels/_library.py): the CUDA module's
load-time probe gives a reason or nothing, and a reason makes CUDA unavailable.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from nvfp4_jax import kernels
from nvfp4_jax._src.core.kernels import _library

if not kernels.is_available("cpu"):  # registers the targets
    pytest.skip(
        f"native CPU kernels not built: {kernels.unavailable_reason('cpu')}",
        allow_module_level=True,
    )


# --- the CUDA module's load-time probe ---------------------------------------------------------


def cuda_module():
    try:
        from nvfp4_jax import _nvfp4_cuda  # noqa: PLC0415
    except ImportError as e:
        pytest.skip(f"the CUDA module is not built: {e}")
    return _nvfp4_cuda


def test_cuda_probe_returns_a_reason_or_nothing():
    module = cuda_module()
    # In a fresh process, before anything else touched CUDA: must not crash or abort.
    run = subprocess.run(
        [sys.executable, "-c", "from nvfp4_jax import _nvfp4_cuda as m; print(repr(m.probe()))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    reason = module.probe()
    assert isinstance(reason, str)
    assert repr(reason) in run.stdout
    if reason and "compute capability" in reason:
        assert "CMAKE_CUDA_ARCHITECTURES" in reason


def test_probe_reason_makes_cuda_unavailable(monkeypatch):
    reason = "no kernel image for CUDA device 0 (compute capability 8.0); built for 90"
    fake = types.ModuleType("nvfp4_jax._fake_cuda")
    fake.probe = lambda: reason
    # The fake stands in for the loaded module (nothing of it is registered with XLA).
    monkeypatch.setattr(_library, "_loaded", {"cuda": fake})
    monkeypatch.setattr(_library, "_status", {})
    monkeypatch.setattr(_library, "_gpu_backend_present", lambda: True)
    assert not kernels.is_available("cuda")
    assert reason in kernels.unavailable_reason("cuda")
