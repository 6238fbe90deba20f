"""One dense layer's forward + backward in NVFP4 vs bf16, and a train step's compiled memory.

    python benchmarks/bench_dense.py                      # timing table
    python benchmarks/bench_dense.py --shape 4096,4096,4096 --iters 10
    python benchmarks/bench_dense.py --memory             # memory_analysis() of a train step

Timing: `jit(value_and_grad)` of `sum(dot(x, W) * g)` with x (M, K), W (K, N) in bf16 and a
fixed random g: the bf16 baseline is `jax.lax.dot_general` (f32 accumulation, bf16 result),
NVFP4 is `nvfp4_jax.dot_general` with the default recipe (fprop + dgrad + wgrad, RHT, SR)
for each available implementation. Median of `--iters` timed runs after two warm-ups, each
ended by `block_until_ready`; all variants are measured in the same run. Default shapes:
(2048, 2048, 2048) on CPU, (8192, 8192, 8192) on GPU.

Memory: a transformer-style MLP stack (L residual blocks of d -> 4d -> d with a rematerialized
gelu) trained
with SGD, compiled (not run) for bf16 and for NVFP4 layers; prints the temp, argument and
output bytes of `compile().memory_analysis()` and the NVFP4 / bf16 ratios. The temp bytes
hold the activations saved for the backward: NVFP4 saves packed codes and scales.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from bench_kernels import median_seconds  # this folder is on sys.path when run as a script

from nvfp4_jax import NVFP4Recipe, dot_general, kernels

DENSE = (((1,), (0,)), ((), ()))


def variants():
    """name -> dot_general-like function of (x, w); bf16 first (the baseline)."""
    out = {
        "bf16": lambda x, w: jax.lax.dot_general(
            x, w, DENSE, preferred_element_type=jnp.float32
        ).astype(x.dtype)
    }
    implementations = ["reference"]
    if kernels.is_available():
        implementations.append("ffi")
    key = jax.random.key(0)
    for implementation in implementations:
        recipe = NVFP4Recipe(implementation=implementation)
        out[f"nvfp4 {implementation}"] = lambda x, w, recipe=recipe: dot_general(
            x, w, DENSE, recipe=recipe, key=key
        )
    return out


def bench_timing(shapes, iters):
    print(
        f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"median of {iters} runs after 2 warm-ups"
    )
    header = f"{'M,K,N':>16} | {'variant':<16} | {'fwd+bwd ms':>11} | {'TFLOP/s':>8} | vs bf16"
    print(header)
    print("-" * len(header))
    for m, k, n in shapes:
        keys = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * (k**-0.5)
        g = jax.random.normal(keys[2], (m, n), jnp.float32)
        flops = 3 * 2 * m * k * n
        baseline = None
        for name, dot in variants().items():

            def loss(x, w, g, dot=dot):
                return jnp.sum(dot(x, w).astype(jnp.float32) * g)

            # g is an argument: closed over, XLA would constant-fold dy's quantization.
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            seconds = median_seconds(step, x, w, g, warmup=2, iters=iters)
            baseline = baseline or seconds
            print(
                f"{f'{m},{k},{n}':>16} | {name:<16} | {seconds * 1e3:11.2f} | "
                f"{flops / seconds / 1e12:8.3f} | {seconds / baseline:6.2f}x",
                flush=True,
            )


class Stack:
    """L residual MLP blocks x + W2 gelu(W1 x), on (T, d) tokens.

    gelu is rematerialized (`jax.checkpoint`), as memory-minded training does, so that it
    keeps only its bf16 input and the saved activations are those of the dense layers.
    """

    def __init__(self, layers, d, dot):
        self.layers, self.d, self.dot = layers, d, dot

    def params(self):
        keys = jax.random.split(jax.random.key(0), 2 * self.layers)
        shape = [(self.d, 4 * self.d), (4 * self.d, self.d)] * self.layers
        return [
            jax.random.normal(k, s, jnp.bfloat16) * s[0] ** -0.5
            for k, s in zip(keys, shape, strict=True)
        ]

    def loss(self, params, x, y):
        for w1, w2 in zip(params[::2], params[1::2], strict=True):
            x = x + self.dot(jax.checkpoint(jax.nn.gelu)(self.dot(x, w1)), w2)
        return jnp.mean((x.astype(jnp.float32) - y) ** 2)

    def train_step(self, params, x, y):
        loss, grads = jax.value_and_grad(self.loss)(params, x, y)
        return loss, [p - 1e-3 * g.astype(p.dtype) for p, g in zip(params, grads, strict=True)]


def bench_memory(layers, tokens, d):
    print(
        f"train step of {layers} residual MLP blocks, d={d} (hidden {4 * d}), {tokens} tokens, "
        f"bf16 params; compile().memory_analysis() on {jax.default_backend()}"
    )
    x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
    rows = {}
    for name, dot in variants().items():
        stack = Stack(layers, d, dot)
        params = jax.eval_shape(stack.params)
        compiled = jax.jit(stack.train_step).lower(params, x, y).compile()
        stats = compiled.memory_analysis()
        rows[name] = (
            stats.temp_size_in_bytes,
            stats.argument_size_in_bytes,
            stats.output_size_in_bytes,
            residual_bytes(stack.loss, params, x, y),
        )
    header = (
        f"{'variant':<16} | {'temp MiB':>9} | {'argument MiB':>12} | {'output MiB':>10} | "
        f"{'saved residuals MiB':>19}"
    )
    print(header)
    print("-" * len(header))
    mib = 2.0**20
    for name, (temp, arg, out, saved) in rows.items():
        print(
            f"{name:<16} | {temp / mib:9.1f} | {arg / mib:12.1f} | {out / mib:10.1f} | "
            f"{saved / mib:19.1f}"
        )
    base = rows["bf16"]
    for name, row in rows.items():
        if name != "bf16":
            print(
                f"{name} / bf16: temp {row[0] / base[0]:.3f}, argument {row[1] / base[1]:.3f}, "
                f"output {row[2] / base[2]:.3f}, saved residuals {row[3] / base[3]:.3f}"
            )


def residual_bytes(loss, params, x, y):
    """Bytes of what the backward pass keeps from the forward (the leaves of jax.vjp's closure),
    without the inputs themselves (params, x, y), which the caller holds anyway."""
    pullback = jax.eval_shape(lambda p, a, b: jax.vjp(loss, p, a, b)[1], params, x, y)
    inputs = {(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves((params, x, y))}
    return sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(pullback)
        if hasattr(leaf, "dtype")
        and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        and (leaf.shape, leaf.dtype) not in inputs
    )


def parse_shape(text):
    m, k, n = (int(v) for v in text.split(","))
    return m, k, n


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", type=parse_shape, action="append", help="M,K,N (repeatable); default by backend"
    )
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="compiled train-step memory")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d", type=int, default=1024)
    args = parser.parse_args()
    if args.memory:
        bench_memory(args.layers, args.tokens, args.d)
        return
    default = (8192, 8192, 8192) if jax.default_backend() == "gpu" else (2048, 2048, 2048)
    bench_timing(args.shape or [default], args.iters)


if __name__ == "__main__":
    main()
