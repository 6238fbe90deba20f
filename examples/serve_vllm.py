"""Runs a checkpoint `nvfp4_jax.export_hf_checkpoint` wrote in vLLM: offline generation, or
vLLM's OpenAI-compatible server. Works with vLLM's CPU build and on a GPU.

Run it with the Python of your vLLM environment (`bash scripts/vllm_env.sh` makes one with
vLLM's CPU build in .vllm-venv), not the project's:

    .vllm-venv/bin/python examples/serve_vllm.py generate out/llama-nvfp4 --prompt "def "
    .vllm-venv/bin/python examples/serve_vllm.py serve out/llama-nvfp4 --port 8000

`generate` loads the folder with `vllm.LLM` and prints the continuation of each `--prompt`
(greedy by default). `serve` is `vllm serve FOLDER [FLAGS]`, every flag passed on to vLLM.

vLLM's CPU build ships an NVFP4 emulation kernel (the weights and activations dequantized,
then a bf16 matmul) but does not offer it for the CPU platform, so `vllm serve` alone fails
there with "Failed to find a kernel that can implement the NVFP4 linear layer". This script
registers it before vLLM builds the model. It does so when imported, so the processes vLLM
spawns (its engine core re-imports this file as `__mp_main__`) register it too. On a GPU
nothing is registered: vLLM picks its own kernel (FP4 tensor cores on Blackwell; Marlin,
weight-only, on Hopper and Ampere).

The example's model (examples/lm_model.py) reads bytes. Export it with `tokenizer="bytes"`
and engines take text prompts. A folder with no tokenizer also works here: `generate` then
passes the prompt's UTF-8 bytes as token ids (`skip_tokenizer_init=True`) and decodes the
generated ids as bytes; `serve` needs `--skip-tokenizer-init` and token ids as prompts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from pathlib import Path

# vLLM reads these when imported. A small KV cache (GiB) suits the CPU build on a laptop; a
# single engine process keeps `generate` simple.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def register_cpu_kernel() -> bool:
    """Offers vLLM's NVFP4 emulation kernel on the CPU platform; True if it did."""
    try:  # (after the environment variables above)
        from vllm.model_executor.kernels.linear import register_linear_kernel  # noqa: PLC0415
        from vllm.model_executor.kernels.linear.nvfp4.emulation import (  # noqa: PLC0415
            EmulationNvFp4LinearKernel,
        )
        from vllm.platforms import PlatformEnum, current_platform  # noqa: PLC0415
    except ImportError as error:
        sys.exit(
            f"serve_vllm: cannot import vLLM ({error}); run this with the Python of a vLLM "
            "environment, e.g. .vllm-venv/bin/python after bash scripts/vllm_env.sh"
        )
    if not current_platform.is_cpu():
        return False
    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    return True


# At import, so that the engine processes vLLM spawns register the kernel too.
CPU = register_cpu_kernel()


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="serve_vllm", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    commands = p.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate with vllm.LLM and print the text")
    gen.add_argument("model", type=Path, help="the exported folder")
    gen.add_argument("--prompt", action="append", default=None, help="repeatable; text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--max-model-len", type=int, default=None, help="default: the config's")
    serve = commands.add_parser("serve", help="vllm serve MODEL, the other flags passed on")
    serve.add_argument("model", type=Path, help="the exported folder")
    args, rest = p.parse_known_args(argv)
    if args.command == "generate" and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if not (args.model / "config.json").is_file():
        p.error(f"{args.model} holds no config.json: pass the folder export_hf_checkpoint wrote")
    return args, rest


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))


def generate(args) -> None:
    import vllm  # noqa: PLC0415  (after the environment variables above)

    config = json.loads((args.model / "config.json").read_text())
    tokenizer = has_tokenizer(args.model)
    if not tokenizer and config.get("vocab_size", 0) < 256:
        sys.exit(f"serve_vllm: {args.model} has no tokenizer and is no byte-level model")
    llm = vllm.LLM(
        model=str(args.model),
        skip_tokenizer_init=not tokenizer,
        max_model_len=args.max_model_len or config.get("max_position_embeddings"),
        enforce_eager=CPU,  # (no graph capture or compilation on the CPU build)
    )
    params = vllm.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        detokenize=tokenizer,
        ignore_eos=not tokenizer,
    )
    texts = args.prompt or ["def "]
    prompts = texts if tokenizer else [{"prompt_token_ids": list(t.encode())} for t in texts]
    for text, out in zip(texts, llm.generate(prompts, params), strict=True):
        completion = out.outputs[0]
        if not tokenizer:  # token i is byte i
            completion.text = bytes(completion.token_ids).decode("utf-8", "replace")
        print(f"--- prompt {text!r} ({len(out.prompt_token_ids)} tokens)")
        print(f"{text}{completion.text}")


def serve(args, rest: list[str]) -> None:
    import vllm  # noqa: PLC0415  (as above)
    from vllm.entrypoints.cli.main import main  # noqa: PLC0415

    # The CPU build's distribution is "vllm-cpu": its CLI asks for the version of "vllm",
    # which fails (PackageNotFoundError) before any subcommand runs, `vllm serve` included.
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version
        importlib.metadata.version = lambda name: (
            vllm.__version__ if name == "vllm" else version(name)
        )
    sys.argv = ["vllm", "serve", str(args.model), *rest]
    main()


def main(argv=None) -> None:
    args, rest = parse_args(argv)
    if args.command == "generate":
        generate(args)
    else:
        serve(args, rest)
    sys.stdout.flush()
    os._exit(0)  # vLLM may leave non-daemon threads behind


if __name__ == "__main__":
    main()
