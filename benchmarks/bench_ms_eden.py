"""The MS-EDEN backward's train step against the SR backward's, on the native CPU kernels.

    python benchmarks/bench_ms_eden.py                      # the example's plain NVFP4 layers
    python benchmarks/bench_ms_eden.py --steps 100 -- --width 256 --depth 8
    python benchmarks/bench_ms_eden.py --out benchmarks/results/cpu_ms_eden_avx2_DATE.txt

Builds the example's NVFP4 model twice, as `examples/train_lm.py` does, with
`--backward nvidia` (NVIDIA's recipe: dy stochastically rounded, the wgrad operands rotated
by the 16-point RHT) and with `--backward ms_eden` (Quartet II: dy and the forward's W and x
re-quantized with MS-EDEN), everything else equal; the flags after `--` go to both (default
`--four-over-six none`: Four Over Six on dy exists only in the NVIDIA backward, so it would
time a different forward). Prints each step's compile time and XLA's memory estimate of the
step (`memory_analysis`: arguments, outputs, temporaries), then times the steps interleaved,
one of each per round on the same batch so that both see the same load, and prints the
medians and their ratio (the goal: at most 1.1). Then the two quantizers alone, each
jitted on a dy-sized bf16 tensor: the NVIDIA backward's dgrad dy (1x16 SR) against MS-EDEN
(rotation, amax, quantize).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import jax
import jax.numpy as jnp
import train_lm
from roofline import ISA_CHOICES, ISA_HELP, force_kernel_isa, header_lines

import nvfp4_jax

BACKWARDS = ("nvidia", "ms_eden")
DEFAULT_EXAMPLE_FLAGS = ["--four-over-six", "none"]


def build(example_flags: list[str], backward: str):
    """The NVFP4 model's `train_lm.CompiledRun` with `--backward backward`."""
    args = train_lm.parse_args([*example_flags, "--backward", backward])
    model = train_lm.make_model(args, "nvfp4", train_lm.model_rules(args))
    optimizer = train_lm.make_optimizer(model, args)
    finish = False if train_lm.finish_at_run_time("nvfp4", args) else None
    return args, train_lm.CompiledRun(model, optimizer, finish=finish)


def memory_mib(compiled) -> float:
    """XLA's estimate of one step's memory: arguments, outputs and temporaries (MiB)."""
    stats = compiled.memory_analysis()
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return total / 2**20


def time_steps(runs: dict, batch, steps: int) -> dict[str, float]:
    seconds = {name: [] for name in runs}
    for i in range(steps):
        for name, run in runs.items():
            start = time.perf_counter()
            float(run.step(batch(i + 1))[0])
            seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(s) for name, s in seconds.items()}


def quantizer_ms(shape, iters: int) -> dict[str, float]:
    """Median ms of one dy-sized quantization per backward (the native kernels)."""
    dy = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    key, rotation = jax.random.key(1), jax.random.key(2)
    ops = {
        "nvidia": jax.jit(lambda x, k: nvfp4_jax.quantize(x, stochastic_rounding=True, key=k)),
        "ms_eden": jax.jit(
            lambda x, k: nvfp4_jax.quantize(x, ms_eden=True, key=k, rotation_key=rotation)
        ),
    }
    result = {}
    for name, op in ops.items():
        jax.block_until_ready(op(dy, key))
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(op(dy, key))
            times.append(time.perf_counter() - start)
        result[name] = 1e3 * statistics.median(times)
    return result


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per backward")
    parser.add_argument("--isa", choices=ISA_CHOICES, help=ISA_HELP)
    parser.add_argument("--out", type=pathlib.Path, help="also write the lines here")
    parser.add_argument("example_flags", nargs="*", help="flags of examples/train_lm.py, after --")
    args = parser.parse_args(argv)
    force_kernel_isa(parser, args.isa)
    flags = args.example_flags or DEFAULT_EXAMPLE_FLAGS
    lines = header_lines(sys.argv[1:] if argv is None else argv, "benchmarks/bench_ms_eden.py")
    lines.append(f"# example flags: {' '.join(flags)}")
    built = {b: build(flags, b) for b in BACKWARDS}
    example = built["nvidia"][0]
    train, _ = train_lm.split_text(train_lm.load_text(example.data), example.seq_len)

    def batch(step: int):
        return train_lm.batch_at(train, step, example.batch, example.seq_len, example.seed)

    runs = {b: run for b, (_, run) in built.items()}
    for name, run in runs.items():
        start = time.perf_counter()
        compiled = run.lower(batch(0)).compile()
        seconds = time.perf_counter() - start
        float(run.step(batch(0))[0])
        lines.append(
            f"{name:>8s}: compile {seconds:.1f} s, step memory {memory_mib(compiled):.1f} MiB"
        )
    median = time_steps(runs, batch, args.steps)
    for name in BACKWARDS:
        lines.append(f"{name:>8s}: median step {median[name]:.1f} ms over {args.steps} steps")
    lines.append(f"MS-EDEN / SR step: {median['ms_eden'] / median['nvidia']:.3f}x (goal <= 1.1)")
    tokens = example.batch * example.seq_len
    shape = (tokens, example.width)
    quant = quantizer_ms(shape, iters=max(args.steps, 20))
    for name in BACKWARDS:
        lines.append(f"{name:>8s}: quantize dy {shape} bf16 {quant[name]:.3f} ms")
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
