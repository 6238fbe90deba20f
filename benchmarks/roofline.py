"""Roofline of the native CPU kernels: each op's effective bandwidth against a plain copy's.

    python benchmarks/roofline.py                          # every op at every named shape
    python benchmarks/roofline.py --shapes weight_4096 --ops amax,quantize_rn --iters 40
    python benchmarks/roofline.py --out benchmarks/results/cpu_roofline_DATE.txt

For each op and shape the table shows the median wall time of a jitted call of the public
op (`implementation="ffi"`, bf16 input, the amax computed by the op itself where it needs
one), its effective bandwidth counting only the minimum bytes (the input read once and the
outputs written: quantize 2 B/elem read + 0.5 B codes + 1/16 B scales; dequantize the codes
and scales read and the values written; fake quantize the values read and written; amax the
input read), and that bandwidth as a share of a plain copy's (read + write of the input),
measured in the same process, interleaved round by round with the ops: the faster of a
numpy copy into a preallocated array and a jitted XLA copy counts as 100% (each copy's
median over the rounds of every op of the shape, which dilutes the rounds where a slow
multithreaded peer left XLA's thread pool spinning beside the copy). --settle-ms sleeps
before each timed call instead; it makes small shapes look slower (cold caches), so it is
off by default.

"% fresh" is the same bandwidth as a share of a numpy copy into a newly allocated array:
every XLA result is written to fresh memory, whose first touch costs page faults that a
copy into a preallocated array does not pay, so for the ops that write a tensor-sized
result (dequantize, fake quantize) this is the copy they can be held to.

The last columns: the speed-up over the jitted pure-jnp reference (`implementation=
"reference"`), and the median times of the peers where they have the op: XLA's own
`jnp.max(jnp.abs(x))` for the amax, qwix's NVFP4 (`qwix.quantize(x, "nvfp4", ...)`, 1x16
blocks per row, no tensor scale; dequantize = `qwix.dequantize`, fake quantize = both) and
JAX's (`jax._src.cudnn.scaled_matmul_stablehlo.quantize` with the "nvfp4" config of
`jax.nn.get_scaled_dot_general_config`, its global scale `max|x| / 2688` computed in the
same jitted function). A peer that is not installed shows as "n/a".

Named shapes: "example" (the example training run's largest activations: batch 16 x seq 64
by hidden 128 and by MLP 352, i.e. (1024, 128) and (1024, 352)), "weight_4096" (4096, 4096),
"activation_16k" (16384, 1024); or any RxC.

--reuse-memory runs the table with glibc's malloc told to keep large blocks (REUSE_MEMORY):
XLA's results then reuse memory instead of fresh pages, as a copy into a preallocated array
does, and the kernels' own speed shows.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from bench_kernels import heavy_tailed  # this folder is on sys.path when run as a script

import nvfp4_jax
from nvfp4_jax import kernels
from nvfp4_jax._src.core.kernels import _library

SHAPES = {
    "example": [(1024, 352), (1024, 128)],
    "weight_4096": [(4096, 4096)],
    "activation_16k": [(16384, 1024)],
}
OPS = (
    "amax",
    "quantize_rn",
    "quantize_sr",
    "quantize_rht",
    "quantize_rn_2d",
    "quantize_sr_2d",
    "quantize_rht_2d",
    "dequantize_bf16",
    "dequantize_f32",
    "fake_quantize",
    "fake_quantize_2d",
)


def _optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


qwix = _optional("qwix")
jax_fp4 = _optional("jax._src.cudnn.scaled_matmul_stablehlo")


@dataclass
class Case:
    """One op: its minimum bytes, a maker of the jitted fn per implementation, its args."""

    name: str
    nbytes: int
    make: Callable[[str], Callable]
    args: tuple
    peers: dict
    copy_bytes: int = 0  # read + write of the bf16 input: what the copies move


def _quantize_case(name, n, x, key, **flags):
    def make(impl):
        def fn(x, k):
            q = nvfp4_jax.quantize(x, key=k, implementation=impl, **flags)
            return q.codes, q.scales, q.amax

        return jax.jit(fn)

    peers = {}
    if not flags:  # the peers' quantize is RN 1x16
        peers = {"qwix": _qwix_quantize(x), "jax": _jax_quantize(x)}
    return Case(name, 2 * n + n // 2 + n // 16, make, (x, key), peers)


def _qwix_quantize(x):
    if qwix is None:
        return None

    def fn(x):
        q = qwix.quantize(x, "nvfp4", channelwise_axes=(0,), tiled_axes={1: 16})
        return q.qvalue, q.scale

    return jax.jit(fn), (x,)


def _qwix_qdq(x, dtype, quantize: bool):
    if qwix is None:
        return None
    quant = jax.jit(
        lambda x: qwix.quantize(
            x, "nvfp4", channelwise_axes=(0,), tiled_axes={1: 16}, scale_dtype=dtype
        )
    )
    if quantize:  # fake quantize: both steps in one jitted function
        return jax.jit(lambda x: qwix.dequantize(quant(x))), (x,)
    return jax.jit(qwix.dequantize), (quant(x),)


def _jax_quantize(x):
    if jax_fp4 is None:
        return None

    def fn(x):
        amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
        config = jax.nn.get_scaled_dot_general_config("nvfp4", (amax / 2688.0).reshape(1))
        return jax_fp4.quantize(x, config)

    return jax.jit(fn), (x,)


def cases(x, key, ops) -> list[Case]:
    n = x.size
    q = nvfp4_jax.quantize(x, implementation="ffi")
    all_cases = {
        "amax": lambda: Case(
            "amax",
            2 * n,
            lambda impl: jax.jit(lambda x: nvfp4_jax.tensor_amax(x, implementation=impl)),
            (x,),
            {"xla max|x|": (jax.jit(lambda x: jnp.max(jnp.abs(x))), (x,))},
        ),
        "quantize_rn": lambda: _quantize_case("quantize RN", n, x, key),
        "quantize_sr": lambda: _quantize_case("quantize SR", n, x, key, stochastic_rounding=True),
        "quantize_rht": lambda: _quantize_case("quantize RHT", n, x, key, rht=True),
        "quantize_rn_2d": lambda: _quantize_case("quantize RN 2d", n, x, key, block_2d=True),
        "quantize_sr_2d": lambda: _quantize_case(
            "quantize SR 2d", n, x, key, block_2d=True, stochastic_rounding=True
        ),
        "quantize_rht_2d": lambda: _quantize_case(
            "quantize RHT 2d", n, x, key, block_2d=True, rht=True
        ),
        "dequantize_bf16": lambda: _dequantize_case(q, n, jnp.bfloat16, x),
        "dequantize_f32": lambda: _dequantize_case(q, n, jnp.float32, x),
        "fake_quantize": lambda: _fake_case("fake quantize", n, x, block_2d=False),
        "fake_quantize_2d": lambda: _fake_case("fake quantize 2d", n, x, block_2d=True),
    }
    return [all_cases[op]() for op in ops]


def _dequantize_case(q, n, dtype, x):
    name = "dequantize " + {"bfloat16": "bf16", "float32": "f32"}[jnp.dtype(dtype).name]
    nbytes = n // 2 + n // 16 + n * jnp.dtype(dtype).itemsize

    def make(impl):
        return jax.jit(lambda q: nvfp4_jax.dequantize(q, dtype, implementation=impl))

    return Case(name, nbytes, make, (q,), {"qwix": _qwix_qdq(x, dtype, quantize=False)})


def _fake_case(name, n, x, *, block_2d):
    def make(impl):
        return jax.jit(lambda x: nvfp4_jax.fake_quantize(x, block_2d=block_2d, implementation=impl))

    peers = {} if block_2d else {"qwix": _qwix_qdq(x, jnp.bfloat16, quantize=True)}
    return Case(name, 4 * n, make, (x,), peers)


def _timer(fn, args):
    def run():
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - start

    return run


def copy_contestants(x):
    """Timers of the copies that count as 100%: numpy into a preallocated array, XLA; and
    numpy into a new array ("fresh copy": what an op pays for writing its result to memory
    it has just allocated, the page faults included, as every XLA result is)."""
    src = np.asarray(x)
    dst = np.empty_like(src)

    def np_copy():
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    def fresh_copy():
        start = time.perf_counter()
        src.copy()
        return time.perf_counter() - start

    return {
        "numpy copy": np_copy,
        "xla copy": _timer(jax.jit(jnp.copy), (x,)),
        "fresh copy": fresh_copy,
    }


def measure(case: Case, copies, *, iters, warmup, ref_iters, peers, settle) -> dict:
    """Seconds of every contestant per round, timed round by round in turn (interleaved).

    Before each timed call the process sleeps `settle` seconds (if not 0), so that the
    thread pool a previous (multithreaded) contestant left spinning does not run beside
    the next one.
    """
    timers = dict(copies)
    timers["ffi"] = _timer(case.make("ffi"), case.args)
    if ref_iters:
        timers["reference"] = _timer(case.make("reference"), case.args)
    for peer, spec in case.peers.items():
        if spec is not None and peers:
            timers[peer] = _timer(*spec)
    for timer in timers.values():
        for _ in range(warmup):
            timer()
    samples = {name: [] for name in timers}
    for i in range(iters):
        for name, timer in timers.items():
            if name != "reference" or i < ref_iters:
                if settle:
                    time.sleep(settle)
                samples[name].append(timer())
    return samples


def parse_shapes(names: str) -> list[tuple[str, tuple[int, int]]]:
    shapes = []
    for name in names.split(","):
        if name in SHAPES:
            shapes += [(name, s) for s in SHAPES[name]]
        else:
            rows, cols = (int(v) for v in name.lower().split("x"))
            shapes.append((name, (rows, cols)))
    return shapes


ISA_CHOICES = ("x86-64-v4", "x86-64-v3", "baseline")
ISA_HELP = (
    "run the native CPU kernels built for this x86 level (x86-64-v3: AVX2) instead of the "
    "best this CPU runs; XLA's own ops are unaffected (XLA picks its instructions itself)"
)


def force_kernel_isa(parser: argparse.ArgumentParser, isa: str | None) -> None:
    """Runs the native CPU kernels of x86 level `isa` (None: the best), or exits naming it."""
    if isa:
        module = _library.module("cpu")
        if module is None or not module.set_isa(isa):
            parser.error(f"--isa {isa}: this CPU or this build cannot run those kernels")


def header_lines(argv, script: str = "benchmarks/roofline.py") -> list[str]:
    """The machine, versions, date, command and allocator settings, as comment lines."""
    model, flags = "unknown CPU", "no avx512f"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        model = names[0].strip() if names else model
        flags = "avx512f" if "avx512f" in cpuinfo else flags
    return [
        f"# machine: {model} ({platform.machine()}, {flags}), {os.cpu_count()} cores",
        f"# jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
        f"qwix {getattr(qwix, '__version__', 'n/a')}, python {platform.python_version()}",
        f"# native CPU kernels: {kernels.cpu_isa() or 'none'}",
        f"# date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        "# command: python " + " ".join([script, *argv]),
        "# allocator: "
        + (
            f"GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}"
            if os.environ.get("GLIBC_TUNABLES")
            else "glibc defaults (results of 32 MiB and more get fresh pages at every call)"
        ),
    ]


# glibc's malloc maps every block of 32 MiB or more (its largest automatic mmap threshold)
# afresh and unmaps it on free, so each such XLA result is new memory that the OS zeroes on
# first touch. These tunables keep blocks up to 1 GiB in the heap, and freed memory there.
REUSE_MEMORY = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296"


def restart_reusing_memory() -> None:
    """Runs this command again with REUSE_MEMORY set, unless it is already (glibc reads its
    tunables when the process starts)."""
    if os.environ.get("GLIBC_TUNABLES") != REUSE_MEMORY:
        env = {**os.environ, "GLIBC_TUNABLES": REUSE_MEMORY}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


COLUMNS = (
    ("shape", 22),
    ("op", 17),
    ("ms", 8),
    ("GB/s", 6),
    ("% copy", 6),
    ("copy GB/s", 9),
    ("% fresh", 7),
    ("ref/ffi", 7),
    ("peer ms", 30),
)


def row(cells) -> str:
    return (
        "| " + " | ".join(f"{str(c):>{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)) + " |"
    )


def format_row(label, case: Case, t: dict) -> str:
    """One table row; 100% is the faster copy of the bf16 input (read + write)."""
    copy_gbs = case.copy_bytes / min(t["numpy copy"], t["xla copy"])
    gbs = case.nbytes / t["ffi"] / 1e9
    share = 100 * gbs / (copy_gbs / 1e9)
    fresh = 100 * t["fresh copy"] * case.nbytes / case.copy_bytes / t["ffi"]
    ref = f"{t['reference'] / t['ffi']:.1f}x" if "reference" in t else "-"
    peers = ", ".join(
        f"{name} {t[name] * 1e3:.2f}" if name in t else f"{name} n/a"
        for name, spec in case.peers.items()
        if name in t or spec is None
    )
    cells = (label, case.name, f"{t['ffi'] * 1e3:.3f}", f"{gbs:.1f}", f"{share:.0f}%")
    return row((*cells, f"{copy_gbs / 1e9:.1f}", f"{fresh:.0f}%", ref, peers or "-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="example,weight_4096,activation_16k")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {OPS}")
    parser.add_argument("--iters", type=int, default=30, help="timed rounds per op")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ref-iters", type=int, default=5, help="rounds that time the reference")
    parser.add_argument("--no-peers", action="store_true", help="time neither qwix nor JAX")
    parser.add_argument("--settle-ms", type=float, default=0.0, help="sleep before each call")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument(
        "--reuse-memory",
        action="store_true",
        help=f"rerun this command with GLIBC_TUNABLES={REUSE_MEMORY} (docs/guides/kernels.md)",
    )
    args = parser.parse_args()
    if args.reuse_memory:
        restart_reusing_memory()
    if not kernels.is_available("cpu"):
        raise SystemExit(f"no native CPU kernels: {kernels.unavailable_reason('cpu')}")
    ops = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise SystemExit(f"unknown ops {unknown}; known: {OPS}")

    lines = header_lines(sys.argv[1:])
    lines.append(
        f"# median of {args.iters} interleaved rounds (reference: {args.ref_iters}); copy: "
        "median over the rounds of every op of the shape"
    )
    rule = "|" + "|".join("-" * (w + 2) for _, w in COLUMNS) + "|"
    lines += [row(name for name, _ in COLUMNS), rule]
    print("\n".join(lines), flush=True)
    key = jax.random.key(0)
    for name, shape in parse_shapes(args.shapes):
        x = heavy_tailed(shape, key)
        copies = copy_contestants(x)
        measured = []
        for case in cases(x, key, ops):
            case.copy_bytes = 2 * x.nbytes
            options = dict(iters=args.iters, warmup=args.warmup, ref_iters=args.ref_iters)
            settle = args.settle_ms / 1e3
            measured.append(
                (case, measure(case, copies, **options, peers=not args.no_peers, settle=settle))
            )
        # The copies are the same for every op of a shape: their samples are pooled.
        pooled = {c: [v for _, t in measured for v in t[c]] for c in copies}
        for case, samples in measured:
            t = {c: statistics.median(v) for c, v in samples.items()}
            t.update({c: statistics.median(v) for c, v in pooled.items()})
            lines.append(format_row(f"{name} {shape[0]}x{shape[1]}", case, t))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
