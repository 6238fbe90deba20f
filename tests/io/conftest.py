"""Fixtures of the checkpoint tests shared by the files that read a ModelOpt fixture
(`tests/fixtures/modelopt_*`): each such test module names its fixture directory as
`FIXTURE` (and its ModelOpt reference outputs as `REFERENCE`); and the fixtures of the
ModelOpt Llama checkpoint (hf_fixture.py) that several test modules use: `input_amax`,
`imported`, `exports`, `flavour` (a module of another checkpoint defines its own, as
test_hf_moe_load.py and test_hf_moe_export.py do)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_fixture import FIXTURE, LINEARS, flax_tree_from_hf, model_config

import nvfp4_jax.hf as hf


@pytest.fixture(scope="module")
def fixture_tensors(request) -> dict:
    """The fixture checkpoint's tensors, by name."""
    return hf.read_safetensors(request.module.FIXTURE / "model.safetensors")


@pytest.fixture(scope="module")
def source(request) -> dict:
    """The bf16 weights ModelOpt quantized (HF names, (out, in))."""
    return hf.read_safetensors(request.module.REFERENCE / "source_weights_bf16.safetensors")


@pytest.fixture(scope="module")
def input_amax(fixture_tensors) -> dict:
    """Recorded activation amaxes by HF module name (ModelOpt's, times 2688)."""
    return {m: float(fixture_tensors[f"{m}.input_scale"]) * 2688.0 for m in LINEARS}


@pytest.fixture(scope="module")
def imported():
    return hf.load_hf_checkpoint(FIXTURE)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, source, input_amax) -> dict[str, Path]:
    """The source model exported W4A4 and W4A16 (one file), and W4A4 sharded."""
    root = tmp_path_factory.mktemp("exports")
    tree = flax_tree_from_hf(source)
    out = {}
    for flavour, kwargs in {
        "NVFP4": {"input_amax": input_amax},
        "W4A16_NVFP4": {},
        "sharded": {"input_amax": input_amax, "max_shard_size": 100_000},
    }.items():
        algo = "NVFP4" if flavour == "sharded" else flavour
        report = hf.export_hf_checkpoint(
            root / flavour, tree, quant_algo=algo, config=model_config(), **kwargs
        )
        out[flavour] = root / flavour
        out[flavour + "/report"] = report
    return out


@pytest.fixture(params=["NVFP4", "W4A16_NVFP4"])
def flavour(request) -> str:
    return request.param
