"""The Hugging Face / ModelOpt NVFP4 bridge both ways (nvfp4_jax/_src/io/hf/load/ then
export/): ModelOpt's checkpoint imported and exported again gives the same bytes and the same
config, and the example Llama exports, loads back and exports again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from hf_fixture import (
    FIXTURE,
    LINEARS,
    REFERENCE,
    assert_same_config_meaning,
    model_config,
    raw_tensors,
)

import nvfp4_jax
from nvfp4_jax import hf

# --- round trip -------------------------------------------------------------------------------


def test_round_trip_keeps_every_tensor_and_config(tmp_path, imported):
    """Import ModelOpt's checkpoint, export it (W4A4, its own input scales): the same bytes."""
    report = hf.export_hf_checkpoint(tmp_path / "rt", imported, config=model_config())
    assert sorted(report.quantized) == sorted(LINEARS)
    assert raw_tensors(tmp_path / "rt") == raw_tensors(FIXTURE)
    assert_same_config_meaning(tmp_path / "rt", FIXTURE)


def test_round_trip_as_weight_only(tmp_path, imported):
    hf.export_hf_checkpoint(
        tmp_path / "rt", imported, quant_algo="W4A16_NVFP4", config=model_config()
    )
    expected = {k: v for k, v in raw_tensors(FIXTURE).items() if not k.endswith(".input_scale")}
    assert raw_tensors(tmp_path / "rt") == expected
    assert_same_config_meaning(tmp_path / "rt", REFERENCE / "w4a16_variant")


# --- the example model ------------------------------------------------------------------------


def test_example_llama_exports_and_loads_back(tmp_path):
    """examples/lm_model.py: calibrate, export nnx.state(model), load, rebuild, export again."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import lm_model  # noqa: PLC0415  (examples/ is on the path only now)

    recipe = nvfp4_jax.NVFP4Recipe(stochastic_rounding=False)
    cfg = lm_model.LMConfig(vocab=64, width=64, depth=1, heads=4, recipe=recipe)
    model = lm_model.TransformerLM(cfg, nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab)
    assert nvfp4_jax.nnx.calibrate(model) == 8  # 7 linears and the head
    nnx.jit(lambda m, x: m(x))(model, tokens)
    nvfp4_jax.nnx.calibrate(model, False)
    kwargs = {"config": cfg.hf_config(), "exclude": ("model.embed_tokens",)}  # lm_head in NVFP4
    first = hf.export_hf_checkpoint(tmp_path / "a", nnx.state(model), **kwargs)
    assert len(first.quantized) == 8 and first.excluded == ("model.embed_tokens",)
    # Without SR the layers hold no rng key: no leaf of the state is left out of the export.
    assert first.skipped == (), first.skipped
    served = lm_model.from_params(cfg, hf.load_hf_checkpoint(tmp_path / "a"), activations="nvfp4")
    assert np.isfinite(np.asarray(nnx.jit(lambda m, x: m(x))(served, tokens))).all()
    hf.export_hf_checkpoint(tmp_path / "b", nnx.state(served), **kwargs)
    a, b = raw_tensors(tmp_path / "a"), raw_tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("input_scale"):  # the layer keeps input_scale * 2688: within an ulp
            x, y = (np.frombuffer(t[name][2], np.float32)[0] for t in (a, b))
            assert abs(x - y) <= np.spacing(x), name
        else:
            assert a[name] == b[name], name
