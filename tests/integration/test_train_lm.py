"""The example training loop: a tiny configuration learns, resumes exactly, rejects bad flags."""

import dataclasses
import json
import math
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import skip_where_xla_sums_follow_the_program

import nvfp4_jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import train_lm

# --bf16-last 0: every layer of the one-block model in NVFP4 (the default keeps the last
# block and the head in bf16, which is all of it); --high-precision-final 0: NVFP4 to the
# end (the default finishes in bf16).
TINY = [
    *("--width", "32", "--depth", "1", "--heads", "2", "--batch", "8", "--seq-len", "32"),
    *("--bf16-last", "0", "--high-precision-final", "0"),
    "--no-diagnostics",  # the tests of the diagnostics turn them on
]


def _run(tmp_path, *flags):
    return train_lm.main([*TINY, "--out", str(tmp_path), *flags])


def _exits_with_usage_error(capsys, call, *args) -> str:
    """Runs `call(*args)`, expects argparse's exit status 2, returns the message printed."""
    with pytest.raises(SystemExit) as exit_info:
        call(*args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


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


def test_resume_continues_exactly(tmp_path, capsys):
    # At the defaults, Four Over Six on every operand: its runs resume exactly too. With
    # --suggest-share the diagnostics choose rules, which the resumed part takes from its
    # checkpoint (it does not run the diagnostics again).
    assert train_lm.nvfp4_recipe(train_lm.parse_args(TINY)).uses_four_over_six
    flags = ["--recipe", "nvfp4", "--steps", "6", "--eval-every", "3", "--save-every", "2"]
    flags += ["--diagnostics", "--suggest-share", "0.25"]
    straight = _run(tmp_path / "straight", *flags)
    _run(tmp_path / "resumed", *flags, "--stop-after", "3")
    diagnostics = tmp_path / "resumed" / "diagnostics.json"
    written = diagnostics.stat().st_mtime_ns
    capsys.readouterr()
    resumed = _run(tmp_path / "resumed", *flags, "--resume")
    out = capsys.readouterr().out
    assert "the NVFP4 run resumes with its checkpoint's rules" in out
    assert "diagnostics (weight-gradient angle" not in out
    assert diagnostics.stat().st_mtime_ns == written
    kept = [pattern for pattern, recipe in straight["config"]["rules"] if recipe is None]
    assert len(kept) == 2  # a quarter of the 8 GEMMs, which TINY's own rules keep in NVFP4
    assert resumed["config"]["rules"] == straight["config"]["rules"]
    straight, resumed = straight["histories"]["nvfp4"], resumed["histories"]["nvfp4"]
    assert resumed["step"] == straight["step"] == list(range(1, 7))
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    # The recipe's name survives rich's markup parsing (it used to swallow "[nvfp4]").
    assert "[nvfp4] resumed from step 3" in out


def test_steps_1_runs_to_the_end(tmp_path):
    # Used to crash building the schedule (a cosine decay of 0 steps).
    results = _run(tmp_path, "--recipe", "bf16", "--steps", "1")
    history = results["histories"]["bf16"]
    assert history["step"] == history["val_step"] == [1]
    assert math.isfinite(history["val_loss"][0])
    assert (tmp_path / "results.json").is_file()


def test_resuming_a_finished_run_prints_its_summary(tmp_path, capsys):
    flags = ["--recipe", "bf16", "--steps", "1"]  # the flags of test_steps_1: no new compile
    finished = _run(tmp_path, *flags)
    capsys.readouterr()
    resumed = _run(tmp_path, *flags, "--resume")  # returns: exit status 0
    out = capsys.readouterr().out
    assert "[bf16] the run already finished at step 1" in out
    assert "nothing left to train" in out
    assert "after 1 steps" in out  # the summary table
    assert resumed["histories"] == finished["histories"]
    assert resumed["results"] == finished["results"]
    # Running the same command again without --resume starts over; it used to fail with
    # orbax's StepAlreadyExistsError.
    again = _run(tmp_path, *flags)
    assert "deleted the checkpoints of an earlier run" in capsys.readouterr().out
    assert again["histories"]["bf16"]["train_loss"] == finished["histories"]["bf16"]["train_loss"]


def test_a_diverging_run_stops_with_a_message(tmp_path, capsys):
    results = _run(tmp_path, "--recipe", "bf16", "--steps", "6", "--lr", "1e6")
    history = results["histories"]["bf16"]
    assert history["diverged_at"] == history["step"][-1] < 6
    assert "training diverged" in capsys.readouterr().out
    # results.json stays strict JSON: NaN losses are written as null.
    text = (tmp_path / "results.json").read_text()
    assert "NaN" not in text
    assert json.loads(text)["results"]["bf16"]["diverged_at"] == history["diverged_at"]


@pytest.mark.parametrize(
    "steps, warmup", [(1, 0), (1, 1), (2, 1), (5, 5), (5, 9), (10, 0), (10, 3), (600, 30)]
)
def test_lr_schedule_is_sound_for_any_length(steps, warmup):
    peak = 3e-3
    rates = np.array([float(train_lm.lr_schedule(peak, steps, warmup)(c)) for c in range(steps)])
    assert np.all(np.isfinite(rates)) and np.all(rates > 0) and np.all(rates <= peak * (1 + 1e-6))
    ramp = min(warmup, steps)
    # The warm-up rises linearly (its first update already moves), the decay falls to peak / 10.
    np.testing.assert_allclose(rates[:ramp], peak * np.arange(1, ramp + 1) / warmup, rtol=1e-6)
    assert np.all(np.diff(rates[ramp:]) <= 0)
    if steps > warmup:
        np.testing.assert_allclose(rates[-1], peak / 10, rtol=1e-6)


@pytest.fixture
def files(tmp_path):
    """Paths the bad-flag cases refer to as {name}."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.bin").write_bytes(b"PK\x03\x04\x00\x00text")
    (tmp_path / "short.txt").write_text("tiny text")
    (tmp_path / "a_file").write_text("not a folder")
    names = ("empty.txt", "binary.bin", "short.txt", "a_file")
    return {name.split(".")[0]: str(tmp_path / name) for name in names} | {"folder": str(tmp_path)}


BAD_FLAGS = {
    "lr-nan": (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    "lr-inf": (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    "lr-minus-inf": (["--lr=-inf"], "argument --lr: must be a finite number > 0, got -inf"),
    "lr-0": (["--lr", "0"], "argument --lr: must be a finite number > 0, got 0"),
    "lr-negative": (["--lr", "-1"], "argument --lr: must be a finite number > 0, got -1"),
    "lr-text": (["--lr", "fast"], "argument --lr: must be a finite number > 0, got 'fast'"),
    "steps-0": (["--steps", "0"], "argument --steps: must be an integer from 1 to"),
    "steps-fraction": (["--steps", "1.5"], "argument --steps: must be an integer"),
    "steps-too-many": (["--steps", str(2**31)], "argument --steps: must be an integer from 1"),
    "batch-0": (["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    "seq-len-0": (["--seq-len", "0"], "argument --seq-len: must be a positive integer, got 0"),
    "seq-len-too-long": (["--seq-len", "100000"], "--seq-len 100000 is too long for"),
    "width-40": (["--width", "40"], "argument --width: must be a positive multiple of 16"),
    "width-0": (["--width", "0"], "argument --width: must be a positive multiple of 16"),
    "depth-0": (["--depth", "0"], "argument --depth: must be a positive integer, got 0"),
    "heads-0": (["--heads", "0"], "argument --heads: must be a positive integer, got 0"),
    "heads-not-dividing": (["--heads", "3"], "--heads 3 must divide --width 128"),
    "seed-negative": (["--seed", "-1"], "argument --seed: must be an integer from 0 to"),
    "seed-too-big": (["--seed", str(2**32)], "argument --seed: must be an integer from 0 to"),
    "bf16-first-negative": (["--bf16-first", "-1"], "argument --bf16-first: must be an integer"),
    "bf16-blocks-too-many": (
        ["--depth", "2", "--bf16-first", "2", "--bf16-last", "2"],
        "--bf16-first 2 plus --bf16-last 2 is more than the 3 blocks",
    ),
    "disable-unknown": (["--disable", "rht"], "argument --disable: invalid choice: 'rht'"),
    "keep-bf16-regex": (["--keep-bf16", "layers/("], "argument --keep-bf16: not a regular"),
    "rules-missing": (["--rules", "{folder}/no.json"], "argument --rules: cannot read"),
    "rules-not-json": (["--rules", "{short}"], "argument --rules: {short} is not JSON"),
    "suggest-share-2": (["--suggest-share", "2"], "argument --suggest-share: must be a number"),
    "suggest-share-without-diagnostics": (
        ["--suggest-share", "0.1", "--no-diagnostics"],
        "--suggest-share needs the diagnostics: drop --no-diagnostics",
    ),
    "recipe": (["--recipe", "fp8"], "argument --recipe: invalid choice: 'fp8'"),
    "eval-every-0": (["--eval-every", "0"], "argument --eval-every: must be a positive integer"),
    "eval-every-past-steps": (
        ["--steps", "10", "--eval-every", "20"],
        "--eval-every 20 is more than --steps 10",
    ),
    "save-every-negative": (["--save-every", "-1"], "argument --save-every: must be an integer"),
    "save-every-past-steps": (
        ["--steps", "10", "--save-every", "11"],
        "--save-every 11 is more than --steps 10",
    ),
    "warmup-negative": (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    "warmup-past-steps": (["--steps", "10", "--warmup", "11"], "--warmup 11 is more than --steps"),
    "stop-after-0": (["--stop-after", "0"], "argument --stop-after: must be a positive integer"),
    "stop-after-past-steps": (
        ["--steps", "10", "--stop-after", "11"],
        "--stop-after 11 is more than --steps 10",
    ),
    "data-missing": (
        ["--data", "/nonexistent/text.txt"],
        "argument --data: /nonexistent/text.txt is not a file",
    ),
    "data-folder": (["--data", "{folder}"], "is not a file (it is a folder)"),
    "data-empty": (["--data", "{empty}"], "empty.txt is empty"),
    "data-binary": (["--data", "{binary}"], "binary.bin looks like a binary file"),
    "data-too-short": (["--data", "{short}"], "short.txt is too short to train on: 9 bytes"),
    "data-shorter-than-seq-len": (
        ["--data", "{short}", "--seq-len", "1"],
        "short.txt is too short to train on",
    ),
    "out-is-a-file": (["--out", "{a_file}"], "argument --out: {a_file} exists and is not a folder"),
    "out-under-a-file": (["--out", "{a_file}/run"], "{a_file} is not a folder"),
    "unknown-flag": (["--lr", "1e-3", "--learning-rate", "1"], "unrecognized arguments"),
}


@pytest.mark.parametrize("flags, message", list(BAD_FLAGS.values()), ids=list(BAD_FLAGS))
def test_bad_flags_exit_with_a_message(flags, message, files, capsys):
    flags = [flag.format_map(files) for flag in flags]
    assert message.format_map(files) in _exits_with_usage_error(capsys, train_lm.parse_args, flags)


def test_flags_the_model_rejects_exit_with_a_message(monkeypatch, capsys):
    # Whatever shape rule lm_model has (e.g. grouped-query heads, rotary head sizes), a model
    # the flags cannot build is a usage error, not a traceback.
    def picky_config(**kwargs):
        raise ValueError("heads=2 is not allowed")

    monkeypatch.setattr(train_lm, "LMConfig", picky_config)
    err = _exits_with_usage_error(capsys, train_lm.parse_args, TINY)
    assert "--width 32 --heads 2 --depth 1 --seq-len 32 make no working model" in err
    assert "heads=2 is not allowed" in err


def test_defaults_fit_short_runs():
    # --eval-every, --save-every and --warmup default to at most --steps.
    args = train_lm.parse_args(["--steps", "10"])
    assert (args.eval_every, args.save_every, args.warmup) == (10, 10, 1)
    args = train_lm.parse_args([])
    assert (args.eval_every, args.save_every, args.warmup) == (100, 100, 30)


def test_the_default_recipe_is_the_accuracy_studys_best():
    """First block, last block and head in bf16, the last 20% of the steps with a bf16
    forward, Four Over Six on W and x, Quartet II's MS-EDEN backward (the recipe study's
    lower mean); with NVIDIA's backward, Four Over Six on W, x and dy. A model too shallow
    for a bf16 first block keeps its blocks in NVFP4."""
    args = train_lm.parse_args([])
    assert (args.bf16_first, args.bf16_last, args.high_precision_final) == (1, 2, 0.2)
    assert args.high_precision_final_gemms == "fprop"
    assert args.backward == "ms_eden" and args.four_over_six == ["activation", "weight"]
    recipe = train_lm.nvfp4_recipe(args)
    assert recipe.backward == "ms_eden" and recipe.random_backward
    assert recipe.weight_four_over_six == recipe.activation_four_over_six == "mse"
    assert recipe.gradient_four_over_six is None
    assert recipe.four_over_six_e4m3_max == 256
    nvidia = train_lm.parse_args(["--backward", "nvidia"])
    assert nvidia.four_over_six == ["activation", "gradient", "weight"]
    assert train_lm.nvfp4_recipe(nvidia).gradient_four_over_six == "mse"
    # NVIDIA's switches are errors with MS-EDEN's backward.
    for switch in ("stochastic_rounding", "wgrad_rht"):
        assert train_lm.parse_args(["--backward", "nvidia", "--disable", switch]).disable
        with pytest.raises(SystemExit):
            train_lm.parse_args(["--disable", switch])
    # The grouped GEMMs take 4/6 on their weights only.
    assert train_lm.parse_args(["--experts", "4"]).four_over_six == ["weight"]
    assert train_lm.switch_step(args) == 480
    patterns = [rule.pattern for rule in train_lm.model_rules(args) if rule.recipe is None]
    assert patterns == ["^layers/(0|3)/", "^lm_head$"]
    assert train_lm.parse_args(["--depth", "3"]).bf16_first == 1  # blocks 0, 2 bf16; 1 NVFP4
    assert train_lm.parse_args(["--depth", "2"]).bf16_first == 0
    assert train_lm.parse_args(["--depth", "2", "--bf16-last", "0"]).bf16_first == 1


def test_text_too_short_for_the_sequence(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("a text of fifty bytes, which is not enough for 32.")
    err = _exits_with_usage_error(capsys, _run, tmp_path, "--data", str(short))
    assert "--seq-len 32 is too long for" in err and "at most 3" in err
    with pytest.raises(ValueError, match="too short for --seq-len 32"):
        train_lm.split_text(train_lm.load_text(short), 32)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """An output folder holding a bf16 run stopped at step 2 of 4 (one tiny training run)."""
    out = tmp_path_factory.mktemp("stopped")
    train_lm.main(
        [*TINY, "--out", str(out), "--recipe", "bf16", "--steps", "4", "--stop-after", "2"]
    )
    return out


RESUME_FLAGS = ["--recipe", "bf16", "--steps", "4", "--resume"]
BAD_RESUMES = {
    # Changing --steps used to resume "finished" runs without a final validation loss, and
    # crash in the summary with an IndexError.
    "changed-steps": (["--steps", "2"], "was made with --steps 4 (now 2)"),
    "changed-width": (["--width", "64"], "was made with --width 32 (now 64)"),
    "changed-lr-and-seed": (["--lr", "1e-2", "--seed", "1"], "--lr 0.003 (now 0.01); --seed 0"),
    "changed-disable": (["--disable", "weight_2d"], "--disable nothing (now weight_2d)"),
    "changed-text": (["--data", "{text}"], "another text (--data)"),
    "stop-after-before-checkpoint": (["--stop-after", "1"], "--stop-after 1 is before step 2"),
}


@pytest.mark.parametrize("flags, message", list(BAD_RESUMES.values()), ids=list(BAD_RESUMES))
def test_bad_resumes_exit_with_a_message(stopped_run, tmp_path, flags, message, capsys):
    text = tmp_path / "text.txt"
    text.write_text("A different text to train on. " * 100)
    flags = [flag.format(text=text) for flag in flags]
    err = _exits_with_usage_error(capsys, _run, stopped_run, *RESUME_FLAGS, *flags)
    assert message in err


def test_resume_without_a_checkpoint(stopped_run, tmp_path, capsys):
    err = _exits_with_usage_error(capsys, _run, tmp_path / "new", *RESUME_FLAGS)
    assert "--resume: " in err and "holds no checkpoint of the bf16 run" in err
    assert not (tmp_path / "new").exists()
    # With --recipe both, the bf16 checkpoint is enough: nvfp4 is the one without.
    err = _exits_with_usage_error(
        capsys, _run, stopped_run, "--recipe", "both", "--steps", "4", "--resume", "--width", "64"
    )
    assert "the bf16 checkpoint (step 2) was made with --width 32" in err


def test_rules_from_flags_pick_the_layers():
    args = train_lm.parse_args(
        [*TINY, "--keep-bf16", "q_proj", "--bf16-last", "1", "--disable", "wgrad_rht"]
        + ["--backward", "nvidia"]
    )
    model = train_lm.make_model(args, "nvfp4")
    kinds = {
        path: type(module).__module__.startswith("nvfp4_jax")
        for path, module in nnx.iter_graph(model)
        if isinstance(module, nnx.Linear)
    }
    assert not kinds[("layers", 0, "self_attn", "q_proj")]  # --keep-bf16 q_proj
    assert not kinds[("lm_head",)]  # --bf16-last 1: the head counts as the last block
    assert kinds[("layers", 0, "mlp", "down_proj")]
    nvfp4 = [m for _, m in nnx.iter_graph(model) if isinstance(m, nvfp4_jax.nnx.Linear)]
    assert nvfp4 and all(not m.recipe.wgrad_rht for m in nvfp4)


def test_rules_file_and_diagnostics_are_written(tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"pattern": "mlp", "recipe": {"stochastic_rounding": False}}]))
    out = tmp_path / "run"
    flags = ["--recipe", "nvfp4", "--steps", "2", "--rules", str(rules), "--backward", "nvidia"]
    flags += ["--suggest-share", "0.1"]
    results = train_lm.main([*TINY, "--diagnostics", *flags, "--out", str(out)])
    report = json.loads((out / "diagnostics.json").read_text())
    assert report["layers"] and (out / "diagnostics.png").stat().st_size > 0
    patterns = [pattern for pattern, _ in results["config"]["rules"]]
    assert patterns[0].startswith("^layers/") and "mlp" in patterns and patterns[-1] == ".*"
    # --no-diagnostics: the flags' rules, no diagnostics files.
    out = tmp_path / "without"
    results = train_lm.main([*TINY, *flags[:-2], "--out", str(out)])
    assert not (out / "diagnostics.json").exists() and not (out / "diagnostics.png").exists()
    patterns = [pattern for pattern, _ in results["config"]["rules"]]
    flag_rules = train_lm.model_rules(train_lm.parse_args([*TINY, *flags[:-2]]))
    assert patterns == [rule.pattern for rule in flag_rules] and "mlp" in patterns


def test_high_precision_final_resumes_exactly_across_the_switch(tmp_path, capsys):
    # 6 steps, F = 0.5: steps 1-3 in NVFP4, steps 4-6 with the forward in high precision.
    flags = ["--recipe", "nvfp4", "--steps", "6", "--eval-every", "3", "--save-every", "1"]
    flags += ["--high-precision-final", "0.5"]
    straight = _run(tmp_path / "straight", *flags)["histories"]["nvfp4"]
    assert straight["high_precision_from"] == 4
    assert "[nvfp4] step 4: fprop GEMMs in high precision" in capsys.readouterr().out
    plain = _run(tmp_path / "plain", *flags[:-2], "--stop-after", "4")["histories"]["nvfp4"]
    # The switch changes the training from step 4 on, not before.
    assert plain["train_loss"][:3] == straight["train_loss"][:3]
    assert plain["train_loss"][3] != straight["train_loss"][3]
    # One run in five parts, resumed from the checkpoints of steps 2 (before the switch), 3
    # (the switch step itself: its checkpoint holds the NVFP4 phase's SR streams, which the
    # switch replaces), 4 (the first switched step) and 5; every part goes on as the straight
    # run did. Resuming from step 3 used to keep the NVFP4 phase's SR streams (SR rounds the
    # gradients alone and a step's loss is taken before its update: a wrong SR stream after
    # step s shows from step s + 2 on).
    folder = tmp_path / "resumed"
    _run(folder, *flags, "--stop-after", "2")
    programs = train_lm.CompiledRun.programs()
    for stop in (3, 4, 5, 6):
        resumed = _run(folder, *flags, "--resume", "--stop-after", str(stop))["histories"]
        resumed = resumed["nvfp4"]
        assert resumed["step"] == straight["step"][:stop] == list(range(1, stop + 1))
        assert resumed["train_loss"] == straight["train_loss"][:stop], f"up to step {stop}"
        assert resumed["val_loss"] == straight["val_loss"][: stop // 3], f"up to step {stop}"
        assert resumed.get("high_precision_from") == (4 if stop >= 4 else None)
    # The resumed parts (restored arrays, and at the switch the finish's new SR streams among
    # them) run the train step the straight run compiled.
    assert train_lm.CompiledRun.programs() == programs


def test_ms_eden_backward_resumes_exactly_across_the_switch(tmp_path):
    # --backward ms_eden: the MS-EDEN rotations and scale roundings come from the layers'
    # streams, which the checkpoints hold; a run in parts (before, at and after the switch
    # to a high-precision forward) takes the straight run's steps. The flag is part of
    # what a resumed run must share with its checkpoint.
    flags = ["--recipe", "nvfp4", "--steps", "6", "--eval-every", "3", "--save-every", "1"]
    flags += ["--high-precision-final", "0.5", "--backward", "ms_eden"]
    straight = _run(tmp_path / "straight", *flags)["histories"]["nvfp4"]
    sr = _run(tmp_path / "sr", *flags[:-2], "--backward", "nvidia", "--stop-after", "2")
    sr = sr["histories"]["nvfp4"]
    assert sr["train_loss"][1] != straight["train_loss"][1]  # the backward changed step 1
    folder = tmp_path / "resumed"
    _run(folder, *flags, "--stop-after", "2")
    for stop in (3, 6):
        resumed = _run(folder, *flags, "--resume", "--stop-after", str(stop))["histories"]
        assert resumed["nvfp4"]["train_loss"] == straight["train_loss"][:stop], stop
    with pytest.raises(SystemExit):
        _run(folder, *flags[:-2], "--backward", "nvidia", "--resume", "--steps", "6")


def _state_bytes(model) -> list[bytes]:
    """Every leaf of the model's state (parameters and SR streams) as bytes."""
    leaves = jax.tree.leaves(nnx.state(model))
    return [
        np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ).tobytes()
        for x in leaves
    ]


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--experts", "2"], id="moe"),
        # Its high-precision GEMMs sum in XLA's order, in two programs: see below.
        pytest.param(
            ["--high-precision-final-gemms", "all"], id="all_gemms", marks=pytest.mark.newest
        ),
    ],
)
def test_the_switch_at_run_time_is_the_recompiled_switch(flags):
    # What `run` does (`CompiledRun`: one compiled step, the finish a runtime flag for the
    # forward; with "all" GEMMs a switched graph and a second compile) against the switch as
    # it was: `switch_precision` and `train_step` compiled anew. Steps 1-2 NVFP4, 3-4 finish.
    # The MoE model's attention GEMMs are dense NVFP4 GEMMs (`dot_general`), its experts'
    # `ragged_dot`s: both kinds switch at run time.
    args = train_lm.parse_args(
        [*TINY, "--batch", "2", "--steps", "4", "--high-precision-final", "0.5", *flags]
    )
    train, val = train_lm.split_text(train_lm.load_text(None), args.seq_len)
    batches = [train_lm.batch_at(train, s, args.batch, args.seq_len, 0) for s in range(1, 5)]
    val_batches = jax.numpy.stack([train_lm.batch_at(val, 10**9, args.batch, args.seq_len, 0)])
    rules = train_lm.model_rules(args)
    at_run_time = train_lm.finish_at_run_time("nvfp4", args)
    assert at_run_time == ("all" not in flags)
    if not at_run_time:  # the high-precision GEMMs of two programs, to the same bits
        skip_where_xla_sums_follow_the_program("the recompiled switch's high-precision GEMMs")

    model = train_lm.make_model(args, "nvfp4", rules)
    optimizer = train_lm.make_optimizer(model, args)
    want = []
    for step, batch in enumerate(batches, 1):
        if step == 3:
            train_lm.switch_precision(model, args, rules)
        loss, _ = train_lm.train_step(model, optimizer, batch)
        want.append((float(loss), float(train_lm.eval_loss(model, val_batches))))
    want_state = _state_bytes(model)

    model = train_lm.make_model(args, "nvfp4", rules)
    steps = train_lm.CompiledRun(
        model, train_lm.make_optimizer(model, args), finish=False if at_run_time else None
    )
    change = train_lm.switch_streams if at_run_time else train_lm.switch_precision
    got, programs = [], []
    for step, batch in enumerate(batches, 1):
        if step == 3:
            steps.switch(lambda m: change(m, args, rules))
        loss, _ = steps.step(batch)
        got.append((float(loss), float(steps.eval_loss(val_batches))))
        programs.append(steps.programs())
    steps.sync()
    assert got == want
    assert _state_bytes(model) == want_state
    # The runtime switch compiles nothing; the switched graph compiles its step once.
    assert programs[3] - programs[1] == (0 if at_run_time else 1)


def test_high_precision_final_switches_the_rules():
    args = train_lm.parse_args(
        [*TINY, "--steps", "10", "--high-precision-final", "0.2", "--keep-bf16", "head"]
    )
    assert args.high_precision_final_gemms == "fprop"
    assert train_lm.high_precision_steps(args) == 2 and train_lm.switch_step(args) == 8
    # Steps 9 and 10 of the NVFP4 run switched; a checkpoint of step 8 is still NVFP4's.
    phases = [train_lm.in_high_precision("nvfp4", args, step) for step in range(11)]
    assert phases == [False] * 9 + [True] * 2
    assert not train_lm.in_high_precision("bf16", args, 10)
    rules = train_lm.model_rules(args)
    fprop = train_lm.switched_rules(rules, "fprop")
    every = train_lm.switched_rules(rules, "all")
    assert [r.pattern for r in fprop] == [r.pattern for r in rules]
    assert fprop[0].recipe is None and every[0].recipe is None  # bf16 layers stay bf16
    recipe = train_lm.nvfp4_recipe(args)  # (Four Over Six on every operand: the default)
    assert recipe.uses_four_over_six
    assert fprop[-1].recipe == dataclasses.replace(recipe, fprop=False)
    assert every[-1].recipe == dataclasses.replace(recipe, fprop=False, dgrad=False, wgrad=False)
    # --disable takes the GEMM switches too (that GEMM in high precision for the whole run).
    disabled = train_lm.parse_args([*TINY, "--disable", "wgrad", "--disable", "dgrad"])
    assert train_lm.nvfp4_recipe(disabled) == dataclasses.replace(recipe, dgrad=False, wgrad=False)
    no_switch = train_lm.parse_args([*TINY, "--steps", "10"])
    assert train_lm.switch_step(no_switch) is None
    # A fraction too small for one step never switches.
    assert (
        train_lm.switch_step(train_lm.parse_args([*TINY, "--high-precision-final", "0.0001"]))
        is None
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--high-precision-final", "1"],
            "argument --high-precision-final: must be a number from 0",
        ),
        (["--high-precision-final", "-0.1"], "argument --high-precision-final: must be a number"),
        (["--high-precision-final", "nan"], "argument --high-precision-final: must be a number"),
        (["--high-precision-final", "x"], "argument --high-precision-final: must be a number"),
        (
            ["--high-precision-final-gemms", "dgrad"],
            "argument --high-precision-final-gemms: invalid",
        ),
        (["--high-precision-final-gemms", "all"], "--high-precision-final-gemms needs --high-prec"),
    ],
)
def test_bad_high_precision_final_flags(flags, message, capsys):
    err = _exits_with_usage_error(capsys, train_lm.parse_args, [*TINY, *flags])
    assert message in err, err


def test_resume_refuses_another_high_precision_final(stopped_run, tmp_path, capsys):
    err = _exits_with_usage_error(
        capsys, _run, stopped_run, *RESUME_FLAGS, "--high-precision-final", "0.5"
    )
    assert "--high-precision-final 0.0 (now 0.5)" in err, err


def test_four_over_six_flags_build_the_recipe():
    fields = ("weight_four_over_six", "activation_four_over_six", "gradient_four_over_six")
    nvidia = ["--backward", "nvidia"]  # (MS-EDEN's backward quantizes dy itself)
    every = train_lm.nvfp4_recipe(train_lm.parse_args([*TINY, *nvidia, "--four-over-six", "all"]))
    assert all(getattr(every, f) == "mse" for f in fields)
    assert every.four_over_six_e4m3_max == 256
    some = train_lm.parse_args(
        [*TINY, *nvidia, "--four-over-six", "weight", "--four-over-six", "gradient",
         "--four-over-six", "weight", "--four-over-six-error", "mae",
         "--four-over-six-e4m3-max", "448"]
    )  # fmt: skip
    assert some.four_over_six == ["gradient", "weight"]
    recipe = train_lm.nvfp4_recipe(some)
    assert (recipe.weight_four_over_six, recipe.activation_four_over_six) == ("mae", None)
    assert recipe.gradient_four_over_six == "mae" and recipe.four_over_six_e4m3_max == 448
    none = train_lm.nvfp4_recipe(train_lm.parse_args([*TINY, "--four-over-six", "none"]))
    assert not none.uses_four_over_six
    # Every NVFP4 rule takes the 4/6 fields (--rules too); the high-precision finish keeps them.
    rules = train_lm.model_rules(some)
    assert rules[-1].recipe == recipe
    switched = train_lm.switched_rules(rules, "fprop")[-1].recipe
    assert switched.weight_four_over_six == "mae" and not switched.fprop


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--four-over-six", "all", "--four-over-six", "weight"], "cannot be combined"),
        (["--four-over-six", "none", "--four-over-six", "weight"], "cannot be combined"),
        (["--four-over-six", "bias"], "argument --four-over-six: invalid choice"),
        (["--four-over-six-e4m3-max", "300"], "argument --four-over-six-e4m3-max: invalid"),
        (["--four-over-six-error", "l1"], "argument --four-over-six-error: invalid"),
        (
            ["--experts", "2", "--four-over-six", "activation"],
            "--four-over-six activation/gradient is not implemented for --experts",
        ),
    ],
)
def test_bad_four_over_six_flags(flags, message, capsys):
    err = _exits_with_usage_error(capsys, train_lm.parse_args, [*TINY, *flags])
    assert message in err, err


def test_four_over_six_reaches_the_models_layers():
    # A run with Four Over Six (the default, --four-over-six all) resumes exactly:
    # test_resume_continues_exactly; its GEMMs round otherwise than plain NVFP4:
    # training/test_recipe_four_over_six.py. Here: the flags reach the NVFP4 run's layers.
    # With MS-EDEN's backward (the default) "all" is W and x; with NVIDIA's, dy too.
    cases = [("all", "mse", None, []), ("none", None, None, [])]
    cases.append(("all", "mse", "mse", ["--backward", "nvidia"]))
    for flag, want, gradient, backward in cases:
        args = train_lm.parse_args([*TINY, "--four-over-six", flag, *backward])
        model = train_lm.make_model(args, "nvfp4")
        recipes = [
            nvfp4_jax.rules.layer_recipe(node)
            for _, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Linear)
        ]
        in_nvfp4 = [r for r in recipes if r is not None]
        assert in_nvfp4, flag
        for recipe in in_nvfp4:
            assert recipe.weight_four_over_six == want, flag
            assert recipe.activation_four_over_six == want, flag
            assert recipe.gradient_four_over_six == gradient, flag


def test_a_rules_file_sets_four_over_six_per_layer(tmp_path, capsys):
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps(
            [
                {"pattern": "mlp", "recipe": {"gradient_four_over_six": "mae"}},
                {"pattern": "attn", "recipe": {"weight_four_over_six": None, "wgrad_rht": False}},
            ]
        )
    )
    flags = [*TINY, "--rules", str(rules), "--four-over-six", "weight"]
    # gradient_four_over_six and wgrad_rht are NVIDIA's backward's.
    err = _exits_with_usage_error(capsys, train_lm.parse_args, flags)
    assert 'the rule of mlp sets gradient_four_over_six: "mae", which only --backward' in err
    args = train_lm.parse_args([*flags, "--backward", "nvidia"])
    mlp, attn, rest = train_lm.model_rules(args)
    assert mlp.recipe.gradient_four_over_six == "mae" and mlp.recipe.weight_four_over_six == "mse"
    assert attn.recipe.weight_four_over_six is None and not attn.recipe.wgrad_rht
    assert rest.recipe.weight_four_over_six == "mse"
    for bad in ({"weight_four_over_six": "max"}, {"fprop": "yes"}, {"four_over_six": "mse"}):
        rules.write_text(json.dumps([{"pattern": "mlp", "recipe": bad}]))
        err = _exits_with_usage_error(capsys, train_lm.parse_args, [*TINY, "--rules", str(rules)])
        assert "recipe must be null or a dict of" in err, err


def test_sr_seed_changes_only_the_rounding_streams(tmp_path):
    # --sr-seed varies the NVFP4 run's stochastic rounding alone: the same weights and
    # batches, other SR draws (so another loss); without it the streams follow --seed.
    default = train_lm.parse_args(TINY)
    assert default.sr_seed is None
    assert train_lm._sr_seed(default) == 1 and train_lm._sr_seed(default, switch=True) == 0
    runs = {}
    for name, flags in {"a": ["--sr-seed", "5"], "b": ["--sr-seed", "6"]}.items():
        args = train_lm.parse_args([*TINY, *flags])
        assert args.sr_seed == int(flags[1])
        model = train_lm.make_model(args, "nvfp4")
        weights = nnx.state(model, nnx.Param)
        runs[name] = weights
        _run(tmp_path / name, "--steps", "3", "--recipe", "nvfp4", *flags)
    for a, b in zip(*(jax.tree.leaves(r) for r in runs.values()), strict=True):
        np.testing.assert_array_equal(a, b)  # the same initial weights
    losses = [
        json.loads((tmp_path / n / "results.json").read_text())["histories"]["nvfp4"]["train_loss"]
        for n in runs
    ]
    assert losses[0][0] == losses[1][0]  # step 1's forward has no SR
    assert losses[0] != losses[1]  # the rounding of the gradients differs
