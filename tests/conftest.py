"""Session setup and the `impl` fixture that runs one test suite on every implementation.

JAX sees 8 CPU devices in every test process (the flag must be set before JAX starts), so
the multi-device tests are ordinary tests; single-device tests run on device 0 as usual.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

import pytest
from helpers import IMPLEMENTATIONS, NATIVE, Impl, make_impl


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request) -> Impl:
    """Every implementation in turn: the reference, the CPU kernels, the CUDA kernels."""
    return make_impl(request.param)


@pytest.fixture(params=NATIVE)
def native(request) -> Impl:
    """Every native implementation in turn (the CPU kernels, the CUDA kernels)."""
    return make_impl(request.param)
