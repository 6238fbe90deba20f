"""Session setup, the `impl` fixture that runs one test suite on every implementation, and
the `integration` marker.

JAX sees 8 CPU devices in every test process (the flag must be set before JAX starts), so
the multi-device tests are ordinary tests; single-device tests run on device 0 as usual.

`tests/` mirrors the package: `core/`, `training/`, `flax/`, `io/`, `model/` hold the tests of
`nvfp4_jax/_src/<package>/`, one file per module or feature. `integration/` holds the tests
that start processes, train the example or need optional engines: every test there is
marked `integration`, so `pytest -m "not integration"` is the fast inner loop.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

import pathlib

import pytest
from helpers import IMPLEMENTATIONS, NATIVE, Impl, make_impl

INTEGRATION = pathlib.Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config, items):
    """Mark every test under tests/integration/ as `integration`."""
    del config
    for item in items:
        if INTEGRATION in pathlib.Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request) -> Impl:
    """Every implementation in turn: the reference, the CPU kernels, the CUDA kernels."""
    return make_impl(request.param)


@pytest.fixture(params=NATIVE)
def native(request) -> Impl:
    """Every native implementation in turn (the CPU kernels, the CUDA kernels)."""
    return make_impl(request.param)
