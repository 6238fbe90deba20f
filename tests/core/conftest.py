"""Fixtures of the core tests: `impls`, every implementation the property tests compare."""

from __future__ import annotations

import pytest
from helpers import Impl, make_impl


@pytest.fixture(scope="module")
def impls() -> list[Impl]:
    """The reference, the CPU kernels (or a skip saying why not), the CUDA kernels if any."""
    found = [make_impl("reference"), make_impl("cpu")]
    try:
        found.append(make_impl("cuda"))
    except pytest.skip.Exception:
        pass
    return found
