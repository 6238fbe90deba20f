"""Runs an NVIDIA ModelOpt NVFP4 Llama checkpoint in JAX and compares it with a reference.

    python examples/run_modelopt_checkpoint.py                 # the fixture the tests use
    python examples/run_modelopt_checkpoint.py DIR --activations nvfp4

`nvfp4_jax.load_hf_checkpoint` reads the checkpoint (every quantized linear an `NVFP4Array`
that decodes exactly as ModelOpt does), `lm_model.from_params` builds the example's Llama from
it, and the script prints the model's logits beside the reference logits stored with the
fixture (`reference/logits_dequant_f32.npy`: an f32 transformers Llama holding ModelOpt's own
dequantized weights, activations not quantized, i.e. weight-only). Give `--activations
nvfp4` to run W4A4 as an engine does (activations quantized with the checkpoint's static
input scales): the logits then move by the activation quantization error.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from lm_model import LMConfig, from_params

import nvfp4_jax

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/modelopt_llama_nvfp4"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", type=pathlib.Path, default=FIXTURE)
    parser.add_argument(
        "--activations", choices=("high_precision", "nvfp4"), default="high_precision"
    )
    args = parser.parse_args(argv)
    if not (args.checkpoint / "config.json").is_file():
        parser.error(f"{args.checkpoint} holds no config.json: not a Hugging Face checkpoint")
    config = json.loads((args.checkpoint / "config.json").read_text())
    cfg = LMConfig.from_hf_config(config)
    tree = nvfp4_jax.load_hf_checkpoint(args.checkpoint)
    model = from_params(cfg, tree, activations=args.activations, dtype=jnp.float32)
    reference = args.checkpoint / "reference"
    ids_path = reference / "input_ids.npy"
    ids = np.load(ids_path) if ids_path.exists() else np.arange(32)[None] % cfg.vocab
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    print(f"{args.checkpoint.name}: {cfg.depth} layers, hidden {cfg.width}, vocab {cfg.vocab}")
    print(f"activations: {args.activations}; logits {logits.shape}")
    result = {"logits_shape": list(logits.shape)}
    expected_path = reference / "logits_dequant_f32.npy"
    if expected_path.exists():
        expected = np.load(expected_path)
        diff = np.abs(logits - expected)
        agree = float(np.mean(logits.argmax(-1) == expected.argmax(-1)))
        result.update(max_abs_diff=float(diff.max()), top1_agreement=agree)
        print(f"{'position':>8} {'jax logit[0:3]':>30} {'reference logit[0:3]':>30}")
        for t in range(0, logits.shape[1], 8):
            ours = np.array2string(logits[0, t, :3], precision=4)
            theirs = np.array2string(expected[0, t, :3], precision=4)
            print(f"{t:>8} {ours:>30} {theirs:>30}")
        scale = np.abs(expected).max()
        print(
            f"max |jax - reference| = {diff.max():.3g} (logits up to {scale:.3g}); "
            f"top-1 agreement {agree:.1%}"
        )
    return result


if __name__ == "__main__":
    main()
