"""MaxText trains in NVFP4 through `python -m nvfp4_jax.maxtext` (marker `maxtext`; needs the
environment `bash scripts/maxtext_env.sh` makes, since MaxText needs Python >= 3.12).

    bash scripts/maxtext_env.sh              # once: .maxtext-venv (about 7 minutes)
    bash scripts/test.sh -m maxtext -n 0     # the maxtext tests: about 1.5 minutes on 2 cores

MaxText lives in its own environment, so one child process
(`tests/integration/maxtext_child.py`, run with that environment's Python;
NVFP4_MAXTEXT_PYTHON points elsewhere) does the MaxText side and reports in JSON; the tests
here check:

* MaxText's `DenseGeneral` in a decoder layer, under the hook's provider, equals the drop-in
  `nvfp4_jax.dot_general` on the same weights bit for bit (output, input and weight
  gradients); its MoE router (`gate`) equals the plain bf16 layer; the experts' GEMM as
  MaxText's `RoutedMoE` issues it equals `nvfp4_jax.ragged_dot` bit for bit;
* a tiny MaxText decoder, dense (llama2) and Mixtral-style MoE (4 experts, megablox off),
  trains three steps on the CPU through the launcher: nvfp4_jax's custom calls (the NVFP4
  GEMM, the quantize, the experts' grouped quantize) are in the compiled train step and
  absent from plain MaxText's; the first step's loss equals the bf16 run's within the NVFP4
  error; the loss falls; the provider's report puts every decoder projection and the
  experts in NVFP4 and the router and output head outside;
* `python -m nvfp4_jax.maxtext` refuses an MoE with megablox on (MaxText's default), naming
  the flags to change.

The first tests, not marked `maxtext`, need no MaxText and run with the rest of the suite: the
module imports without it and says how to get it; the launcher, on a stand-in for MaxText's
trainer, checks every flag and file before MaxText is imported (status 2 naming the flag) and
writes its report however the run ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import nvfp4_jax
import nvfp4_jax.maxtext as nvfp4_maxtext

ROOT = pathlib.Path(__file__).resolve().parents[2]

MAXTEXT_PYTHON = pathlib.Path(
    os.environ.get("NVFP4_MAXTEXT_PYTHON", ROOT / ".maxtext-venv/bin/python")
)
# The first step's loss (the forward pass of the initial weights: stochastic rounding only
# touches the backward) in NVFP4 against bf16: each projection's output carries NVFP4's
# rounding error (about 15% of its norm for these random weights, measured by the child), but
# the loss is an average over 64 tokens of a near-uniform prediction, which moves it by
# about 0.2% (measured: 0.15% dense). Bound: 1% of the loss.
FIRST_LOSS_RTOL = 0.01
# The NVFP4 custom calls each compiled train step holds (the CPU kernels).
GEMM, QUANTIZE, GROUPED = "nvfp4_gemm", "nvfp4_quantize", "nvfp4_grouped_quantize"


def maxtext_available() -> str:
    if not MAXTEXT_PYTHON.exists():
        return f"no MaxText environment at {MAXTEXT_PYTHON}: run bash scripts/maxtext_env.sh"
    return ""


# --- without MaxText ----------------------------------------------------------------------------


def test_the_hook_without_maxtext_names_the_set_up_script():
    probe = "import maxtext"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        pytest.skip("MaxText is importable here")
    with pytest.raises(ImportError, match="scripts/maxtext_env.sh"):
        with nvfp4_maxtext.install():
            pass


@pytest.mark.parametrize(
    "fields, flags",
    [
        ({}, ["megablox=True"]),
        ({"use_tokamax_gmm": True, "megablox": False}, ["use_tokamax_gmm=True"]),
        ({"megablox": True, "use_tokamax_gmm": True}, ["megablox=True", "use_tokamax_gmm=True"]),
    ],
)
def test_check_config_refuses_kernels_that_bypass_ragged_dot(fields, flags):
    config = SimpleNamespace(num_experts=8, sparse_matmul=True, **fields)
    with pytest.raises(ValueError, match="stay in bf16") as error:
        nvfp4_maxtext.check_config(config)
    message = str(error.value)
    assert all(flag in message for flag in flags), message
    assert "megablox=False use_tokamax_gmm=False" in message


def test_check_config_passes_ragged_dot_dense_einsum_and_dense_models():
    for config in (
        SimpleNamespace(num_experts=8, sparse_matmul=True, megablox=False, use_tokamax_gmm=False),
        SimpleNamespace(num_experts=8, sparse_matmul=False, megablox=True, use_tokamax_gmm=True),
        SimpleNamespace(num_experts=1, megablox=True),
    ):
        assert nvfp4_maxtext.check_config(config) is None
    with pytest.raises(ValueError, match="use_batch_split_schedule=False"):
        nvfp4_maxtext.check_config(SimpleNamespace(use_batch_split_schedule=True))


def test_rules_mirror_maxtexts_qwix_rules():
    rules = nvfp4_maxtext.rules_from_config(SimpleNamespace(quantize_mtp=True))
    assert [(r.module_path, r.recipe is None) for r in rules] == [
        (r".*/gate$", True),
        ("(decoder/.*layers.*|mtp_block/.*)", False),
    ]
    assert set(rules[-1].op_names) == {"dot_general", "einsum", "ragged_dot"}
    rules = nvfp4_maxtext.rules_from_config(
        SimpleNamespace(), rules=[nvfp4_maxtext_rule("layers/.*/wo", None)]
    )
    assert rules[0].recipe is None and rules[0].module_path.endswith("(?:layers/.*/wo)(?s:.*)")


def nvfp4_maxtext_rule(pattern, recipe):
    from nvfp4_jax.rules import Rule  # noqa: PLC0415

    return Rule(pattern, recipe)


# --- the launcher, on a stand-in for MaxText's trainer ------------------------------------------
#
# The launcher's checks and its report need no MaxText: `fake_maxtext` puts a stand-in package
# `maxtext` on the path whose `train.main` records its call, asks the hook for the provider as
# MaxText does, traces a decoder layer's two MLP projections through qwix with it, then
# returns or raises (`fail=1` among its arguments).

FAKE_TRAIN = """
import json, os
from types import SimpleNamespace

CALLS = []


def main(argv):
    import jax.numpy as jnp, qwix
    from flax import nnx
    from maxtext.layers import quantizations

    CALLS.append(list(argv))
    if os.environ.get("FAKE_MAXTEXT_CALLS"):
        with open(os.environ["FAKE_MAXTEXT_CALLS"], "a") as calls:
            calls.write(json.dumps(argv) + "\\n")
    args = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    config = SimpleNamespace(quantization=args["quantization"], quantize_mtp=False)
    provider = quantizations.get_qt_provider(config)

    class Mlp(nnx.Module):
        def __init__(self):
            self.wi_0 = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
            self.wo = nnx.Linear(32, 32, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.wo(self.wi_0(x))

    class Node(nnx.Module):
        def __init__(self, name, child):
            self.name = name
            setattr(self, name, child)

        def __call__(self, x):
            return getattr(self, self.name)(x)

    model = Node("decoder", Node("layers", Node("mlp", Mlp())))
    qwix.quantize_model(model, provider, jnp.ones((4, 32), jnp.bfloat16))
    if "clobber" in args:  # a file appears at the report's path while MaxText runs
        with open(args["clobber"], "w") as other:
            other.write("not the launcher's")
    from absl import logging  # MaxText reports its steps with absl's logging

    logging.info("completed step: 0, loss: 5.5")
    if args.get("fail") == "1":
        raise RuntimeError("the stand-in trainer failed at step 1")
"""
FAKE_QUANTIZATIONS = "def get_qt_provider(config):\n    return None\n"


@pytest.fixture
def fake_maxtext(tmp_path, monkeypatch):
    """A stand-in `maxtext` package on sys.path; yields its folder (PYTHONPATH for a child)."""
    root = tmp_path / "fake_maxtext"
    files = {
        "maxtext/__init__.py": "",
        "maxtext/layers/__init__.py": "",
        "maxtext/layers/quantizations.py": FAKE_QUANTIZATIONS,
        "maxtext/trainers/__init__.py": "",
        "maxtext/trainers/pre_train/__init__.py": "",
        "maxtext/trainers/pre_train/train.py": FAKE_TRAIN,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(root))
    # The launcher sets up absl's logging as MaxText's trainer does: undone for later tests.
    level, handlers = logging.root.level, list(logging.root.handlers)
    yield root
    logging.root.setLevel(level)
    logging.root.handlers[:] = handlers
    for name in [m for m in sys.modules if m == "maxtext" or m.startswith("maxtext.")]:
        del sys.modules[name]


def fake_calls() -> list:
    """The stand-in trainer's calls so far (none if it was never imported)."""
    module = sys.modules.get("maxtext.trainers.pre_train.train")
    return [] if module is None else module.CALLS


def launch(*args: str) -> None:
    nvfp4_maxtext.main(["nvfp4_jax.maxtext", "base.yml", "steps=1", *args])


def rules_file(tmp_path, *rules) -> str:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(list(rules)))
    return str(path)


def exits_2_before_maxtext(capsys, *args: str) -> str:
    """Launches with `args`; asserts status 2 and that MaxText was not imported. Its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        launch(*args)
    assert exit_info.value.code == 2
    assert "maxtext" not in sys.modules and not fake_calls()
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nvfp4-recipe", "{"], "--nvfp4-recipe {: Expecting"),
        (["--nvfp4-recipe", "[]"], "expected a JSON object of NVFP4Recipe fields"),
        (["--nvfp4-recipe", '{"fprop": 2}'], "--nvfp4-recipe .*fprop"),
        (["--nvfp4-recipe", '{"colour": 1}'], "--nvfp4-recipe .*colour"),
        (["--nvfp4-recipe", '{"backward": "sr"}'], "--nvfp4-recipe .*backward"),
        (["--nvfp4-recipe", "{}", "--nvfp4-recipe", "{}"], "--nvfp4-recipe was given twice"),
        (["--nvfp4-rules", "/no/such/rules.json"], "--nvfp4-rules /no/such/rules.json: "),
        (["--nvfp4-reprot", "r.json"], "unrecognized launcher flag --nvfp4-reprot"),
        (["--nvfp4-report"], "--nvfp4-report: expected one argument"),
        (["quantization=int8"], "quantization=int8 was given"),
        (["use_qwix_quantization=false"], "leave use_qwix_quantization out"),
    ],
)
def test_bad_launcher_flags_exit_2_before_maxtext_starts(flags, message, fake_maxtext, capsys):
    err = exits_2_before_maxtext(capsys, *flags)
    assert re.search(message, err), err


def test_the_recipe_json_takes_the_backward_field():
    from nvfp4_jax._src.integrations.maxtext import load_recipe  # noqa: PLC0415

    recipe = load_recipe(argparse.ArgumentParser(), '{"backward": "ms_eden", "fprop": false}')
    assert recipe == nvfp4_jax.NVFP4Recipe(backward="ms_eden", fprop=False)


@pytest.mark.parametrize(
    "rules, message",
    [
        ('{"pattern": "x"}', "expected a JSON list of rules"),
        ('[{"pattern": "x"}]', r"rule \[0\] is .*expected"),
        ('[{"pattern": "x", "recipe": null}, "mlp"]', r"rule \[1\] is 'mlp'"),
        ('[{"pattern": "(", "recipe": null}]', "not a valid regular expression"),
        ('[{"pattern": "x", "recipe": {"fprop": 2}}]', "fprop"),
        ("[{", "Expecting"),
    ],
)
def test_a_bad_rules_file_exits_2_before_maxtext_starts(
    rules, message, tmp_path, fake_maxtext, capsys
):
    path = tmp_path / "rules.json"
    path.write_text(rules)
    err = exits_2_before_maxtext(capsys, "--nvfp4-rules", str(path))
    assert f"--nvfp4-rules {path}" in err and re.search(message, err), err


def refused_by_the_provider(pattern: str) -> str:
    """The provider's error for a rule of `pattern` ("" if it takes it)."""
    from nvfp4_jax.qwix import NVFP4Provider  # noqa: PLC0415
    from nvfp4_jax.rules import Rule  # noqa: PLC0415

    try:
        NVFP4Provider([Rule(pattern, None)])
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize(
    "pattern", ["(?i)MLP/WO$", "(?x) mlp/wo$  # the down projection", "mlp/wo$", "(?s:mlp)/wo$"]
)
def test_rules_are_compiled_as_the_provider_compiles_them(pattern, tmp_path, fake_maxtext, capsys):
    """A rule the provider refuses fails before MaxText starts; one it takes trains."""
    rules = rules_file(tmp_path, {"pattern": pattern, "recipe": None})
    report = tmp_path / "report.json"
    if refused := refused_by_the_provider(pattern):
        err = exits_2_before_maxtext(capsys, "--nvfp4-rules", rules)
        assert f"--nvfp4-rules {rules}: rule [0] (pattern {pattern!r})" in err, (err, refused)
        return
    launch("--nvfp4-rules", rules, "--nvfp4-report", str(report))
    actions = json.loads(report.read_text())["providers"][0]
    assert actions["decoder/layers/mlp/wo:dot_general0"]["action"] == "high_precision"
    assert actions["decoder/layers/mlp/wi_0:dot_general0"]["action"] == "nvfp4"


def test_a_rule_only_the_provider_refuses_fails_before_maxtext_starts(
    tmp_path, fake_maxtext, capsys, monkeypatch
):
    """The launcher converts the rules with the provider's own conversion, not a copy of it."""
    from nvfp4_jax._src.integrations import qwix as integration  # noqa: PLC0415

    monkeypatch.setattr(integration, "search_pattern", lambda pattern: f"({pattern}")
    rules = rules_file(tmp_path, {"pattern": "mlp/wo$", "recipe": None})
    err = exits_2_before_maxtext(capsys, "--nvfp4-rules", rules)
    assert f"--nvfp4-rules {rules}: rule [0] (pattern 'mlp/wo$')" in err, err


def test_a_report_path_that_cannot_be_written_exits_2_before_maxtext_starts(
    tmp_path, fake_maxtext, capsys
):
    existing = tmp_path / "report.json"
    existing.write_text("an earlier run's")
    err = exits_2_before_maxtext(capsys, "--nvfp4-report", str(existing))
    assert f"--nvfp4-report {existing}: exists; a report is never overwritten" in err, err
    assert existing.read_text() == "an earlier run's"
    err = exits_2_before_maxtext(capsys, "--nvfp4-report", str(tmp_path))
    assert f"--nvfp4-report {tmp_path}: is a folder" in err, err
    under_a_file = existing / "runs" / "report.json"
    err = exits_2_before_maxtext(capsys, "--nvfp4-report", str(under_a_file))
    assert f"--nvfp4-report {under_a_file}: cannot write in" in err, err
    if pathlib.Path("/proc/self").is_dir():  # a folder no one writes in, root included
        err = exits_2_before_maxtext(capsys, "--nvfp4-report", "/proc/nvfp4_report.json")
        assert "--nvfp4-report /proc/nvfp4_report.json: cannot write in /proc" in err, err


def test_the_report_folder_is_made_and_the_report_written(tmp_path, fake_maxtext):
    report = tmp_path / "runs" / "exp1" / "report.json"
    launch("--nvfp4-report", str(report))
    assert fake_calls() == [
        [
            "nvfp4_jax.maxtext",
            "base.yml",
            "steps=1",
            "quantization=fp4",
            "use_qwix_quantization=True",
        ]
    ]
    written = json.loads(report.read_text())
    assert written["status"] == "completed" and written["error"] is None, written
    (actions,) = written["providers"]
    assert {key: d["action"] for key, d in actions.items()} == {
        "decoder/layers/mlp/wi_0:dot_general0": "nvfp4",
        "decoder/layers/mlp/wo:dot_general0": "nvfp4",
    }
    assert os.listdir(report.parent) == ["report.json"]  # no temporary file left


def test_the_report_is_written_when_training_fails(tmp_path, fake_maxtext):
    report = tmp_path / "report.json"
    with pytest.raises(RuntimeError, match="failed at step 1"):
        launch("fail=1", "--nvfp4-report", str(report))
    written = json.loads(report.read_text())
    assert written["status"] == "failed", written
    assert written["error"] == "RuntimeError: the stand-in trainer failed at step 1", written
    (actions,) = written["providers"]  # what the provider did before the failure
    assert actions["decoder/layers/mlp/wi_0:dot_general0"]["action"] == "nvfp4", actions


def test_a_report_that_appeared_during_the_run_is_not_overwritten(tmp_path, fake_maxtext):
    report = tmp_path / "report.json"
    with pytest.raises(FileExistsError, match="appeared there while MaxText ran") as error:
        launch(f"clobber={report}", "--nvfp4-report", str(report))
    assert report.read_text() == "not the launcher's"
    kept = pathlib.Path(str(error.value).rsplit(" ", 1)[-1])  # this run's report, kept aside
    assert kept.parent == tmp_path and json.loads(kept.read_text())["status"] == "completed"


def test_a_failed_run_exits_1_with_its_report(tmp_path, fake_maxtext):
    """`python -m nvfp4_jax.maxtext`: MaxText's step log, the failure's traceback, status 1
    and the report."""
    report = tmp_path / "exp" / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.maxtext", "base.yml", "fail=1"]
        + ["--nvfp4-report", str(report)],
        env={**os.environ, "PYTHONPATH": str(fake_maxtext), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "completed step: 0, loss: 5.5" in run.stderr, run.stderr[-3000:]
    assert "RuntimeError: the stand-in trainer failed at step 1" in run.stderr
    assert json.loads(report.read_text())["status"] == "failed"


# --- MaxText, in its own environment ------------------------------------------------------------


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    """maxtext_child.py's JSON: the layer checks, two trainings each way, the refusal."""
    if reason := maxtext_available():
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("maxtext")
    dump = work / "xla"
    dump.mkdir()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*train_step.*",
    }
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [
            str(MAXTEXT_PYTHON),
            str(ROOT / "tests" / "integration" / "maxtext_child.py"),
            str(work / "out.json"),
            str(dump),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=work,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    return json.loads((work / "out.json").read_text())


def part(child: dict, *keys):
    value = child
    for key in keys:
        assert isinstance(value, dict) and "error" not in value, value.get("error", value)
        value = value[key]
    return value


@pytest.mark.maxtext
def test_maxtexts_projection_is_the_drop_in_bit_for_bit(child):
    dense = part(child, "layers", "dense")
    assert [d["action"] for d in dense["report"].values()] == ["nvfp4"], dense["report"]
    assert dense["y"] and dense["dx"] and dense["dw"], dense
    # ... and it is NVFP4, not bf16: the output moves by NVFP4's rounding error.
    assert dense["differs_from_bf16"] and 0.02 < dense["rel_err_vs_bf16"] < 0.3, dense


@pytest.mark.maxtext
def test_maxtexts_router_stays_bf16(child):
    router = part(child, "layers", "router")
    assert [d["action"] for d in router["report"].values()] == ["high_precision"]
    assert router["y"], router


@pytest.mark.maxtext
def test_maxtexts_expert_gemm_is_ragged_dot_bit_for_bit(child):
    experts = part(child, "layers", "experts")
    assert [d["action"] for d in experts["report"].values()] == ["nvfp4"], experts["report"]
    assert experts["y"] and experts["dx"] and experts["dw"], experts


@pytest.mark.maxtext
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_tiny_maxtext_decoder_trains_in_nvfp4(child, model):
    run = "dense" if model == "dense" else "moe_run"
    nvfp4, bf16 = part(child, run, "nvfp4"), part(child, run, "bf16")
    # The NVFP4 GEMMs are in the compiled train step: nvfp4_jax's CPU kernels' custom calls.
    calls = nvfp4["custom_calls"]
    assert calls.get(GEMM, 0) > 0 and calls.get(QUANTIZE, 0) > 0, calls
    if model == "moe":
        assert calls.get(GROUPED, 0) > 0, calls  # the experts' ragged_dot
    assert not bf16["custom_calls"], bf16["custom_calls"]
    # The first step's loss: bf16's within the NVFP4 error, and not bf16's bits.
    first, reference = nvfp4["losses"][0], bf16["losses"][0]
    assert math.isfinite(first) and first != reference
    assert abs(first - reference) <= FIRST_LOSS_RTOL * reference, (first, reference)
    assert len(nvfp4["losses"]) == 3 and nvfp4["losses"][-1] < nvfp4["losses"][0], nvfp4
    # What the provider did: every decoder projection (and the experts) in NVFP4.
    # (MaxText builds the model more than once, abstract and concrete: one provider each.)
    report = nvfp4["report"][0]
    assert all(other == report for other in nvfp4["report"]), nvfp4["report"]
    actions = {path.split(":")[0]: d["action"] for path, d in report.items()}
    projections = [
        f"decoder/layers/self_attention/{name}" for name in ("query", "key", "value", "out")
    ]
    if model == "dense":
        projections += [f"decoder/layers/mlp/{name}" for name in ("wi_0", "wi_1")]
        # `--nvfp4-rules` put `mlp/wo$` in high precision, before MaxText's rules.
        assert actions["decoder/layers/mlp/wo"] == "high_precision", actions
    for path in projections:
        assert actions.get(path) == "nvfp4", (path, actions)
    assert not [p for p in actions if "logits" in p or "embed" in p], actions  # not matched
    if model == "moe":
        ragged = [p for p, d in report.items() if ":ragged_dot" in p]
        assert len(ragged) == 3 and all(report[p]["action"] == "nvfp4" for p in ragged), report
        gates = [p for p in actions if p.endswith("/gate")]
        assert gates and all(actions[p] == "high_precision" for p in gates), actions


@pytest.mark.maxtext
def test_the_launcher_refuses_megablox(child, tmp_path):
    """`python -m nvfp4_jax.maxtext` on an MoE with MaxText's default megablox=True."""
    moe = [a for a in part(child, "moe") if not a.startswith("megablox=")]
    run = subprocess.run(
        [
            str(MAXTEXT_PYTHON),
            "-m",
            "nvfp4_jax.maxtext",
            part(child, "config"),
            "run_name=refused",
            f"base_output_directory={tmp_path}",
            *part(child, "tiny"),
            *moe,
        ],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode != 0
    assert "ValueError: nvfp4_jax.maxtext: the MoE experts would stay in bf16" in run.stderr, (
        run.stderr[-3000:]
    )
    assert "megablox=True" in run.stderr and "megablox=False use_tokamax_gmm=False" in run.stderr
