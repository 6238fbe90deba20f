"""The NVFP4 KV cache's goals on the CPU: its bytes, its attention, the whole decode step.

    python benchmarks/bench_kv_cache.py                        # 4k context, width 1024, depth 8
    python benchmarks/bench_kv_cache.py --context 512 --steps 5 --width 256 --depth 2  # quick

The model is examples/generate.py's random one (`--width 1024 --depth 8`: 4 heads of 256,
2 key/value heads) with NVFP4 weights (what `export_hf_checkpoint(quant_algo="W4A16_NVFP4")`
writes, run weight-only by the native W4A16 kernel). A prompt of `--context` random tokens
is prefilled into each cache (bf16, nvfp4, nvfp4_4over6), then:

* attention over the cache alone: one layer's jitted attention for one new token (the
  token written into the cache, then attention over it), the cache donated: for bf16
  `dynamic_update_slice` + `jax.nn.dot_product_attention` (generate.py's), for NVFP4
  `kv_cache.append` + `kv_cache.attention` (the native kernel);
* the whole decode step: generate.py's jitted step (weights, cache, token, position).

Each is the median of `--rounds` rounds, the caches timed in turn within a round (ratios in
one process). Printed: the host (ISA, load), the bytes against bf16's (at head size 128 and
the model's), the times and the ratios against the goals (bytes <= 0.29x bf16, attention
>= 2.5x faster, step >= 1.4x faster).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import generate
from lm_model import LMConfig, TransformerLM

from nvfp4_jax import kv_cache

KINDS = ("bf16", "nvfp4", "nvfp4_4over6")


def bytes_line(head_dim: int, kv_heads: int, context: int) -> str:
    config = kv_cache.KVCacheConfig(kv_heads=kv_heads, head_dim=head_dim)
    nvfp4 = config.cache_bytes(context)
    bf16 = 2 * context * kv_heads * head_dim * 2
    return (
        f"head size {head_dim}: {config.full_dim} B per token, head and side against bf16's "
        f"{2 * head_dim}: {nvfp4 / bf16:.4f}x bf16 ({nvfp4 / 2**20:.2f} MiB per layer and "
        f"sequence at {context} tokens; the f32 scales add 8 B per layer)"
    )


def _attention_fn(kind: str):
    """One layer's attention for one new token, over (and into) that layer's cache."""

    def bf16(q, k, v, layer, pos):
        k_all = jax.lax.dynamic_update_slice(layer["k"], k.astype(jnp.bfloat16), (0, pos, 0, 0))
        v_all = jax.lax.dynamic_update_slice(layer["v"], v.astype(jnp.bfloat16), (0, pos, 0, 0))
        length = k_all.shape[1]
        mask = (jnp.arange(length)[None, :] <= pos)[None, None]
        out = jax.nn.dot_product_attention(q, k_all, v_all, mask=mask)
        return out, {"k": k_all, "v": v_all}

    def nvfp4(q, k, v, layer, pos):
        layer = kv_cache.append(layer, k, v, pos)
        return kv_cache.attention(q, layer, pos + 1), layer

    return jax.jit(bf16 if kind == "bf16" else nvfp4, donate_argnums=3)


def _layer(cache, i: int):
    return cache[i]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    print(generate.host_line(), flush=True)
    print(f"date {datetime.date.today()}, {datetime.datetime.now():%H:%M}", flush=True)
    cfg = LMConfig(
        **{k: v for k, v in dict(width=args.width, depth=args.depth, heads=args.heads).items() if v}
    )
    print(
        f"model: width {cfg.width}, depth {cfg.depth}, heads {cfg.heads}/{cfg.kv_heads} of "
        f"{cfg.head_dim}, NVFP4 weights (W4A16); context {args.context}",
        flush=True,
    )
    print("bytes: " + bytes_line(128, cfg.kv_heads, args.context), flush=True)
    print("bytes: " + bytes_line(cfg.head_dim, cfg.kv_heads, args.context), flush=True)

    model = TransformerLM(cfg, nnx.Rngs(params=args.seed))
    params = generate._params_only(generate._plain(nnx.to_pure_dict(nnx.state(model))))
    weights = generate.build_model(cfg, generate.export_nvfp4(cfg, params))
    prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab, (1, args.context), np.int32)
    length = args.context + args.rounds * args.steps + 1
    decoders, caches = {}, {}
    for kind in KINDS:
        decoders[kind] = generate.Decoder(weights, kv_cache=kind)
        cache = generate.empty_cache(cfg, 1, length, kind)
        begin = time.perf_counter()
        token, _, caches[kind] = decoders[kind].prefill(
            decoders[kind].state, cache, jnp.asarray(prompt), jax.random.key(0)
        )
        jax.block_until_ready(token)
        print(
            f"[{kind}] prefill of {args.context} tokens: {time.perf_counter() - begin:.1f} s",
            flush=True,
        )

    # Attention alone: layer 0's cache, one new token per call at increasing positions.
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 1, cfg.heads, cfg.head_dim)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, 1, cfg.kv_heads, cfg.head_dim)), jnp.bfloat16)
    fns = {kind: _attention_fn(kind) for kind in KINDS}
    layers = {kind: _layer(caches[kind], 0) for kind in KINDS}
    layers = {kind: jax.tree.map(jnp.copy, layer) for kind, layer in layers.items()}
    attention = {kind: [] for kind in KINDS}
    step = {kind: [] for kind in KINDS}
    tokens = {kind: jnp.zeros((1,), jnp.int32) for kind in KINDS}
    pos = args.context
    for kind in KINDS:  # compile
        out, layers[kind] = fns[kind](q, kv, kv, layers[kind], jnp.int32(pos))
        jax.block_until_ready(out)
        tokens[kind], _, caches[kind] = decoders[kind].step(
            decoders[kind].state, caches[kind], tokens[kind], jnp.int32(pos), jax.random.key(0)
        )
        jax.block_until_ready(tokens[kind])
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        pos = args.context + 1 + r * args.steps
        for kind in KINDS:
            for s in range(args.steps):
                begin = time.perf_counter()
                out, layers[kind] = fns[kind](q, kv, kv, layers[kind], jnp.int32(pos + s))
                jax.block_until_ready(out)
                attention[kind].append(time.perf_counter() - begin)
            for s in range(args.steps):
                begin = time.perf_counter()
                tokens[kind], _, caches[kind] = decoders[kind].step(
                    decoders[kind].state,
                    caches[kind],
                    tokens[kind],
                    jnp.int32(pos + s),
                    jax.random.key(0),
                )
                jax.block_until_ready(tokens[kind])
                step[kind].append(time.perf_counter() - begin)
        loads.append(os.getloadavg()[0])
    print(f"load average (1 min) during the rounds: {min(loads):.2f} - {max(loads):.2f}")
    base_attention, base_step = np.median(attention["bf16"]), np.median(step["bf16"])
    print("| cache | attention, one layer (ms) | x bf16's | decode step (ms) | x bf16's |")
    print("| --- | --- | --- | --- | --- |")
    for kind in KINDS:
        a, s = np.median(attention[kind]), np.median(step[kind])
        print(
            f"| {kind} | {1e3 * a:.3f} | {base_attention / a:.2f}x faster | {1e3 * s:.2f} | "
            f"{base_step / s:.2f}x faster |"
        )
    a, s = base_attention / np.median(attention["nvfp4"]), base_step / np.median(step["nvfp4"])
    print(
        f"goals (nvfp4): attention >= 2.5x: {a:.2f}x {'met' if a >= 2.5 else 'NOT met'}; "
        f"step >= 1.4x: {s:.2f}x {'met' if s >= 1.4 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
