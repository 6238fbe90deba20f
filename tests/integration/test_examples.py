"""The example that runs NVIDIA's ModelOpt checkpoint in JAX reproduces its reference logits."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import run_modelopt_checkpoint


def test_modelopt_fixture_runs_in_jax_with_its_reference_logits(capsys):
    # Weight-only: the fixture's reference is an f32 transformers Llama with ModelOpt's own
    # dequantized weights; ours decode bit for bit, so only f32 summation order differs.
    result = run_modelopt_checkpoint.main([])
    assert result["max_abs_diff"] < 1e-5 and result["top1_agreement"] == 1.0, result
    assert "top-1 agreement 100.0%" in capsys.readouterr().out


def test_w4a4_moves_the_logits_by_the_activation_quantization_error():
    result = run_modelopt_checkpoint.main(["--activations", "nvfp4"])
    assert 1e-3 < result["max_abs_diff"] < 0.5 and result["top1_agreement"] > 0.6, result


def test_not_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        run_modelopt_checkpoint.main([str(tmp_path)])
    assert info.value.code == 2 and "no config.json" in capsys.readouterr().err
