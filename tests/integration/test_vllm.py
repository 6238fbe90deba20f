"""A real engine serves what we export: the CPU build of vLLM loads a W4A4 export of the trained
example Llama (marker `vllm`; needs the environment `bash scripts/vllm_env.sh` makes).

    bash scripts/vllm_env.sh              # once: .vllm-venv, about 3.5 GB
    bash scripts/test.sh -m vllm -n 0     # about 2 minutes on 2 cores

The test trains the example model for a few steps in NVFP4, calibrates it, exports it as W4A4
("NVFP4") and as weight-only ("W4A16_NVFP4"), runs vLLM on the W4A4 export
(`tests/integration/vllm_client.py`, in vLLM's own environment) and checks:

* the weights as vLLM holds them (its fused qkv_proj / gate_up_proj included) equal
  `nvfp4_jax.dequantize` of the exported tensors bit for bit, the sign of zero aside;
* vLLM's next-token log-probabilities at every position of two prompts match the JAX model
  run with the same W4A4 numerics (`nvfp4_jax.nnx.Linear.from_quantized(...,
  activations="nvfp4")`) within a tolerance derived from the rounding both sides do (see
  `LOGPROB_TOLERANCE`);
* the weight-only export holds the same weight tensors as the W4A4 one, no `input_scale`, and
  its configs say "W4A16_NVFP4" (vLLM's CPU build cannot run W4A16: it forces the Marlin GPU
  kernel);
* the same model with its last block and output head back in bf16 by rules (the example's
  default policy) exports with those layers in bf16, which vLLM loads as such and runs with
  the same log-probabilities as JAX;
* `examples/serve_vllm.py generate` (docs/guides/serving.md) runs that export with its
  byte-level tokenizer (`tokenizer="bytes"`) from a text prompt, and continues it with the
  tokens vLLM generates from the prompt's bytes as token ids.
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
import optax
import pytest
from flax import nnx

import nvfp4_jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import lm_model  # noqa: E402
import train_lm  # noqa: E402

pytestmark = pytest.mark.vllm

VLLM_PYTHON = pathlib.Path(os.environ.get("NVFP4_VLLM_PYTHON", ROOT / ".vllm-venv/bin/python"))
CFG = lm_model.LMConfig(vocab=256, width=128, depth=2, heads=4, recipe=nvfp4_jax.NVFP4Recipe())
STEPS, BATCH, SEQ, PROMPT = 150, 16, 64, 48
# The JAX side and vLLM round differently in three places: vLLM keeps the residual stream in
# bf16 where the example keeps f32; it derives the activation scales from 1 / input_scale
# where the contract uses 2688 / amax (one f32 ulp apart), so a few block scales and codes
# at rounding ties differ; and it sums its bf16 matmuls in another order. Each is a bf16- or
# ulp-level perturbation of the logits, of the size of the difference between the JAX model
# run in bf16 and in f32. The bound: vLLM within 3x that difference (measured in the test)
# plus 0.02 nats, in the mean over positions and tokens of |log p_vllm - log p_jax|.
LOGPROB_TOLERANCE = (3.0, 0.02)


def vllm_available() -> str:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON}: run bash scripts/vllm_env.sh"
    return ""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model, validation bytes) of the example trained briefly in NVFP4, then calibrated."""
    if reason := vllm_available():
        pytest.skip(reason)
    train, val = train_lm.split_text(train_lm.load_text(None), SEQ)
    model = lm_model.TransformerLM(CFG, nnx.Rngs(params=0, quantize=1))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lm_model.loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [
        float(step(model, optimizer, train_lm.batch_at(train, i, BATCH, SEQ, 0)))
        for i in range(STEPS)
    ]
    assert losses[-1] < 0.6 * losses[0], losses[::10]  # it learned something
    nvfp4_jax.nnx.calibrate(model)
    forward = nnx.jit(lambda m, x: m(x))
    for i in range(4):
        forward(model, train_lm.batch_at(train, 10_000 + i, BATCH, SEQ, 0)[:, :-1])
    nvfp4_jax.nnx.calibrate(model, False)
    return model, val


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
    """The W4A4 and W4A16 exports, the prompts, and vLLM's view of the W4A4 export."""
    model, val = trained
    folder = tmp_path_factory.mktemp("vllm")
    exports = {}
    for algo in ("NVFP4", "W4A16_NVFP4"):
        exports[algo] = folder / algo
        nvfp4_jax.export_hf_checkpoint(
            exports[algo], nnx.state(model), quant_algo=algo, config=CFG.hf_config()
        )
    prompts = [val[i : i + PROMPT].astype(int).tolist() for i in (0, 5000)]
    return (exports, prompts, *run_vllm(exports["NVFP4"], prompts, folder / "vllm.json"))


def run_vllm(export: pathlib.Path, prompts, out: pathlib.Path) -> tuple[dict, dict, dict]:
    """(tests/integration/vllm_client.py's JSON, its weights, its log-probabilities) for one
    export."""
    run = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(ROOT / "tests" / "integration" / "vllm_client.py"),
            str(export),
            str(out),
            "--prompts",
            json.dumps(prompts),
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    doc = json.loads(out.read_text())
    stem = str(out.with_suffix(""))
    weights = dict(np.load(stem + ".weights.npz"))
    logprobs = dict(np.load(stem + ".logprobs.npz"))
    return doc, weights, logprobs


def same_but_zero_sign(a: np.ndarray, b: np.ndarray) -> int:
    """How many entries differ in value (-0.0 == +0.0)."""
    return int(np.sum(~((a == b) | (np.isnan(a) & np.isnan(b)))))


def test_vllm_holds_our_weights_bit_for_bit(served):
    exports, _, doc, weights, _ = served
    assert_vllm_holds(exports["NVFP4"], doc, weights)


def assert_vllm_holds(export, doc, weights) -> None:
    """vLLM's dequantized weights of every NVFP4 module equal ours, bit for bit."""
    ours = nvfp4_jax.load_hf_checkpoint(export)
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            ours, is_leaf=nvfp4_jax.is_nvfp4_array
        )[0]
    }
    compared = 0
    for module, info in doc["nvfp4_modules"].items():
        parts = []
        for hf_name, start, stop in info["members"]:
            path = hf_name.removeprefix("model.").replace(".", "/") + "/kernel"
            q = flat[path]
            parts.append(np.asarray(nvfp4_jax.dequantize(q, jnp.float32)).T)  # (out, in)
            assert stop - start == parts[-1].shape[0], module
        expected = np.concatenate(parts)
        assert weights[module].shape == expected.shape, module
        assert same_but_zero_sign(weights[module], expected) == 0, module
        compared += expected.size
    assert len(doc["nvfp4_modules"]) == 4 * CFG.depth  # q/k/v and gate/up fused
    assert compared == sum(v.size for v in flat.values() if nvfp4_jax.is_nvfp4_array(v))


def jax_logprobs(exports, prompts, dtype) -> list[np.ndarray]:
    """log_softmax of the JAX W4A4 model's logits at every position, per prompt."""
    tree = nvfp4_jax.load_hf_checkpoint(exports["NVFP4"] if isinstance(exports, dict) else exports)
    model = lm_model.from_params(CFG, tree, activations="nvfp4", dtype=dtype)
    out = []
    for prompt in prompts:
        logits = model(jnp.asarray([prompt], jnp.int32))[0].astype(jnp.float32)
        out.append(np.asarray(jax.nn.log_softmax(logits)))
    return out


def test_vllm_logprobs_match_the_jax_w4a4_model(served, record_property):
    exports, prompts, _, _, logprobs = served
    check_logprobs(exports, prompts, logprobs, record_property)


def check_logprobs(exports, prompts, logprobs, record_property, what="") -> None:
    bf16 = jax_logprobs(exports, prompts, jnp.bfloat16)
    f32 = jax_logprobs(exports, prompts, jnp.float32)
    rows = []
    for i, prompt in enumerate(prompts):
        vllm = logprobs[f"prompt_logprobs_{i}"]  # row r predicts token r + 1
        n = len(prompt) - 1
        rows.append((vllm, bf16[i][:n], f32[i][:n]))
    to_vllm = np.mean([np.mean(np.abs(v - b)) for v, b, _ in rows])
    noise = np.mean([np.mean(np.abs(b - f)) for _, b, f in rows])
    agree = np.mean([np.mean(v.argmax(-1) == b.argmax(-1)) for v, b, _ in rows])
    worst = max(np.max(np.abs(v - b)) for v, b, _ in rows)
    kl = np.mean([np.mean(np.sum(np.exp(v) * (v - b), axis=-1)) for v, b, _ in rows])
    # The log-probability of the token that actually came next.
    pairs = zip(rows, prompts, strict=True)
    actual = np.mean([np.mean(np.abs(v - b)[np.arange(len(v)), p[1:]]) for (v, b, _), p in pairs])
    figures = dict(
        mean_abs_diff=to_vllm,
        bf16_vs_f32=noise,
        top1_agreement=agree,
        max=worst,
        kl_vllm_jax=kl,
        next_token_abs_diff=actual,
    )
    print(f"vLLM vs JAX W4A4 next-token log-probabilities{what}:", figures)
    for name, value in figures.items():
        record_property(name + what.replace(" ", "_"), float(value))
    factor, floor = LOGPROB_TOLERANCE
    assert to_vllm <= factor * noise + floor, figures
    assert agree >= 0.9, figures


def test_weight_only_export_has_the_same_weights_and_no_input_scale(served):
    exports, *_ = served
    w4a4 = nvfp4_jax.hf.read_safetensors(exports["NVFP4"] / "model.safetensors")
    w4a16 = nvfp4_jax.hf.read_safetensors(exports["W4A16_NVFP4"] / "model.safetensors")
    assert not [k for k in w4a16 if k.endswith("input_scale")]
    assert set(w4a4) - set(w4a16) == {k for k in w4a4 if k.endswith("input_scale")}
    for name, tensor in w4a16.items():
        assert tensor.dtype == w4a4[name].dtype and np.array_equal(
            np.atleast_1d(tensor).view(np.uint8), np.atleast_1d(w4a4[name]).view(np.uint8)
        ), name
    config = json.loads((exports["W4A16_NVFP4"] / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "W4A16_NVFP4"
    assert "input_activations" not in config["quantization_config"]["config_groups"]["group_0"]


@pytest.fixture(scope="module")
def served_with_rules(trained, tmp_path_factory):
    """The trained model with its last block and head back in bf16 by rules, exported W4A4
    with a byte-level tokenizer; vLLM's view of it (tests/integration/vllm_client.py)."""
    model, val = trained
    mixed = nnx.clone(model)
    report = nvfp4_jax.quantize_model(mixed, nvfp4_jax.keep_bf16("^layers/1/", "^lm_head$"))
    assert len(report.paths("high_precision")) == 8
    folder = tmp_path_factory.mktemp("vllm_rules")
    export = folder / "NVFP4"
    result = nvfp4_jax.export_hf_checkpoint(
        export, mixed, config=CFG.hf_config(), tokenizer="bytes"
    )
    assert result.quantized == tuple(
        f"model.layers.0.{m}"
        for m in (
            "mlp.down_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "self_attn.k_proj",
            "self_attn.o_proj",
            "self_attn.q_proj",
            "self_attn.v_proj",
        )
    )
    prompts = [val[i : i + PROMPT].astype(int).tolist() for i in (0, 5000)]
    return export, prompts, *run_vllm(export, prompts, folder / "vllm.json")


def test_vllm_runs_a_model_partly_kept_in_bf16_by_rules(served_with_rules, record_property):
    export, prompts, doc, _, logprobs = served_with_rules
    assert sorted(doc["nvfp4_modules"]) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.qkv_proj",
    ]
    bf16 = {o["name"] for o in doc["other_linear_modules"]}
    assert {"model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"} <= bf16
    check_logprobs(export, prompts, logprobs, record_property, " (bf16 by rules)")


def test_serve_script_generates_from_text(served_with_rules):
    """examples/serve_vllm.py, as the serving guide runs it: text in, text out, the CPU build."""
    export, prompts, doc, _, _ = served_with_rules
    text = bytes(prompts[0]).decode("utf-8")  # the documentation text: ASCII
    run = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(ROOT / "examples" / "serve_vllm.py"),
            "generate",
            str(export),
            "--prompt",
            text,
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "Using EmulationNvFp4LinearKernel" in run.stderr + run.stdout
    generated = bytes(doc["prompts"][0]["generated_token_ids"]).decode("utf-8", "replace")
    print("serve_vllm.py generate:", repr(run.stdout.split("--- prompt")[-1]))
    assert f"{text}{generated}\n" in run.stdout, (run.stdout[-2000:], generated)


@pytest.fixture(scope="module", params=["four_over_six", "gptq"])
def served_ptq(request, trained, tmp_path_factory):
    """The trained model quantized for export by `quantize_for_export` (W4A4, calibrated on
    training batches) with Four Over Six or GPTQ; vLLM's view of the export."""
    model, val = trained
    train, _ = train_lm.split_text(train_lm.load_text(None), SEQ)
    batches = [train_lm.batch_at(train, 20_000 + i, BATCH, SEQ, 0)[:, :-1] for i in range(4)]
    frozen, report = nvfp4_jax.quantize_for_export(
        model, batches, method=request.param, activations="nvfp4"
    )
    assert len(report.paths("nvfp4")) == 7 * CFG.depth
    folder = tmp_path_factory.mktemp(f"vllm_{request.param}")
    export = folder / "NVFP4"
    nvfp4_jax.export_hf_checkpoint(
        export, nnx.state(frozen), quant_algo=report.quant_algo, config=CFG.hf_config()
    )
    prompts = [val[i : i + PROMPT].astype(int).tolist() for i in (0, 5000)]
    return request.param, export, prompts, *run_vllm(export, prompts, folder / "vllm.json")


def test_vllm_serves_post_training_quantized_exports(served_ptq, record_property):
    """The stored format of 4/6 (a decode scale amax / 1536) and of GPTQ is plain NVFP4: vLLM
    loads it unchanged, holds our weights bit for bit and computes our model's numbers."""
    method, export, prompts, doc, weights, logprobs = served_ptq
    assert_vllm_holds(export, doc, weights)
    check_logprobs(export, prompts, logprobs, record_property, f" ({method})")
