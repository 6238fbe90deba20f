"""The NVFP4 GEMMs of issue 24 against XLA's dots, every ratio taken in one process.

    python benchmarks/bench_gemm.py                 # the table (medians)
    python benchmarks/bench_gemm.py --iters 9 --size 2048
    python benchmarks/bench_gemm.py --only gemv     # only the decode GEMV rows

Rows (M = K = N = --size unless said):

* GEMM: `scaled_matmul` of two quantized (M, K), (N, K) operands, on the CPU the native
  exact kernel (`nvfp4_gemm`), and the XLA emulation it replaced (block values in bf16, XLA's
  dot; "before"), against XLA's `dot_general` of the same (M, K) x (N, K) shapes in bf16
  (f32 result; on a host with AVX512_BF16/AMX the fastest bf16 form, 3x `jnp.dot(x, y.T)`'s
  or a bf16 result's time) and in f32.
* dense fwd+bwd: `jit(value_and_grad)` of `sum(dot(x, W) * g)`, `nvfp4_jax.dot_general`
  with the default recipe (native GEMMs; and "before": the XLA-emulated GEMMs) against
  `jax.lax.dot_general` in bf16.
* GEMV: a decode step's (1, 4096) x (4096, 14336) with the frozen NVFP4 weight as the layers
  computed it before (`x @ dequantize(W)`) and as they do now on the CPU (the native W4A16
  kernel, `gemm.weight_only_matmul`; also with 8 rows), against bf16, and the bandwidth on
  the NVFP4 weight's bytes as a share of a plain copy's (64 MiB of f32, the faster of numpy's
  copy into a preallocated array and XLA's `jnp.copy`, read + written bytes / time) measured
  in the same process. Each GEMV and copy sample is the mean of 5 back-to-back calls, as a
  decode step runs its GEMVs (a lone call after idle time also times the threads' wake-up).
* On a host with AMX-INT8 the native GEMM is also timed with its opt-in AMX tiles.

Prints the host's ISA (the CPU kernel variant that runs) and thread count; `uptime`'s load is
worth noting beside the numbers on a shared host.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from roofline import ISA_CHOICES, ISA_HELP, force_kernel_isa  # this folder is on sys.path

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe, dot_general, kernels
from nvfp4_jax._src.core import ops
from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.training import gemm, weight_only

DENSE = (((1,), (0,)), ((), ()))
GEMV_BURST = 5  # the GEMV rows: each sample the mean of 5 back-to-back calls (medians_ms)
NT = (((1,), (1,)), ((), ()))  # (M, K) x (N, K): the GEMM's layout, XLA's fastest bf16 form here
F32 = jnp.float32


def medians_ms(
    cases, iters: int, warmup: int = 2, pause: float = 0.02, burst: int = 1
) -> list[float]:
    """Median ms of each (fn, args) case, the cases run round-robin: on a shared host a
    burst of load then falls on every case alike, and the ratios stay fair. Each timed call
    follows a `pause` (s): XLA's own pool threads spin for a while after a long op (the bf16
    GEMV), and a short native kernel started at once ran up to 2x slower beside them.

    With `burst` > 1 a sample is the mean of `burst` back-to-back calls after one untimed
    call: the steady state of a sequence of calls (a decode step's GEMVs run back to back).
    A single call after the pause measures the wake-up as well: on a VM whose idle vCPU
    sleeps, the second thread of a 4 ms kernel joined too late to help (2026-11-29: the
    1-row GEMV 3.4 ms back to back, 5-7 ms after 20 ms of idle)."""
    for fn, args in cases:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = [[] for _ in cases]
    for _ in range(iters):
        for (fn, args), out in zip(cases, times, strict=True):
            time.sleep(pause)
            if burst > 1:
                jax.block_until_ready(fn(*args))
            start = time.perf_counter()
            for _ in range(burst):
                jax.block_until_ready(fn(*args))
            out.append((time.perf_counter() - start) / burst)
    return [float(np.median(t)) * 1e3 for t in times]


def compiled_emulated(fn, *args):
    """`fn` compiled for `args` with the GEMMs as before the native kernel (block values in
    bf16 and XLA's dot): a compiled program, which no later trace changes.

    The library's ops are jitted functions of their own (traced once per argument types), so
    the caches are cleared on the way in (the ops trace again, emulated) and on the way out
    (what is traced after is native again).
    """
    original = gemm.uses_native_gemm
    gemm.uses_native_gemm = lambda backend, implementation: False
    jax.clear_caches()
    try:
        return jax.jit(fn).lower(*args).compile()
    finally:
        gemm.uses_native_gemm = original
        jax.clear_caches()


def host(forced: str | None = None) -> str:
    isa = kernels.cpu_isa() or "n/a"  # the level the kernels run
    if forced:
        isa += " (forced by --isa)"
    vnni = ""
    with contextlib.suppress(OSError):
        flags = open("/proc/cpuinfo").read()
        vnni = " avx512_vnni" if "avx512_vnni" in flags else " (no avx512_vnni)"
        model = next(line for line in flags.splitlines() if line.startswith("model name"))
        vnni += f", {model.split(':', 1)[1].strip()}"
    load = os.getloadavg()
    return (
        f"{platform.machine()}, kernel ISA {isa}{vnni}, {os.cpu_count()} cpus, "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, jax {jax.__version__}"
    )


def row(name, ms, base_ms=None, base_name="", extra=""):
    ratio = f"{ms / base_ms:6.2f}x {base_name}" if base_ms else ""
    print(f"| {name:<44} | {ms:10.2f} | {ratio:<18} | {extra}", flush=True)


def _xla_note() -> str:
    # The baseline kernels leave the GEMM to XLA (gemm.uses_native_gemm): say so in the row.
    return "" if gemm.uses_native_gemm("emulated", None) else "; XLA's dot (baseline kernels)"


def bench_gemm(size: int, iters: int):
    keys = jax.random.split(jax.random.key(0), 2)
    a32 = jax.random.normal(keys[0], (size, size), jnp.float32)
    b32 = jax.random.normal(keys[1], (size, size), jnp.float32)
    qa, qb = nvfp4_jax.quantize(a32), nvfp4_jax.quantize(b32)
    a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
    native = jax.jit(lambda p, q: gemm.scaled_matmul(p, q, backend="emulated"))
    before = compiled_emulated(lambda p, q: gemm.scaled_matmul(p, q, backend="emulated"), qa, qb)
    module = _library.module("cpu")
    has_amx = module is not None and module.set_gemm_amx(True)
    if module is not None:
        module.set_gemm_amx(False)

    def with_amx(qa, qb):
        module.set_gemm_amx(True)  # read when the kernel runs: on for this case only
        try:
            return jax.block_until_ready(native(qa, qb))
        finally:
            module.set_gemm_amx(False)

    cases = [
        (
            jax.jit(lambda x, y: jax.lax.dot_general(x, y, NT, preferred_element_type=F32)),
            (a16, b16),
        ),
        (jax.jit(lambda x, y: jax.lax.dot_general(x, y, NT)), (a32, b32)),
        (before, (qa, qb)),
        (native, (qa, qb)),
    ]
    if has_amx:
        cases.append((with_amx, (qa, qb)))
    bf16, f32, before, native_ms, *amx = medians_ms(cases, iters)
    shape = f"{size}^3"
    row(f"XLA dot bf16 (f32 acc) {shape}", bf16)
    row(f"XLA dot f32 {shape}", f32, bf16, "bf16")
    row(
        f"NVFP4 GEMM, XLA emulation (before) {shape}",
        before,
        bf16,
        "bf16",
        f"{before / f32:.2f}x f32",
    )
    row(
        f"NVFP4 GEMM, native (after) {shape}",
        native_ms,
        bf16,
        "bf16",
        f"{native_ms / f32:.2f}x f32{_xla_note()}",
    )
    if amx:
        row(
            f"  the same, AMX-INT8 tiles (opt-in) {shape}",
            amx[0],
            bf16,
            "bf16",
            f"{amx[0] / f32:.2f}x f32",
        )


def bench_dense(size: int, iters: int):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (size, size), jnp.bfloat16)
    w = jax.random.normal(keys[1], (size, size), jnp.bfloat16) * (size**-0.5)
    g = jax.random.normal(keys[2], (size, size), jnp.float32)
    key = jax.random.key(0)

    def step(dot):
        def loss(x, w, g):
            return jnp.sum(dot(x, w).astype(jnp.float32) * g)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    recipe = NVFP4Recipe()
    nvfp4 = lambda x, w: dot_general(x, w, DENSE, recipe=recipe, key=key)  # noqa: E731
    after = step(nvfp4)
    before = compiled_emulated(step(nvfp4), x, w, g)
    baseline = step(
        lambda x, w: jax.lax.dot_general(x, w, DENSE, preferred_element_type=jnp.float32)
    )
    bf16, before, after = medians_ms(
        [(baseline, (x, w, g)), (before, (x, w, g)), (after, (x, w, g))], iters
    )
    shape = f"{size}^3"
    row(f"dense fwd+bwd bf16 {shape}", bf16)
    row("dense fwd+bwd NVFP4, XLA emulation (before)", before, bf16, "bf16")
    row("dense fwd+bwd NVFP4, native GEMMs (after)", after, bf16, "bf16", _xla_note().lstrip("; "))


def bench_gemv(iters: int, k: int = 4096, n: int = 14336):
    keys = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(keys[0], (1, k), jnp.bfloat16)
    w32 = jax.random.normal(keys[1], (k, n), jnp.float32) * (k**-0.5)
    q = nvfp4_jax.quantize(w32, axis=0)  # stored (N, K), as a frozen (in, out) kernel
    w16 = w32.astype(jnp.bfloat16)
    del w32
    src = np.ones((16 << 20,), np.float32)  # 64 MiB: out of every cache
    dst = np.empty_like(src)
    xs = jax.random.normal(keys[0], (8, k), jnp.bfloat16)
    bf16, frozen, native, native8, np_copy_ms, xla_copy_ms = medians_ms(
        [
            (jax.jit(lambda x, w: x @ w), (x, w16)),
            (jax.jit(lambda x, q: jnp.matmul(x, ops.dequantize(q, jnp.bfloat16))), (x, q)),
            (jax.jit(weight_only.weight_only_matmul), (x, q)),
            (jax.jit(weight_only.weight_only_matmul), (xs, q)),
            (lambda s, d: np.copyto(d, s), (src, dst)),
            (jax.jit(jnp.copy), (jnp.asarray(src),)),
        ],
        iters,
        burst=GEMV_BURST,
    )
    copy_ms = min(np_copy_ms, xla_copy_ms)
    copy_gbs = 2 * src.nbytes / copy_ms / 1e6
    weight_bytes = q.codes.nbytes + q.scales.nbytes

    def bandwidth(ms):
        share = weight_bytes / ms / 1e6 / copy_gbs
        return f"{weight_bytes / ms / 1e6:.1f} GB/s = {100 * share:.1f}% of copy"

    row(f"GEMV (1,{k})x({k},{n}) bf16", bf16)
    row("GEMV frozen NVFP4, x @ dequantize(W) (before)", frozen, bf16, "bf16", bandwidth(frozen))
    row("GEMV frozen NVFP4, native W4A16 (after)", native, bf16, "bf16", bandwidth(native))
    row("  the same, 8 rows (8,4096)", native8, bf16, "bf16", bandwidth(native8))
    row(
        "copy (64 MiB: numpy into a preallocated array)",
        np_copy_ms,
        extra=f"{2 * src.nbytes / np_copy_ms / 1e6:.1f} GB/s (read + write)",
    )
    row(
        "copy (64 MiB: XLA's jnp.copy)",
        xla_copy_ms,
        extra=f"{2 * src.nbytes / xla_copy_ms / 1e6:.1f} GB/s (read + write; the faster is 100%)",
    )
    row("  the 8-row GEMV over the 1-row", native8, native, "1 row")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--isa", choices=ISA_CHOICES, help=ISA_HELP)
    parser.add_argument(
        "--only",
        choices=("gemm", "dense", "gemv"),
        action="append",
        help="run only these rows (repeatable; default: all)",
    )
    args = parser.parse_args()
    force_kernel_isa(parser, args.isa)
    print(f"host: {host(args.isa)}")
    print(
        f"backend: {jax.default_backend()}, {jax.device_count()} device(s); medians of "
        f"{args.iters} runs after 2 warm-ups"
    )
    print(f"| {'work':<44} | {'ms':>10} | {'ratio':<18} | note")
    print(f"| {'-' * 44} | {'-' * 10} | {'-' * 18} | ---")
    only = set(args.only or ("gemm", "dense", "gemv"))
    if "gemm" in only:
        bench_gemm(args.size, args.iters)
    if "dense" in only:
        bench_dense(args.size, args.iters)
    if "gemv" in only:
        bench_gemv(args.iters)


if __name__ == "__main__":
    main()
