"""Fixtures of the checkpoint tests shared by the files that read a ModelOpt fixture
(`tests/fixtures/modelopt_*`): each such test module names its fixture directory as
`FIXTURE` (and its ModelOpt reference outputs as `REFERENCE`)."""

from __future__ import annotations

import pytest

import nvfp4_jax.hf as hf


@pytest.fixture(scope="module")
def fixture_tensors(request) -> dict:
    """The fixture checkpoint's tensors, by name."""
    return hf.read_safetensors(request.module.FIXTURE / "model.safetensors")


@pytest.fixture(scope="module")
def source(request) -> dict:
    """The bf16 weights ModelOpt quantized (HF names, (out, in))."""
    return hf.read_safetensors(request.module.REFERENCE / "source_weights_bf16.safetensors")
