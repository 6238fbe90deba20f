"""The MaxText side of tests/integration/test_maxtext_export.py: runs in MaxText's environment
(`.maxtext-venv`, made by `bash scripts/maxtext_env.sh`).

    python tests/integration/maxtext_export_child.py OUT.json

Trains tiny decoders through the launcher with checkpointing on, exports them, imports the
ModelOpt fixture, and writes what it found to OUT.json (one object per part, or the part's
`{"error": traceback}`); the test asserts on it. Every expectation here is computed without
the export's own mapping code: the layouts are written out from MaxText's tree (the query
kernel (D, L, H, E) under `scan_layers`, (D, H, E) per layer without, ...).

* `dense` (a llama2 decoder, scan_layers=True) and `moe` (a Mixtral-style decoder, 4 experts,
  scan_layers=False, its layer 1's attention out projection kept in bf16 by `--nvfp4-rules`):
  trained 3 steps, exported weight-only and W4A4 (calibrated on 2 batches of MaxText's
  synthetic data); every NVFP4 weight of the export against the quantization of MaxText's
  trained kernel with the recipe's weight spec and the documented amax (the fused group's);
  the linears whose codes the export reports as the training forward's against the training
  forward's own quantization (own amax); the export's NVFP4 linears against the training
  run's report; the logits of the example's model holding the export against MaxText's own
  forward holding the export's weights (imported back with `nvfp4_jax.maxtext.load`).
* `fixture`: the ModelOpt Llama fixture imported into MaxText (scan_layers=True): the weights
  MaxText reads from the imported checkpoint against the released values, MaxText's logits
  against the fixture's reference (transformers, f32), the export with `base=` against the
  fixture's bytes, and two steps of fine-tuning through the launcher, then exported.
* `refusals`: a checkpoint of another architecture than the config, a missing step, a config
  MaxText rejects, W4A4 without activation amaxes; each a ValueError, nothing written.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import nvfp4_jax
import nvfp4_jax.maxtext as nvfp4_maxtext
from nvfp4_jax._src.core.ops import quantize_with_spec
from nvfp4_jax._src.integrations import maxtext_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hf_decoder  # noqa: E402
import lm_model  # noqa: E402

CONFIG = pathlib.Path(__import__("maxtext").__file__).parent / "configs" / "base.yml"
FIXTURE = ROOT / "tests" / "fixtures" / "modelopt_llama_nvfp4"
BF16 = ml_dtypes.bfloat16
COMMON = [
    "dataset_type=synthetic",
    "per_device_batch_size=2",
    "max_target_length=64",
    "attention=dot_product",
    "hardware=cpu",
    "skip_jax_distributed_system=True",
    "enable_tensorboard=False",
    "enable_goodput_recording=False",
    "monitor_goodput=False",
    "enable_dropout=False",
    "learning_rate=1e-3",
    "log_period=1",
]
TINY = [
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "base_mlp_dim=128",
    "base_num_decoder_layers=2",
    "head_dim=16",
    "vocab_size=256",
]
# The models vLLM runs: its CPU attention needs head_dim 32 or more.
WIDE = [
    "base_emb_dim=128",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "base_mlp_dim=128",
    "base_num_decoder_layers=2",
    "head_dim=32",
    "vocab_size=32000",  # MaxText's default tokenizer's (tokenizer.llama2): the export ships it
]
MOE = [
    "decoder_block=mixtral",
    "num_experts=4",
    "num_experts_per_tok=2",
    "base_moe_mlp_dim=128",
    "sparse_matmul=True",
    "megablox=False",
    "use_tokamax_gmm=False",
    "scan_layers=False",
]
# The ModelOpt fixture's model (tests/fixtures/modelopt_llama_nvfp4/config.json).
FIXTURE_MODEL = [
    "base_emb_dim=128",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "base_mlp_dim=256",
    "base_num_decoder_layers=2",
    "head_dim=32",
    "vocab_size=512",
    "normalization_layer_epsilon=1e-6",
]
RECIPE = nvfp4_jax.NVFP4Recipe()
TOKENS = (np.arange(64).reshape(2, 32) * 37 + 11) % 256


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def train(name: str, extra: list[str], work: pathlib.Path, flags=()) -> dict:
    """Three steps through the launcher with checkpointing on; the run's arguments."""
    args = [
        str(CONFIG),
        f"run_name={name}",
        f"base_output_directory={work / 'out'}",
        *COMMON,
        *extra,
    ]
    report = work / f"{name}_report.json"
    train_args = [
        *args,
        "steps=3",
        "enable_checkpointing=True",
        "async_checkpointing=False",
        "checkpoint_period=2",
    ]
    nvfp4_maxtext.main(["nvfp4_jax.maxtext", *train_args, "--nvfp4-report", str(report), *flags])
    written = json.loads(report.read_text())
    if written["status"] != "completed":
        raise RuntimeError(f"the launcher's report: {written}")
    steps = sorted(int(p.name) for p in (work / "out" / name / "checkpoints").iterdir())
    items = work / "out" / name / "checkpoints" / str(steps[-1]) / "items"
    return {
        "args": [*args, f"load_parameters_path={items}"],
        "report": written["providers"][0],
        "steps": steps,
        "items": str(items),
    }


# --- the expected bits, from MaxText's layout written out --------------------------------------


def layer(leaf, i: int, scanned: bool):
    return np.asarray(leaf)[:, i] if scanned else np.asarray(leaf)


def attention_and_mlp(params: dict, i: int, scanned: bool, moe: bool, q_scale: float) -> dict:
    """{HF module: (the training forward's W (K, N) in bf16, the HF scale)} of layer i.

    `q_scale`: sqrt(E) where MaxText folds 1 / sqrt(E) into the query (Llama, Mixtral), 1 for
    Qwen3 (its attention scales).
    """
    decoder = params["decoder"]
    lay = decoder["layers"] if scanned else decoder[f"layers_{i}"]
    attn = lay["self_attention"]
    d = attn["query"]["kernel"].shape[0]
    out = {}
    for name, hf, scale in (
        ("query", "q_proj", q_scale),
        ("key", "k_proj", 1.0),
        ("value", "v_proj", 1.0),
    ):
        w = layer(attn[name]["kernel"], i, scanned).astype(BF16)
        out[f"model.layers.{i}.self_attn.{hf}"] = (w.reshape(d, -1), scale)
    w = layer(attn["out"]["kernel"], i, scanned).astype(BF16)  # (H, E, D)
    out[f"model.layers.{i}.self_attn.o_proj"] = (w.reshape(-1, d), 1.0)
    if not moe:
        for name, hf in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
            w = layer(lay["mlp"][name]["kernel"], i, scanned).astype(BF16)
            out[f"model.layers.{i}.mlp.{hf}"] = (w, 1.0)
        return out
    block = lay["MoeBlock_0"]
    for name, hf in (("wi_0", "w1"), ("wi_1", "w3"), ("wo", "w2")):
        stack = np.asarray(block[name])
        stack = stack[:, i] if scanned else stack
        for e in range(stack.shape[0]):
            w = stack[e].astype(BF16)
            out[f"model.layers.{i}.block_sparse_moe.experts.{e}.{hf}"] = (w, 1.0)
    return out


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def group_of(module: str) -> tuple:
    parent, _, name = module.rpartition(".")
    for index, group in enumerate(FUSED):
        if name in group:
            return (parent, index)
    return (module,)


def quantize(w, amax=None):
    spec = RECIPE.spec("weight", "fprop")
    return quantize_with_spec(
        jnp.asarray(w), spec, amax=None if amax is None else jnp.float32(amax)
    )


def loaded_weight(loaded: dict, name_map, module: str):
    """(codes, block scales, decode scale) of an HF linear as `load_hf_checkpoint` holds it."""
    path, _ = name_map.to_flax(f"{module}.weight", 2)
    expert = name_map.expert_of(f"{module}.weight", 2)
    node = loaded
    for key in path.split("/"):
        node = node[int(key) if key.isdigit() else key]
    codes, scales, decode = (np.asarray(a) for a in (node.codes, node.scales, node.global_scale))
    if expert is not None:
        codes, scales, decode = codes[expert], scales[expert], decode[expert]
    return codes, scales, decode


def check_bits(
    export: pathlib.Path, params: dict, layers: int, scanned: bool, moe: bool, result, q_scale=4.0
) -> dict:
    """Every NVFP4 weight of `export`, as `load_hf_checkpoint` reads it, against its expected
    quantization; the exact ones against the training forward's."""
    name_map = nvfp4_jax.hf.mixtral_name_map() if moe else None
    loaded = nvfp4_jax.load_hf_checkpoint(export, name_map=name_map)
    tensors = nvfp4_jax.hf.read_safetensors(export / "model.safetensors")
    expected = {}
    for i in range(layers):
        expected.update(attention_and_mlp(params, i, scanned, moe, q_scale))
    hf_weights = {
        m: (w.astype(np.float32) * np.float32(c) if c != 1 else w) for m, (w, c) in expected.items()
    }
    amax = {m: float(np.max(np.abs(np.asarray(x, np.float32)))) for m, x in hf_weights.items()}
    groups: dict = {}
    for m in expected:
        groups.setdefault(group_of(m), []).append(m)
    group_amax = {m: max(amax[o] for o in members) for members in groups.values() for m in members}
    compared, exact, requantized, mismatches = 0, [], [], []
    nvfp4_modules = [
        k[: -len(".weight")]
        for k, v in tensors.items()
        if k.endswith(".weight") and v.dtype == np.uint8
    ]
    for module in nvfp4_modules:
        want = quantize(hf_weights[module], group_amax[module])
        codes, scales, decode = loaded_weight(
            loaded, name_map or nvfp4_jax.hf.llama_name_map(), module
        )
        ok = (
            same_bits(codes, np.asarray(want.codes))
            and same_bits(scales, np.asarray(want.scales))
            and np.float32(decode) == np.float32(want.global_scale)
        )
        if not ok:
            mismatches.append(module)
        compared += 1
        if amax[module] == group_amax[module] and math.log2(expected[module][1]).is_integer():
            w, scale = expected[module]
            training = quantize(w)  # the forward's: bf16(kernel), its own amax
            same = same_bits(codes, np.asarray(training.codes)) and same_bits(
                scales, np.asarray(training.scales)
            )
            same = same and np.float32(decode) == np.float32(training.global_scale) * np.float32(
                scale
            )
            exact.append((module, bool(same)))
        else:
            requantized.append(module)
    return {
        "compared": compared,
        "mismatches": mismatches,
        "exact": exact,
        "requantized": requantized,
        "reported_exact": list(result.training_exact),
        "reported_requantized": sorted(result.requantized),
        "nvfp4_modules": sorted(nvfp4_modules),
    }


def logits_of(export: pathlib.Path, args: list[str], moe: bool) -> dict:
    """The example's model on the export against MaxText's forward on the export's weights."""
    config = json.loads((export / "config.json").read_text())
    name_map = nvfp4_jax.hf.mixtral_name_map() if moe else None
    tree = nvfp4_jax.load_hf_checkpoint(export, name_map=name_map)
    cfg = lm_model.LMConfig.from_hf_config(config)
    example = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = lm_model.from_params(cfg, tree, dtype=dtype)
        with jax.default_matmul_precision("highest"):
            example[jnp.dtype(dtype).name] = np.asarray(
                model(jnp.asarray(TOKENS, jnp.int32)), np.float32
            )
    maxtext = maxtext_logits(export, args)
    f32, bf16 = example["float32"], example["bfloat16"]
    return {
        "maxtext_vs_example": float(np.mean(np.abs(maxtext - f32))),
        "example_bf16_vs_f32": float(np.mean(np.abs(bf16 - f32))),
        "max_maxtext_vs_example": float(np.max(np.abs(maxtext - f32))),
        "logit_scale": float(np.max(np.abs(f32))),
        "top1_agreement": float(np.mean(maxtext.argmax(-1) == f32.argmax(-1))),
    }


def maxtext_logits(export: pathlib.Path, args: list[str], dtype: str = "bfloat16") -> np.ndarray:
    """MaxText's forward (its compute `dtype`) holding the export's weights, imported back."""
    params = nvfp4_maxtext.load_params(export, args)
    config = maxtext_model.maxtext_config(args, "child", load_parameters_path="", dtype=dtype)
    return maxtext_model.forward(maxtext_model.model_holding(config, params), TOKENS)


def decoder_logits(export: pathlib.Path, name_map, activations="high_precision", dtype=jnp.float32):
    """The plain HF decoder (tests/integration/hf_decoder.py) on the export, per sequence."""
    config = json.loads((export / "config.json").read_text())
    tree = nvfp4_jax.load_hf_checkpoint(export, name_map=name_map)
    with jax.default_matmul_precision("highest"):
        rows = [
            hf_decoder.logits(config, tree, t, activations=activations, dtype=dtype) for t in TOKENS
        ]
    return np.stack(rows)


def report_modules(report: dict) -> dict:
    """{module path: action} of the training run's provider report, for the ops with a weight
    (`dot_general`, the experts' `ragged_dot`); a norm's or attention's einsum is no linear."""
    out = {}
    for key, entry in report.items():
        module, _, op = key.partition(":")
        if op.rstrip("0123456789") in ("dot_general", "ragged_dot"):
            out[module] = entry["action"]
    return out


def export_part(name, extra, work, moe: bool, flags=(), rules=(), sizes=TINY) -> dict:
    run = train(name, [*sizes, *extra], work, flags)
    q_scale = math.sqrt(int(next(a for a in sizes if a.startswith("head_dim=")).split("=")[1]))
    scanned = "scan_layers=False" not in extra
    config = maxtext_model.maxtext_config(run["args"], "child")
    params = maxtext_model.trained_params(config, "child")
    out = {"steps": run["steps"], "report": report_modules(run["report"])}
    w4a16 = work / f"{name}_w4a16"
    result = nvfp4_maxtext.export_checkpoint(
        w4a16, run["args"], rules=rules, quant_algo="W4A16_NVFP4"
    )
    out["w4a16"] = {
        "result": result.to_dict(),
        "bits": check_bits(w4a16, params, 2, scanned, moe, result, q_scale),
        "logits": logits_of(w4a16, run["args"], moe),
        "files": sorted(p.name for p in w4a16.iterdir()),
    }
    w4a4 = work / f"{name}_w4a4"
    result = nvfp4_maxtext.export_checkpoint(w4a4, run["args"], rules=rules, calibration_batches=2)
    tensors = nvfp4_jax.hf.read_safetensors(w4a4 / "model.safetensors")
    out["w4a4"] = {
        "dir": str(w4a4),
        "result": result.to_dict(),
        "input_scales": {k: float(v) for k, v in tensors.items() if k.endswith("input_scale")},
        "bits": check_bits(w4a4, params, 2, scanned, moe, result, q_scale),
    }
    out["args"] = run["args"]
    return out


def dense(work: pathlib.Path) -> dict:
    return export_part("dense", [], work, moe=False, sizes=WIDE)


def moe(work: pathlib.Path) -> dict:
    rules = work / "rules.json"
    rules.write_text(json.dumps([{"pattern": "layers_1/self_attention/out$", "recipe": None}]))
    keep = [nvfp4_jax.rules.Rule("layers_1/self_attention/out$", None)]
    return export_part("moe", MOE, work, moe=True, flags=["--nvfp4-rules", str(rules)], rules=keep)


FAMILIES = {
    "llama31": ["rope_type=llama3.1"],
    "mistral": ["decoder_block=mistral"],
    "qwen3": ["decoder_block=qwen3", "use_qk_norm=True"],
    "qwen3_moe": [
        "decoder_block=qwen3_moe",
        "use_qk_norm=True",
        "num_experts=4",
        "num_experts_per_tok=2",
        "base_moe_mlp_dim=64",
        "base_mlp_dim=64",
        "sparse_matmul=True",
        "megablox=False",
        "use_tokamax_gmm=False",
    ],
}


def random_params(config) -> dict:
    """MaxText's own initialization of the config's model, as numpy arrays."""
    creation = maxtext_model.import_maxtext("maxtext.utils.model_creation_utils")
    utils_nnx = maxtext_model.import_maxtext("maxtext.utils.maxtext_utils_nnx")
    from flax import nnx  # noqa: PLC0415

    model = creation.from_config(config, rngs=utils_nnx.create_nnx_rngs(config))
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def families(work: pathlib.Path) -> dict:
    """llama3.1's RoPE, Mistral, Qwen3 and Qwen3-MoE at MaxText's initialization: exported
    weight-only, then the plain HF decoder on the export against MaxText's forward (f32)."""
    from nvfp4_jax._src.integrations import maxtext_names, maxtext_plan  # noqa: PLC0415
    from nvfp4_jax._src.integrations.maxtext_export import write_export  # noqa: PLC0415

    out = {}
    for name, extra in FAMILIES.items():
        args = [str(CONFIG), f"run_name={name}", f"base_output_directory={work / 'out'}"]
        args += [*COMMON, *TINY, *extra]
        config = maxtext_model.maxtext_config(args, "child")
        spec = maxtext_names.model_spec(config)
        decisions = maxtext_plan.precisions(spec, nvfp4_maxtext.rules_from_config(config))
        export = work / f"family_{name}"
        write_export(export, random_params(config), spec, decisions, quant_algo="W4A16_NVFP4")
        name_map = nvfp4_jax.hf.qwen3_moe_name_map() if name == "qwen3_moe" else None
        ours = decoder_logits(export, name_map)
        maxtext = maxtext_logits(export, args, dtype="float32")
        out[name] = {
            "architecture": json.loads((export / "config.json").read_text())["architectures"][0],
            "max_abs_diff": float(np.max(np.abs(maxtext - ours))),
            "logit_scale": float(np.max(np.abs(ours))),
            "top1_agreement": float(np.mean(maxtext.argmax(-1) == ours.argmax(-1))),
        }
    return out


def qwen3(work: pathlib.Path) -> dict:
    """A tiny Qwen3 trained, exported W4A4, its weights and logits checked; for vLLM."""
    run = train("qwen3", [*WIDE, *FAMILIES["qwen3"]], work)
    config = maxtext_model.maxtext_config(run["args"], "child")
    params = maxtext_model.trained_params(config, "child")
    export = work / "qwen3_w4a4"
    result = nvfp4_maxtext.export_checkpoint(export, run["args"], calibration_batches=2)
    ours = decoder_logits(export, None)
    maxtext = maxtext_logits(export, run["args"], dtype="float32")
    return {
        "dir": str(export),
        "bits": check_bits(export, params, 2, True, False, result, q_scale=1.0),
        "max_abs_diff": float(np.max(np.abs(maxtext - ours))),
        "logit_scale": float(np.max(np.abs(ours))),
        "top1_agreement": float(np.mean(maxtext.argmax(-1) == ours.argmax(-1))),
    }


def raw_tensors(directory: pathlib.Path) -> dict:
    import safetensors  # noqa: PLC0415

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            out[name] = (entry["dtype"], tuple(entry["shape"]), bytes(entry["data"]).hex())
    return out


def fixture(work: pathlib.Path) -> dict:
    """Import the ModelOpt fixture, read it back with MaxText, run it, export it, fine-tune it."""
    model_args = [
        str(CONFIG),
        "run_name=fixture_ft",
        f"base_output_directory={work / 'out'}",
        *COMMON,
        *FIXTURE_MODEL,
    ]
    items = nvfp4_maxtext.import_checkpoint(FIXTURE, work / "imported", model_args)
    args = [*model_args, f"load_parameters_path={items}"]
    config = maxtext_model.maxtext_config(args, "child")
    read = maxtext_model.trained_params(config, "child")  # MaxText's own reading
    loaded = nvfp4_maxtext.load_params(FIXTURE, model_args)
    same = all(
        same_bits(a, b) for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(loaded), strict=True)
    )
    # the released query, decoded by ModelOpt, divided by sqrt(32), is MaxText's master weight
    decode = dict(np.load(FIXTURE / "reference" / "modelopt_dequant.npz"))
    q0 = decode["model.layers.0.self_attn.q_proj.weight"].T.reshape(128, 4, 32) / np.float32(
        math.sqrt(32)
    )
    query = np.asarray(read["decoder"]["layers"]["self_attention"]["query"]["kernel"])[:, 0]
    ids = np.load(FIXTURE / "reference" / "input_ids.npy")
    reference = np.load(FIXTURE / "reference" / "logits_dequant_f32.npy")
    logits = maxtext_model.forward(maxtext_model.model_holding(config, read), ids)
    out = {
        "maxtext_reads_the_released_values": bool(same),
        "query_is_released_over_sqrt_e": bool(np.array_equal(np.abs(query), np.abs(q0))),
        "logits_vs_transformers": float(np.mean(np.abs(logits - reference))),
        "max_logits_vs_transformers": float(np.max(np.abs(logits - reference))),
        "logit_scale": float(np.max(np.abs(reference))),
        "top1_agreement": float(np.mean(logits.argmax(-1) == reference.argmax(-1))),
    }
    round_trip = work / "round_trip"
    result = nvfp4_maxtext.export_checkpoint(round_trip, args, base=FIXTURE)
    out["round_trip_same_bytes"] = raw_tensors(round_trip) == raw_tensors(FIXTURE)
    out["round_trip_from_base"] = len(result.from_base)
    ours = json.loads((round_trip / "config.json").read_text())
    theirs = json.loads((FIXTURE / "config.json").read_text())
    ours.pop("quantization_config")
    theirs.pop("quantization_config")
    out["round_trip_same_config"] = ours == theirs
    # fine-tune two steps from the released values, then export against the release
    nvfp4_maxtext.main(
        [
            "nvfp4_jax.maxtext",
            *args,
            "steps=2",
            "enable_checkpointing=True",
            "async_checkpointing=False",
            "checkpoint_period=1",
            f"metrics_file={work / 'fixture_ft.jsonl'}",
        ]
    )
    rows = [
        json.loads(line)
        for line in (work / "fixture_ft.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = sorted(int(p.name) for p in (work / "out" / "fixture_ft" / "checkpoints").iterdir())
    tuned = work / "out" / "fixture_ft" / "checkpoints" / str(steps[-1]) / "items"
    tuned_args = [*model_args, f"load_parameters_path={tuned}"]
    exported = nvfp4_maxtext.export_checkpoint(
        work / "tuned", tuned_args, base=FIXTURE, calibration_batches=1
    )
    out["fine_tune"] = {
        "losses": [row["learning/loss"] for row in rows],
        "nvfp4": len(exported.nvfp4),
        "requantized": len(exported.requantized),
        "training_exact": len(exported.training_exact),
        "from_base": list(exported.from_base),
        "files": sorted(p.name for p in (work / "tuned").iterdir()),
    }
    return out


def refused(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def import_into_files(work: pathlib.Path, args: list[str]) -> None:
    """An import into a folder that holds a file: refused, the file kept."""
    folder = work / "kept"
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("mine")
    try:
        nvfp4_maxtext.import_checkpoint(FIXTURE, folder, [*args[:-1], *FIXTURE_MODEL])
    finally:
        if [p.name for p in folder.iterdir()] != ["notes.txt"]:
            raise RuntimeError("the import wrote into a folder that held files")


def refusals(work: pathlib.Path, dense_part: dict) -> dict:
    args = dense_part["args"]
    out = work / "refused"
    items = [a for a in args if a.startswith("load_parameters_path=")][0].split("=", 1)[1]
    missing_step = items.replace("/checkpoints/2/", "/checkpoints/7/")
    return {
        "architecture": refused(
            lambda: nvfp4_maxtext.export_checkpoint(
                out, [*args, *MOE[:4]], quant_algo="W4A16_NVFP4"
            )
        ),
        "missing_step": refused(
            lambda: nvfp4_maxtext.export_checkpoint(
                out, [*args, f"load_parameters_path={missing_step}"], quant_algo="W4A16_NVFP4"
            )
        ),
        "rejected_config": refused(
            lambda: nvfp4_maxtext.export_checkpoint(out, [*args, "colour=1"])
        ),
        "w4a4_without_amaxes": refused(lambda: nvfp4_maxtext.export_checkpoint(out, args)),
        "import_other_architecture": refused(
            lambda: nvfp4_maxtext.import_checkpoint(
                FIXTURE, work / "refused_import", [*args[:-1], *MOE[:4]]
            )
        ),
        "import_into_files": refused(lambda: import_into_files(work, args)),
        "left_behind": sorted(
            p.name for p in work.iterdir() if p.name.startswith((".refused", "refused"))
        ),
    }


def main() -> None:
    out_path = pathlib.Path(sys.argv[1])
    work = out_path.parent
    result: dict = {"jax": jax.__version__}
    parts = [
        ("dense", dense),
        ("moe", moe),
        ("fixture", fixture),
        ("families", families),
        ("qwen3", qwen3),
    ]
    chosen = sys.argv[2:]  # (to run some parts while debugging: dense, moe, fixture)
    for name, part in parts:
        if chosen and name not in chosen:
            continue
        try:
            result[name] = part(work)
        except Exception:  # noqa: BLE001  (reported to the test, which fails on it)
            result[name] = {"error": traceback.format_exc()}
        out_path.write_text(json.dumps(result, indent=1))
    try:
        if "dense" in result:
            result["refusals"] = refusals(work, result["dense"])
    except Exception:  # noqa: BLE001
        result["refusals"] = {"error": traceback.format_exc()}
    out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
