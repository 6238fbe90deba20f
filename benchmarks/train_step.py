"""The example's train step, NVFP4 against bf16: program size, compile time, step time.

    python benchmarks/train_step.py                   # the example's defaults, 60 steps each
    python benchmarks/train_step.py --steps 100 -- --width 256 --depth 8
    python benchmarks/train_step.py --reuse-memory    # glibc keeps large blocks (see roofline.py)
    python benchmarks/train_step.py --jax-threefry    # the SR keys hashed by XLA, not natively

Builds both models as `examples/train_lm.py` does (the same flags after `--`), lowers and
compiles each train step (StableHLO op count, trace + lower seconds, compile seconds), then
times the steps interleaved, one NVFP4 step and one bf16 step per round on the same batch, so
that both see the same load. Prints the medians and their ratio.

Each step is the one the example runs (`train_lm.CompiledRun`): the NVFP4 run's program holds
its high-precision finish as a runtime flag (`nvfp4_jax.high_precision_forward`, with the
default `--high-precision-final-gemms fprop`), timed in its NVFP4 phase, every GEMM of the
NVFP4 layers in NVFP4. The example's
defaults keep the first block, the last block and the head in bf16; `-- --bf16-first 0` puts
every block but the last in NVFP4. The line `# nvfp4 layers:` says which layers are which.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import train_lm
from flax import nnx
from roofline import (
    ISA_CHOICES,
    ISA_HELP,
    REUSE_MEMORY,
    force_kernel_isa,
    header_lines,
    restart_reusing_memory,
)

import nvfp4_jax

RECIPES = ("nvfp4", "bf16")


def build(args, recipe: str):
    """The model and the `train_lm.CompiledRun` of one recipe, as the example builds them."""
    rules = train_lm.model_rules(args) if recipe == "nvfp4" else None
    model = train_lm.make_model(args, recipe, rules)
    optimizer = train_lm.make_optimizer(model, args)
    finish = False if train_lm.finish_at_run_time(recipe, args) else None
    return model, train_lm.CompiledRun(model, optimizer, finish=finish)


def _grouped(paths: list[str]) -> str:
    """Paths grouped by block: "layers/1/* (7)" for a block's linears, other paths as they are."""
    groups = collections.Counter(
        f"{m.group(1)}/*" if (m := re.match(r"(layers/\d+)/", p)) else p for p in paths
    )
    return ", ".join(f"{g} ({n})" if g.endswith("*") else g for g, n in groups.items())


def layer_summary(model) -> str:
    """Which linear layers of the NVFP4 model compute in NVFP4 (and which GEMMs), and which not."""
    nvfp4, high = collections.defaultdict(list), []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear):
            name = "/".join(map(str, path))
            recipe = nvfp4_jax.rules.layer_recipe(node)
            gemms = [g for g in ("fprop", "dgrad", "wgrad") if recipe and getattr(recipe, g)]
            (nvfp4["+".join(gemms)] if gemms else high).append(name)
    total = sum(map(len, nvfp4.values())) + len(high)
    parts = [f"{len(v)} of {total} in NVFP4 ({k}): {_grouped(sorted(v))}" for k, v in nvfp4.items()]
    return "# nvfp4 layers: " + "; ".join([*parts, f"bf16: {_grouped(sorted(high)) or 'none'}"])


def program_stats(run, batch) -> tuple[int, float, float]:
    """StableHLO op count, trace + lower seconds and compile seconds of one train step."""
    start = time.perf_counter()
    lowered = run.lower(batch)
    text = lowered.as_text()
    traced = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter()
    ops = collections.Counter(re.findall(r"= \"?([a-z_]+\.[a-z_]+)", text))
    return sum(ops.values()), traced - start, compiled - traced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per recipe")
    parser.add_argument(
        "--reuse-memory", action="store_true", help=f"GLIBC_TUNABLES={REUSE_MEMORY}"
    )
    parser.add_argument("--isa", choices=ISA_CHOICES, help=ISA_HELP)
    parser.add_argument(
        "--jax-threefry",
        action="store_true",
        help="hash the SR keys with JAX's threefry2x32 (as before the native hash, 2383121) "
        "instead of the native custom call: the same keys, XLA's rolled loops compiled",
    )
    parser.add_argument("example_flags", nargs="*", help="flags of examples/train_lm.py, after --")
    args = parser.parse_args()
    force_kernel_isa(parser, args.isa)
    if args.jax_threefry:
        # The one place that picks the SR keys' hash (docs/ARCHITECTURE.md).
        sys.modules["nvfp4_jax._src.core.sr_keys"].native_hash = lambda implementation: False
    if args.reuse_memory:
        restart_reusing_memory()
    example = train_lm.parse_args(args.example_flags)
    train, _ = train_lm.split_text(train_lm.load_text(example.data), example.seq_len)

    def batch(step: int):
        return train_lm.batch_at(train, step, example.batch, example.seq_len, example.seed)

    print("\n".join(header_lines(sys.argv[1:], "benchmarks/train_step.py")))
    built = {r: build(example, r) for r in RECIPES}
    print(layer_summary(built["nvfp4"][0]))
    compile_seconds = {}
    for recipe, (_, run) in built.items():
        ops, lower_s, compile_seconds[recipe] = program_stats(run, batch(0))
        float(run.step(batch(0))[0])  # (loss, aux); the jitted step compiles its own program once
        times = f"trace + lower {lower_s:.1f} s, compile {compile_seconds[recipe]:.1f} s"
        print(f"{recipe:>5s}: {ops:,} StableHLO ops, {times}")
    print(f"compile NVFP4 / bf16: {compile_seconds['nvfp4'] / compile_seconds['bf16']:.2f}x")
    seconds = {r: [] for r in RECIPES}
    for i in range(args.steps):
        for recipe, (_, run) in built.items():
            start = time.perf_counter()
            float(run.step(batch(i + 1))[0])
            seconds[recipe].append(time.perf_counter() - start)
    median = {r: 1e3 * statistics.median(s) for r, s in seconds.items()}
    for recipe in RECIPES:
        print(f"{recipe:>5s}: median step {median[recipe]:.1f} ms over {args.steps} steps")
    print(f"NVFP4 / bf16: {median['nvfp4'] / median['bf16']:.2f}x")


if __name__ == "__main__":
    main()
