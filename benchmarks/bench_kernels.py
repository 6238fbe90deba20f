"""Times the native kernels against the jitted jnp reference and prints a table.

    python benchmarks/bench_kernels.py              # bf16 (4096, 4096) on CPU, (8192, 8192) on GPU
    python benchmarks/bench_kernels.py --shape 1024x4096 --iters 50

Each row: median wall time of a jitted call (after warm-up, `block_until_ready`) on random
non-zero heavy-tailed bf16 data (normal times a lognormal per row, plus outliers), effective
bandwidth (bytes read + written, the amax pass included), and the reference's time over the
kernel's, measured in the same run. On a GPU the table also shows a device copy's bandwidth,
measured in the same run, and each kernel's fraction of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import nvfp4_jax
from nvfp4_jax import kernels


def heavy_tailed(shape, key) -> jax.Array:
    """Random non-zero bf16 data: normal times a lognormal per row, plus outliers."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, shape, jnp.float32)
    x = x * jnp.exp(1.5 * jax.random.normal(k2, (shape[0], 1), jnp.float32))
    outliers = jax.random.bernoulli(k3, 1e-3, shape)
    x = jnp.where(outliers, x * 100.0, x)
    x = jnp.where(x == 0, 1e-3, x)  # never time zeros
    return x.astype(jnp.bfloat16)


def median_seconds(fn, *args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cases(x, key):
    """(name, function of impl -> jitted fn, args, bytes moved) for each benchmarked op."""
    n = x.size
    read, codes_scales = 2 * n, n // 2 + n // 16
    quant_bytes = 2 * read + codes_scales  # amax pass + quantize pass
    q = nvfp4_jax.quantize(x, implementation="reference")

    def quantize(**kw):
        return lambda impl: jax.jit(
            lambda x, k: nvfp4_jax.quantize(x, key=k, implementation=impl, **kw).codes
        )

    return [
        ("quantize RN", quantize(), (x, key), quant_bytes),
        ("quantize SR", quantize(stochastic_rounding=True), (x, key), quant_bytes),
        ("RHT + quantize", quantize(rht=True), (x, key), quant_bytes),
        (
            "dequantize",
            lambda impl: jax.jit(
                lambda q: nvfp4_jax.dequantize(q, jnp.bfloat16, implementation=impl)
            ),
            (q,),
            codes_scales + 2 * n,
        ),
        (
            "fake quant RN",
            lambda impl: jax.jit(lambda x: nvfp4_jax.fake_quantize(x, implementation=impl)),
            (x,),
            2 * read + 2 * n,
        ),
    ]


def copy_bandwidth(x, warmup, iters) -> float:
    """GB/s of a device copy (read + write) of x, the GPU's practical bandwidth."""
    copy = jax.jit(lambda x: -x)
    return 2 * x.nbytes / median_seconds(copy, x, warmup=warmup, iters=iters) / 1e9


def main() -> None:
    platform = kernels.current_platform()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x8192" if platform == "cuda" else "4096x4096")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))
    if not kernels.is_available(platform):
        raise SystemExit(f"no native kernels on {platform}: {kernels.unavailable_reason(platform)}")

    key = jax.random.key(0)
    x = heavy_tailed(shape, key)
    copy_gbs = copy_bandwidth(x, args.warmup, args.iters) if platform != "cpu" else None
    print(f"# {platform} ({jax.devices()[0].device_kind}), bf16 {shape}, median of {args.iters}")
    if copy_gbs:
        print(f"# device copy: {copy_gbs:.0f} GB/s")
    header = f"| {'op':<15} | {'impl':<9} | {'ms':>8} | {'GB/s':>7} | {'ref/ffi':>7} |"
    header += " % of copy |" if copy_gbs else ""
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, make, fn_args, nbytes in cases(x, key):
        times = {
            impl: median_seconds(make(impl), *fn_args, warmup=args.warmup, iters=args.iters)
            for impl in ("ffi", "reference")
        }
        for impl, seconds in times.items():
            gbs = nbytes / seconds / 1e9
            ratio = times["reference"] / seconds
            row = f"| {name:<15} | {impl:<9} | {seconds * 1e3:8.2f} | {gbs:7.1f} | {ratio:7.2f} |"
            row += f" {100 * gbs / copy_gbs:8.0f}% |" if copy_gbs else ""
            print(row)


if __name__ == "__main__":
    main()
