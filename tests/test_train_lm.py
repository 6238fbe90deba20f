"""The example training loop: a tiny configuration learns, resumes exactly, rejects bad flags."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_lm

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--batch", "8", "--seq-len", "32"]


def _run(tmp_path, *flags):
    return train_lm.main([*TINY, "--out", str(tmp_path), *flags])


def test_tiny_model_learns_with_both_recipes(tmp_path):
    results = _run(tmp_path, "--steps", "40", "--eval-every", "10", "--lr", "1e-2")
    for name in ("nvfp4", "bf16"):
        val = results["histories"][name]["val_loss"]
        assert len(val) == 4
        # Uniform bytes give ln(256) = 5.55 nats; the model must learn the byte statistics.
        assert val[-1] < val[0] - 0.2, (name, val)
        assert val[-1] < 3.3, (name, val)
    written = json.loads((tmp_path / "results.json").read_text())
    assert set(written["results"]) == {"nvfp4", "bf16"}
    assert written["results"]["bf16"]["relative_val_gap"] == 0.0
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_resume_continues_exactly(tmp_path):
    flags = ["--recipe", "nvfp4", "--steps", "6", "--eval-every", "3", "--save-every", "2"]
    straight = _run(tmp_path / "straight", *flags)["histories"]["nvfp4"]
    _run(tmp_path / "resumed", *flags, "--stop-after", "3")
    resumed = _run(tmp_path / "resumed", *flags, "--resume")["histories"]["nvfp4"]
    assert resumed["step"] == straight["step"] == list(range(1, 7))
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--width", "40"], "--width must be a multiple of 16"),
        (["--steps", "0"], "--steps must be positive"),
        (["--recipe", "fp8"], "invalid choice: 'fp8'"),
        (["--data", "/nonexistent/text.txt"], "is not a file"),
        (["--lr", "-1"], "--lr > 0"),
    ],
    ids=["width", "steps", "recipe", "data", "lr"],
)
def test_bad_flags_exit_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_text_too_short_for_the_sequence(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny text")
    with pytest.raises(ValueError, match="too short for --seq-len 32"):
        _run(tmp_path, "--data", str(short))
