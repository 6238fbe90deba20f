"""From MaxText to vLLM and back: `python -m nvfp4_jax.maxtext.export` and `.load` (marker
`maxtext`; the vLLM check also `vllm`).

    bash scripts/maxtext_env.sh        # once: .maxtext-venv
    bash scripts/vllm_env.sh           # once: .vllm-venv (for the vLLM check)
    .venv/bin/python -m pytest -m maxtext -n 0 tests/integration/test_maxtext_export.py

MaxText lives in its own environment: `maxtext_export_child.py` (run with its Python,
`NVFP4_MAXTEXT_PYTHON` points elsewhere) trains tiny decoders through the launcher with
checkpointing on, exports and imports them, and reports in JSON what it compared (its
docstring lists it); the tests here assert on that:

* every NVFP4 weight of the export (a llama2 decoder with `scan_layers`, a Mixtral-style
  decoder without, weight-only and W4A4) is the quantization of MaxText's trained kernel with
  the recipe's weight spec and its fused group's amax, bit for bit, and those the export
  reports as the training forward's bits are: the forward's own quantization (own amax);
* the export's NVFP4 linears are the ones the training run's provider report put in NVFP4
  (`--nvfp4-rules` kept one in bf16: exported in bf16);
* the logits of the example's model holding the export match MaxText's own forward holding
  the export's weights (imported back) to bf16 noise;
* W4A4 has every NVFP4 linear's input scale, shared within fused groups;
* the ModelOpt Llama fixture imported into MaxText: MaxText reads back exactly the released
  values, its logits match transformers' reference, the export with `base=` is the fixture's
  bytes, and a two-step fine-tune through the launcher exports;
* a checkpoint of another architecture, a missing step, a config MaxText rejects and W4A4
  without amaxes are refused with their reason, nothing written;
* vLLM's CPU build serves the dense W4A4 export: its weights are the export's, its
  log-probabilities the JAX W4A4 model's.

The command lines' own checks (flags before MaxText, status 2; a failure, status 1, nothing
written) run without MaxText, with the rest of the suite.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax
from nvfp4_jax._src.integrations import maxtext_export, maxtext_load

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hf_decoder  # noqa: E402

MAXTEXT_PYTHON = pathlib.Path(
    os.environ.get("NVFP4_MAXTEXT_PYTHON", ROOT / ".maxtext-venv/bin/python")
)
VLLM_PYTHON = pathlib.Path(os.environ.get("NVFP4_VLLM_PYTHON", ROOT / ".vllm-venv/bin/python"))
# MaxText computes in bf16 with its own op order; the example in f32. Their logits differ by
# rounding only: bounded by a multiple of the example's own bf16-vs-f32 difference (measured
# in the child) plus a floor, and the top-1 tokens agree.
LOGITS_TOLERANCE = (3.0, 0.02)
# vLLM against the JAX W4A4 model (tests/integration/test_vllm.py's bound, for the same
# reasons: bf16 residuals, 1/input_scale, another summation order).
LOGPROB_TOLERANCE = (3.0, 0.02)


# --- the command lines, without MaxText ----------------------------------------------------------


def run_main(main, *args: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["prog", *args])
    return exit_info.value.code


def test_export_flags_are_checked_before_maxtext(tmp_path, capsys):
    assert (
        run_main(
            maxtext_export.main, "base.yml", "--out", str(tmp_path / "o"), "--nvfp4-recipe", "{"
        )
        == 2
    )
    assert "--nvfp4-recipe {" in capsys.readouterr().err
    assert run_main(maxtext_export.main, "base.yml") == 2
    assert "--out" in capsys.readouterr().err
    assert run_main(maxtext_export.main, "base.yml", "--out", "o", "--quant-algo", "FP8") == 2
    assert run_main(maxtext_export.main, "base.yml", "--out", "o", "--outt", "x") == 2
    assert "unrecognized flag --outt" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_text("not ours")
    assert run_main(maxtext_export.main, "base.yml", "--out", str(tmp_path / "full")) == 1
    assert "is not empty; nothing is written over files" in capsys.readouterr().err
    assert (tmp_path / "full" / "model.safetensors").read_text() == "not ours"


def test_the_commands_without_maxtext_name_the_environment(tmp_path, capsys):
    if (
        subprocess.run([sys.executable, "-c", "import maxtext"], capture_output=True).returncode
        == 0
    ):
        pytest.skip("MaxText is importable here")
    assert run_main(maxtext_export.main, "base.yml", "--out", str(tmp_path / "o")) == 1
    assert "scripts/maxtext_env.sh" in capsys.readouterr().err
    assert run_main(maxtext_load.main, str(tmp_path), "base.yml", "--out", str(tmp_path / "m")) == 1
    assert "scripts/maxtext_env.sh" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- MaxText, in its own environment --------------------------------------------------------------


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    if not MAXTEXT_PYTHON.exists():
        pytest.skip(f"no MaxText environment at {MAXTEXT_PYTHON}: run bash scripts/maxtext_env.sh")
    work = tmp_path_factory.mktemp("maxtext_export")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [
            str(MAXTEXT_PYTHON),
            str(ROOT / "tests" / "integration" / "maxtext_export_child.py"),
            str(work / "out.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
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


MODELS = ["dense", "moe"]
ALGOS = ["w4a16", "w4a4"]
# NVFP4 linears: dense, 2 layers x 7; Mixtral-style, 2 layers x (4 attention + 4 experts x 3)
# less layer 1's o_proj, which --nvfp4-rules kept in bf16.
NVFP4_COUNT = {"dense": 14, "moe": 31}


@pytest.mark.maxtext
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("model", MODELS)
def test_every_nvfp4_weight_is_the_recipes_quantization_of_the_trained_kernel(child, model, algo):
    bits = part(child, model, algo, "bits")
    assert bits["compared"] == NVFP4_COUNT[model], bits["nvfp4_modules"]
    assert bits["mismatches"] == [], bits["mismatches"]


@pytest.mark.maxtext
@pytest.mark.parametrize("model", MODELS)
def test_the_reported_exact_weights_are_the_training_forwards(child, model):
    bits = part(child, model, "w4a16", "bits")
    assert bits["exact"] and all(same for _, same in bits["exact"]), bits["exact"]
    assert sorted(bits["reported_exact"]) == sorted(m for m, _ in bits["exact"])
    assert bits["reported_requantized"] == sorted(bits["requantized"])
    # Fused groups whose members' amaxes differ: the smaller ones are requantized (T3).
    assert bits["requantized"], bits


@pytest.mark.maxtext
@pytest.mark.parametrize("model", MODELS)
def test_the_exported_precisions_are_the_training_runs(child, model):
    report = part(child, model, "report")
    result = part(child, model, "w4a16", "result")
    nvfp4, bf16 = set(result["nvfp4"]), set(result["high_precision"])
    for module, action in report.items():
        names = qwix_path_to_hf(module, model)
        for name in names:
            if action == "nvfp4":
                assert name in nvfp4 or any(n.startswith(name) for n in nvfp4), (module, name)
            else:
                assert name in bf16 or not name, (module, name, action)
    assert "lm_head" in bf16
    if model == "moe":
        assert report["decoder/layers_1/self_attention/out"] == "high_precision"
        assert "model.layers.1.self_attn.o_proj" in bf16


def qwix_path_to_hf(module: str, model: str) -> list[str]:
    """The HF modules of a qwix module path of the training report."""
    parts = module.split("/")
    layers = [int(parts[1].split("_")[1])] if parts[1].startswith("layers_") else [0, 1]
    name = parts[-1]
    hf = {
        "query": "self_attn.q_proj",
        "key": "self_attn.k_proj",
        "value": "self_attn.v_proj",
        "out": "self_attn.o_proj",
        "wi_0": "mlp.gate_proj",
        "wi_1": "mlp.up_proj",
        "wo": "mlp.down_proj",
        "MoeBlock_0": "block_sparse_moe.experts.",
        "gate": "",  # the router: no linear of its own in the report's sense
    }.get(name)
    if hf is None or not hf:
        return []
    return [f"model.layers.{i}.{hf}" for i in layers]


@pytest.mark.maxtext
@pytest.mark.parametrize("model", MODELS)
def test_the_exports_logits_are_maxtexts_forward(child, model):
    logits = part(child, model, "w4a16", "logits")
    factor, floor = LOGITS_TOLERANCE
    assert logits["maxtext_vs_example"] <= factor * logits["example_bf16_vs_f32"] + floor, logits
    assert logits["top1_agreement"] >= 0.9, logits


@pytest.mark.maxtext
@pytest.mark.parametrize("model", MODELS)
def test_w4a4_has_every_input_scale_shared_in_fused_groups(child, model):
    w4a4 = part(child, model, "w4a4")
    scales = w4a4["input_scales"]
    modules = w4a4["bits"]["nvfp4_modules"]
    assert sorted(k.removesuffix(".input_scale") for k in scales) == modules
    assert all(np.isfinite(v) and v > 0 for v in scales.values())
    for i in range(2):
        qkv = {
            scales[f"model.layers.{i}.self_attn.{p}.input_scale"]
            for p in ("q_proj", "k_proj", "v_proj")
        }
        assert len(qkv) == 1, qkv
    assert part(child, model, "w4a4", "result", "calibration_batches") == 2


@pytest.mark.maxtext
def test_the_export_holds_a_config_and_maxtexts_tokenizer(child):
    assert part(child, "dense", "w4a16", "files") == [
        "config.json",
        "hf_quant_config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert part(child, "dense", "w4a16", "result", "tokenizer").endswith("tokenizer.llama2")
    assert part(child, "dense", "steps") == [0, 2]
    # The Mixtral-style model has 256 tokens, MaxText's tokenizer 32000: none is shipped.
    assert "tokenizer.model" not in part(child, "moe", "w4a16", "files")
    assert part(child, "moe", "w4a16", "result", "tokenizer") == ""


@pytest.mark.maxtext
def test_maxtext_starts_from_exactly_the_released_values(child):
    fixture = part(child, "fixture")
    assert fixture["maxtext_reads_the_released_values"] and fixture["query_is_released_over_sqrt_e"]
    # MaxText (bf16) against transformers (f32) on ModelOpt's dequantized weights.
    assert fixture["logits_vs_transformers"] <= 0.02 * fixture["logit_scale"], fixture
    assert fixture["top1_agreement"] >= 0.9, fixture


@pytest.mark.maxtext
def test_import_then_export_returns_the_fixtures_bytes(child):
    fixture = part(child, "fixture")
    assert fixture["round_trip_same_bytes"] and fixture["round_trip_same_config"]
    assert fixture["round_trip_from_base"] > 0


@pytest.mark.maxtext
def test_a_released_model_fine_tunes_and_exports(child):
    tuned = part(child, "fixture", "fine_tune")
    assert len(tuned["losses"]) == 2 and all(np.isfinite(tuned["losses"]))
    assert tuned["nvfp4"] == 14 and tuned["requantized"] + tuned["training_exact"] == 14
    assert (
        "tokenizer_config.json" not in tuned["files"] or "generation_config.json" in tuned["files"]
    )
    assert "generation_config.json" in tuned["files"]  # the release's extras, carried over


@pytest.mark.maxtext
@pytest.mark.parametrize(
    "case, message",
    [
        ("architecture", "does not hold the model the MaxText config makes (decoder_block=mixtral"),
        ("missing_step", "no MaxText checkpoint there; the run's steps in"),
        ("rejected_config", "MaxText rejects the config"),
        ("w4a4_without_amaxes", "--calibration-batches N), or export weight-only"),
        ("import_other_architecture", "the checkpoint is ['LlamaForCausalLM']"),
        ("import_into_files", "is not empty; nothing is written over files"),
    ],
)
def test_bad_input_is_refused_and_nothing_written(child, case, message):
    refusals = part(child, "refusals")
    assert message in refusals[case], refusals[case]
    assert refusals["left_behind"] == []


@pytest.mark.maxtext
def test_the_export_command_exits_1_on_a_missing_step(child, tmp_path):
    args = [a for a in part(child, "dense", "args") if not a.startswith("load_parameters_path")]
    run = subprocess.run(
        [str(MAXTEXT_PYTHON), "-m", "nvfp4_jax.maxtext.export", *args]
        + [f"load_parameters_path={tmp_path}/checkpoints/9/items", "--out", str(tmp_path / "out")],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "holds no checkpoint step" in run.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.maxtext
@pytest.mark.parametrize("family", ["llama31", "mistral", "qwen3", "qwen3_moe"])
def test_every_family_computes_maxtexts_logits(child, family):
    """llama3.1's RoPE order, Mistral, Qwen3's q/k norms and Qwen3-MoE's routing: the plain HF
    decoder on the export computes MaxText's forward (both in f32) to f32 rounding."""
    found = part(child, "families", family)
    assert found["max_abs_diff"] <= 1e-4 * max(1.0, found["logit_scale"]), found
    assert found["top1_agreement"] == 1.0, found


@pytest.mark.maxtext
def test_a_trained_qwen3_exports_bit_for_bit_and_as_maxtext_computes(child):
    qwen3 = part(child, "qwen3")
    assert qwen3["bits"]["compared"] == 14 and qwen3["bits"]["mismatches"] == []
    assert all(same for _, same in qwen3["bits"]["exact"]), qwen3["bits"]["exact"]
    assert sorted(qwen3["bits"]["reported_exact"]) == sorted(m for m, _ in qwen3["bits"]["exact"])
    assert qwen3["max_abs_diff"] <= 1e-4 * max(1.0, qwen3["logit_scale"]), qwen3


# --- vLLM serves the export ---------------------------------------------------------------------


@pytest.mark.maxtext
@pytest.mark.vllm
@pytest.mark.parametrize("model", ["dense", "qwen3"])
def test_vllm_serves_the_maxtext_export(child, model, tmp_path, record_property):
    """vLLM's CPU build on the W4A4 export of a MaxText llama2 and Qwen3 decoder: its weights are
    the export's, bit for bit; its log-probabilities the plain decoder's run W4A4 as engines run
    it (tests/integration/hf_decoder.py: static input scales)."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run bash scripts/vllm_env.sh")
    export = pathlib.Path(
        part(child, model, "w4a4", "dir") if model == "dense" else part(child, model, "dir")
    )
    prompts = [((np.arange(40) * 7 + 3 * i) % 256).tolist() for i in range(2)]
    out = tmp_path / "vllm.json"
    run = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(ROOT / "tests" / "integration" / "vllm_client.py"),
            str(export),
            str(out),
        ]
        + ["--prompts", json.dumps(prompts), "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    doc = json.loads(out.read_text())
    weights = dict(np.load(str(out.with_suffix("")) + ".weights.npz"))
    logprobs = dict(np.load(str(out.with_suffix("")) + ".logprobs.npz"))
    tree = nvfp4_jax.load_hf_checkpoint(export)
    assert_vllm_holds(tree, doc, weights)
    config = json.loads((export / "config.json").read_text())
    reference = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        rows = []
        for prompt in prompts:
            x = hf_decoder.logits(
                config, tree, np.asarray(prompt), activations="nvfp4", dtype=dtype
            )
            rows.append(np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1)))
        reference[jnp.dtype(dtype).name] = rows
    bf16, f32 = reference["bfloat16"], reference["float32"]
    n = len(prompts[0]) - 1
    vllm = [logprobs[f"prompt_logprobs_{i}"] for i in range(2)]
    to_vllm = np.mean([np.mean(np.abs(vllm[i] - bf16[i][:n])) for i in range(2)])
    noise = np.mean([np.mean(np.abs(bf16[i][:n] - f32[i][:n])) for i in range(2)])
    agree = np.mean([np.mean(vllm[i].argmax(-1) == bf16[i][:n].argmax(-1)) for i in range(2)])
    # A model trained three steps on synthetic tokens predicts nearly uniformly, so its top-1
    # token flips with rounding alone: vLLM must agree with JAX's bf16 run as often as JAX's own
    # f32 run does (less a margin), not at a fixed rate.
    self_agree = np.mean(
        [np.mean(f32[i][:n].argmax(-1) == bf16[i][:n].argmax(-1)) for i in range(2)]
    )
    figures = dict(
        mean_abs_diff=float(to_vllm),
        bf16_vs_f32=float(noise),
        top1_agreement=float(agree),
        top1_bf16_vs_f32=float(self_agree),
    )
    print(f"vLLM vs JAX W4A4 on the MaxText {model} export:", figures, doc["model_class"])
    for name, value in figures.items():
        record_property(f"{model}_{name}", value)
    factor, floor = LOGPROB_TOLERANCE
    assert to_vllm <= factor * noise + floor, figures
    assert agree >= min(0.9, self_agree - 0.1), figures


def assert_vllm_holds(tree, doc, weights) -> None:
    """vLLM holds the export's NVFP4 weights (its fused qkv_proj and gate_up_proj) bit for bit."""
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=nvfp4_jax.is_nvfp4_array
        )[0]
    }
    for module, info in doc["nvfp4_modules"].items():
        parts = []
        for hf_name, _, _ in info["members"]:
            q = flat[hf_name.removeprefix("model.").replace(".", "/") + "/kernel"]
            parts.append(np.asarray(nvfp4_jax.dequantize(q, jnp.float32)).T)
        expected = np.concatenate(parts)
        same = (weights[module] == expected) | (np.isnan(weights[module]) & np.isnan(expected))
        assert np.all(same), module
    assert len(doc["nvfp4_modules"]) == 8  # per layer: qkv, o, gate_up, down


@pytest.mark.maxtext
@pytest.mark.vllm
def test_the_serve_script_runs_the_export_from_text(child):
    """examples/serve_vllm.py, as the MaxText guide runs it: text in (MaxText's tokenizer,
    shipped in the export), text out."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run bash scripts/vllm_env.sh")
    export = part(child, "dense", "w4a4", "dir")
    run = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "examples" / "serve_vllm.py"), "generate", export]
        + ["--prompt", "Hello world", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "Hello world" in run.stdout, run.stdout[-2000:]
