"""The CUDA kernels against the GPU's copy bandwidth, the jitted reference, and a bf16 layer.

    python benchmarks/bench_gpu.py                                  # bf16 8192x8192, 8192^3
    python benchmarks/bench_gpu.py --out benchmarks/results/gpu_DEVICE_DATE_bench.txt
    python benchmarks/bench_gpu.py --allow-cpu --size 256 --iters 2  # smoke test, no GPU

Kernels: quantize RN / SR / RHT / MS-EDEN (1x16 blocks, the amax computed by the op; MS-EDEN
where the last axis is a multiple of 128, its rotation groups) and dequantize to
bf16 of a heavy-tailed bf16 tensor (bench_kernels.heavy_tailed), each a jitted call of the
public op with implementation="ffi", timed as the median of --iters calls after --warmup,
each ended by `block_until_ready` (bench_kernels.median_seconds). GB/s counts the minimum
bytes (as roofline.py does): quantize reads x once and writes the codes and scales, 2.56
B/element (its amax pass reads x a second time: 4.56 B moved, so at a copy's bandwidth it
shows as 56%); dequantize reads the codes and scales and writes the values. "% copy" is that
bandwidth as a share of a device-to-device copy of x (read + write) measured in the same
process: the faster of XLA's copy (`jnp.copy`) and an elementwise `-x`, whichever the GPU
runs at higher bandwidth. "ref/ffi" is the time of the XLA-compiled pure-jnp reference
(implementation="reference") over the kernel's.

Dense: `jit(value_and_grad)` of `sum(dot(x, W) * g)` at M,K,N (default 8192^3), bf16
`jax.lax.dot_general` (f32 accumulation) against `nvfp4_jax.dot_general` with the default
recipe per implementation (bench_dense.variants); "vs bf16" is each time over bf16's.

Prints a table; --out also writes it, and --json (default: --out with .json) the numbers.
With no CUDA GPU it exits with code 2, unless --allow-cpu with sizes of at most
CPU_MAX_SIZE (a smoke test of this script on the CPU kernels).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from bench_dense import variants  # this folder is on sys.path when run as a script
from bench_kernels import heavy_tailed, median_seconds
from roofline import header_lines

import nvfp4_jax
from nvfp4_jax import kernels

CPU_MAX_SIZE = 1024
NO_GPU_EXIT = 2


def parse_size(text: str) -> tuple[int, int]:
    """Parses N (an N x N tensor) or RxC; both multiples of 16."""
    parts = [int(v) for v in text.lower().split("x")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) <= 0 or any(p % 16 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or RxC, multiples of 16")
    return parts[0], parts[1]


def parse_dense(text: str) -> tuple[int, int, int]:
    """Parses N (M = K = N) or M,K,N; all multiples of 16."""
    parts = [int(v) for v in text.split(",")]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or min(parts) <= 0 or any(p % 16 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or M,K,N, multiples of 16")
    return parts[0], parts[1], parts[2]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=(8192, 8192), help="N or RxC")
    parser.add_argument(
        "--dense-size", type=parse_dense, help="N or M,K,N (default: 8192^3, or --size's N)"
    )
    parser.add_argument("--no-dense", action="store_true", help="skip the dense layer")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per contestant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, help="also write the table here")
    parser.add_argument("--json", type=pathlib.Path, help="the numbers (default: --out .json)")
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help=f"run on the CPU kernels when there is no GPU (sizes <= {CPU_MAX_SIZE})",
    )
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.dense_size is None:
        args.dense_size = (8192,) * 3 if args.size == (8192, 8192) else (args.size[1],) * 3
    return args


def check_platform(args) -> str:
    """The platform to run on, or exits: 2 without a GPU (unless --allow-cpu), 1 when the
    GPU is there but the CUDA kernels cannot run on it."""
    platform = kernels.current_platform()
    if platform != "cuda":
        if not args.allow_cpu:
            print(
                f"bench_gpu: no CUDA GPU (JAX's default backend is {platform!r}); nothing to "
                "benchmark. --allow-cpu with a small --size runs it on the CPU as a smoke test.",
                file=sys.stderr,
            )
            raise SystemExit(NO_GPU_EXIT)
        if max(*args.size, *args.dense_size) > CPU_MAX_SIZE:
            print(
                f"bench_gpu: --allow-cpu is a smoke test: --size and --dense-size must be at "
                f"most {CPU_MAX_SIZE}",
                file=sys.stderr,
            )
            raise SystemExit(NO_GPU_EXIT)
    if not kernels.is_available(platform):
        print(
            f"bench_gpu: the native kernels cannot run on {platform}: "
            f"{kernels.unavailable_reason(platform)}",
            file=sys.stderr,
        )
        raise SystemExit(1)
    return platform


def copy_seconds(x, *, warmup, iters) -> dict[str, float]:
    """Median seconds of the device copies of x (read + write)."""
    return {
        "jnp.copy": median_seconds(jax.jit(jnp.copy), x, warmup=warmup, iters=iters),
        "-x": median_seconds(jax.jit(jnp.negative), x, warmup=warmup, iters=iters),
    }


def kernel_cases(x, key):
    """(name, jitted fn of implementation, args, minimum bytes) of each timed op."""
    n = x.size
    codes_scales = n // 2 + n // 16

    def quantize(**flags):
        def make(impl):
            def fn(x, k):
                if flags.get("ms_eden"):
                    flags["rotation_key"] = jax.random.fold_in(k, 1)
                q = nvfp4_jax.quantize(x, key=k, implementation=impl, **flags)
                return q.codes, q.scales, q.amax

            return jax.jit(fn)

        return make

    def dequantize(impl):
        return jax.jit(lambda q: nvfp4_jax.dequantize(q, jnp.bfloat16, implementation=impl))

    q = jax.block_until_ready(nvfp4_jax.quantize(x, implementation="ffi"))
    quant_bytes = x.nbytes + codes_scales
    cases = [
        ("quantize RN", quantize(), (x, key), quant_bytes),
        ("quantize SR", quantize(stochastic_rounding=True), (x, key), quant_bytes),
        ("quantize RHT", quantize(rht=True), (x, key), quant_bytes),
    ]
    if x.shape[-1] % nvfp4_jax.MS_EDEN_GROUP == 0:
        cases.append(("quantize MS-EDEN", quantize(ms_eden=True), (x, key), quant_bytes))
    return [*cases, ("dequantize bf16", dequantize, (q,), codes_scales + 2 * n)]


def bench_kernels(x, key, copy_gbs, *, warmup, iters) -> list[dict]:
    rows = []
    for name, make, args, nbytes in kernel_cases(x, key):
        ffi = median_seconds(make("ffi"), *args, warmup=warmup, iters=iters)
        ref = median_seconds(make("reference"), *args, warmup=warmup, iters=iters)
        gbs = nbytes / ffi / 1e9
        rows.append(
            {
                "op": name,
                "bytes": nbytes,
                "ms": ffi * 1e3,
                "GBps": gbs,
                "share_of_copy": gbs / copy_gbs,
                "reference_ms": ref * 1e3,
                "reference_over_ffi": ref / ffi,
            }
        )
    return rows


def bench_dense(shape, *, warmup, iters) -> list[dict]:
    m, k, n = shape
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * (k**-0.5)
    g = jax.random.normal(keys[2], (m, n), jnp.float32)
    flops = 3 * 2 * m * k * n
    rows = []
    for name, dot in variants().items():

        def loss(x, w, g, dot=dot):
            return jnp.sum(dot(x, w).astype(jnp.float32) * g)

        # g is an argument: closed over, XLA would constant-fold dy's quantization.
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        seconds = median_seconds(step, x, w, g, warmup=warmup, iters=iters)
        rows.append({"variant": name, "ms": seconds * 1e3, "TFLOPs": flops / seconds / 1e12})
    for row in rows:
        row["vs_bf16"] = row["ms"] / rows[0]["ms"]
    return rows


def table(result: dict) -> list[str]:
    """The result as Markdown tables, after comment lines saying what was measured."""
    copy = result["copy"]
    r, c = result["size"]
    lines = [
        f"# device: {result['device']} ({result['platform']}), bf16 {r}x{c}, "
        f"median of {result['iters']} after {result['warmup']} warm-ups",
        "# copy (read + write of x): "
        + ", ".join(f"{name} {ms:.3f} ms" for name, ms in copy["ms"].items())
        + f"; 100% = {copy['GBps']:.1f} GB/s",
        "",
        "| op              |       ms |    GB/s | % copy |   ref ms | ref/ffi |",
        "|-----------------|----------|---------|--------|----------|---------|",
    ]
    for row in result["kernels"]:
        lines.append(
            f"| {row['op']:<15} | {row['ms']:8.3f} | {row['GBps']:7.1f} | "
            f"{100 * row['share_of_copy']:5.0f}% | {row['reference_ms']:8.3f} | "
            f"{row['reference_over_ffi']:6.2f}x |"
        )
    if result.get("dense"):
        m, k, n = result["dense_size"]
        lines += [
            "",
            f"# dense layer forward + backward (value_and_grad), M,K,N = {m},{k},{n}",
            "| variant          |  fwd+bwd ms | TFLOP/s | vs bf16 |",
            "|------------------|-------------|---------|---------|",
        ]
        for row in result["dense"]:
            lines.append(
                f"| {row['variant']:<16} | {row['ms']:11.2f} | {row['TFLOPs']:7.2f} | "
                f"{row['vs_bf16']:6.2f}x |"
            )
    return lines


def write(lines, result, args) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    json_path = args.json or (args.out.with_suffix(".json") if args.out else None)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    platform = check_platform(args)
    device = jax.devices()[0].device_kind
    key = jax.random.key(0)
    x = jax.block_until_ready(heavy_tailed(args.size, key))
    timing = dict(warmup=args.warmup, iters=args.iters)
    copies = copy_seconds(x, **timing)
    copy_gbs = 2 * x.nbytes / min(copies.values()) / 1e9
    result = {
        "device": device,
        "platform": platform,
        "command": "python benchmarks/bench_gpu.py " + " ".join(argv),
        "size": list(args.size),
        "dtype": "bfloat16",
        "iters": args.iters,
        "warmup": args.warmup,
        "copy": {"ms": {k: v * 1e3 for k, v in copies.items()}, "GBps": copy_gbs},
        "kernels": bench_kernels(x, key, copy_gbs, **timing),
        "dense_size": list(args.dense_size),
        "dense": None if args.no_dense else bench_dense(args.dense_size, **timing),
    }
    lines = [*header_lines(argv, script="benchmarks/bench_gpu.py"), *table(result)]
    print("\n".join(lines), flush=True)
    write(lines, result, args)


if __name__ == "__main__":
    main()
