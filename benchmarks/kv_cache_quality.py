"""The NVFP4 KV cache's quality on the example model: validation loss and greedy tokens.

    python examples/train_lm.py --recipe bf16 --heads 2 --out runs/kv   # the example, in bf16
    python benchmarks/kv_cache_quality.py runs/kv                         # then this

The model is a train_lm.py checkpoint (its bf16 run, or `--run nvfp4`), decoded by
examples/generate.py's cached forward with each KV cache: bf16, nvfp4 and nvfp4_4over6
(vLLM's `--kv-cache-dtype` of those names). The NVFP4 caches' decode scales are calibrated
as a serving export's would be: `quantize_for_export(..., kv_cache=True)` of the float model
over `--calibration` training batches, `kv_cache.scale_from_amax` of each attention's
amaxes; also with vLLM's default scale 1.0, for comparison.

* validation loss: train_lm.py's validation batches (the same `EVAL_BATCHES` batches of
  `seq_len + 1` tokens), each prefilled into an empty cache and scored from the logits
  (every query attends over the cache's dequantized keys and values); the relative gap to
  the bf16 cache's loss.
* greedy tokens: `--tokens` tokens decoded from a validation prompt of `--prompt` bytes,
  one per step; the share equal to the bf16 cache's tokens and the first difference (after
  which a free-running decode follows its own text); and the share of steps whose greedy
  token equals the bf16 cache's when every step is fed the bf16 cache's previous token
  (teacher-forced along the bf16 decode).

Weights: the checkpoint's in bf16 and, with `--nvfp4-weights`, also the weight-only NVFP4
export generate.py decodes. Prints the host, the date and a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import generate
import train_lm

import nvfp4_jax
from nvfp4_jax import kv_cache

KINDS = ("bf16", "nvfp4", "nvfp4_4over6")


def val_loss(model, batches, kind: str, scales) -> float:
    """Mean next-token cross-entropy of the batches, each prefilled into an empty cache."""
    cfg = model.cfg

    @jax.jit
    def loss(batch):
        inputs = batch[:, :-1]
        cache = generate.empty_cache(cfg, inputs.shape[0], inputs.shape[1], kind, scales)
        logits, _ = generate.forward_cached(model, cache, inputs, jnp.int32(0))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return float(np.mean([float(loss(b)) for b in batches]))


def calibrated_scales(model, batches) -> list:
    """Each layer's (k_scale, v_scale) from `quantize_for_export(..., kv_cache=True)`."""
    _, report = nvfp4_jax.quantize_for_export(model, batches, kv_cache=True)
    amax = report.kv_cache_amax
    return [
        tuple(kv_cache.scale_from_amax(a) for a in amax[f"layers/{i}/self_attn"])
        for i in range(model.cfg.depth)
    ]


def forced_agreement(model, kind: str, scales, prompt: np.ndarray, reference: np.ndarray):
    """Share of steps whose greedy token is `reference`'s, each step fed `reference`'s token.

    The decode of `reference` (the bf16 cache's greedy tokens) replayed through this cache:
    a disagreement does not carry over to the next steps as in a free-running decode.
    """
    decoder = generate.Decoder(model, 0.0, kind, scales)
    cfg = model.cfg
    p = prompt.shape[1]
    cache = generate.empty_cache(cfg, 1, p + len(reference), kind, scales)
    token, _, cache = decoder.prefill(decoder.state, cache, jnp.asarray(prompt), jax.random.key(0))
    picks = [int(token[0])]
    for i in range(1, len(reference)):
        forced = jnp.asarray(reference[i - 1 : i], jnp.int32)
        token, _, cache = decoder.step(
            decoder.state, cache, forced, jnp.int32(p + i - 1), jax.random.key(0)
        )
        picks.append(int(token[0]))
    return float(np.mean(np.asarray(picks) == reference))


def rows(model, val, scales, args) -> list[tuple]:
    """(cache, scales, loss, gap, agreement, first difference) for one model."""
    batches = [
        train_lm.batch_at(val, 10**9 + i, args.batch, args.seq_len, args.seed)
        for i in range(train_lm.EVAL_BATCHES)
    ]
    unit = [(1.0, 1.0)] * model.cfg.depth
    prompt = np.asarray(val[: args.prompt], np.int32)[None]
    out, reference = [], None
    for kind, label, s in [
        ("bf16", "-", None),
        ("nvfp4", "calibrated", scales),
        ("nvfp4_4over6", "calibrated", scales),
        ("nvfp4", "1.0", unit),
        ("nvfp4_4over6", "1.0", unit),
    ]:
        loss = val_loss(model, batches, kind, s)
        decoder = generate.Decoder(model, 0.0, kind, s)
        tokens = generate.generate(decoder, prompt, args.tokens)["tokens"][0]
        if reference is None:
            reference = (loss, tokens)
        same = tokens == reference[1]
        first = int(np.argmin(same)) if not same.all() else None
        forced = forced_agreement(model, kind, s, prompt, reference[1])
        out.append((kind, label, loss, loss / reference[0] - 1, same.mean(), first, forced))
        print(f"  {kind} ({label}): loss {loss:.5f}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=pathlib.Path, help="a train_lm.py --out folder")
    p.add_argument("--run", choices=("bf16", "nvfp4"), default="bf16")
    p.add_argument("--nvfp4-weights", action="store_true")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--prompt", type=int, default=64, help="prompt bytes for the greedy decode")
    p.add_argument("--calibration", type=int, default=8, help="calibration batches")
    p.add_argument("--batch", type=int, default=16, help="train_lm.py's --batch")
    p.add_argument("--seed", type=int, default=0, help="train_lm.py's --seed")
    args = p.parse_args(argv)
    print(generate.host_line())
    print(f"date {datetime.date.today()}")
    cfg, params, rules = generate.load_train_lm(args.checkpoint, args.run)
    args.seq_len = cfg.max_len  # train_lm.py's --seq-len
    text = train_lm.load_text(None)
    train, val = train_lm.split_text(text, args.seq_len)
    trees = {"bf16": params}
    if args.nvfp4_weights:
        trees["nvfp4 (W4A16)"] = generate.export_nvfp4(cfg, params, rules=rules)
    print(
        f"model: {args.checkpoint} ({args.run} run), width {cfg.width}, depth {cfg.depth}, "
        f"heads {cfg.heads}/{cfg.kv_heads} of {cfg.head_dim}; {train_lm.EVAL_BATCHES} "
        f"validation batches of {args.batch} x {args.seq_len + 1}; greedy {args.tokens} tokens "
        f"after {args.prompt} validation bytes"
    )
    print(
        "| weights | KV cache | decode scales | val loss | vs bf16 cache | greedy tokens equal "
        "| first difference | steps agreeing, fed bf16's tokens |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    calibration = [
        train_lm.batch_at(train, 10**8 + i, args.batch, args.seq_len, args.seed)[:, :-1]
        for i in range(args.calibration)
    ]
    # Calibrated on the float model, as a serving export's scales are.
    scales = calibrated_scales(generate.build_model(cfg, params), calibration)
    for weights, tree in trees.items():
        model = generate.build_model(cfg, tree)
        for kind, label, loss, gap, agree, first, forced in rows(model, val, scales, args):
            print(
                f"| {weights} | {kind} | {label} | {loss:.5f} | {100 * gap:+.3f}% | "
                f"{100 * agree:.1f}% | {'-' if first is None else first} | {100 * forced:.1f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
