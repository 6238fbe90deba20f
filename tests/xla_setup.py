"""The XLA flags of every test process, set by conftest.py before JAX starts (no JAX here).

* `--xla_force_host_platform_device_count=8`: JAX sees 8 CPU devices, so the multi-device
  tests are ordinary tests.
* `--xla_backend_optimization_level=0`: LLVM's optimizations off. The suite's time is mostly
  XLA compiling small programs that then run for milliseconds; this cuts a training step's
  compile 3x to 4x.
* `--xla_cpu_use_fusion_emitters=false` (`LEGACY_EMITTERS_FLAG`), where this XLA has it:
  XLA's CPU backend emits its loops with its older emitters instead of the MLIR fusion
  emitters, which compiles the tests' programs about 2x faster again (a reference MoE train
  step 10.1 -> 5.2 s, a native one 4.3 -> 1.7 s; the main pass of the suite 14:19 -> 7:05,
  2 AVX2 cores; docs/results/test_suite.md). jaxlib 0.10 has them, 0.12 does not, and an
  XLA that does not know a flag in XLA_FLAGS aborts the process: the controlling process
  asks a child process once per run and the answer goes to the workers in
  `NVFP4_TEST_XLA_LEGACY_EMITTERS` ("1" or "0"; set it to "0" to keep the fusion emitters).

What the contract fixes does not depend on either choice: every bit-exact test of an op
passes with and without them (docs/NUMERICS.md says how the code stays exact whether or not
LLVM fuses a multiply and an add into an FMA, which it does only when optimizing). f32
arithmetic outside the contract may round differently (the embedding's scatter-add in the
example's gradients differs by an ulp between the two kinds of emitters). XLA's own
summation order (the reference's GEMM sums, the high-precision GEMMs) has been the same in
the tests' programs under the fusion emitters, but under the older ones it can differ by an
ulp between two programs of the same math (a sharded and an unsharded step; a value and its
recomputation inside a fusion). The two tests that hold two such programs to the same bits
skip under them (`helpers.skip_where_xla_sums_follow_the_program`, with the reason;
`NVFP4_TEST_XLA_LEGACY_EMITTERS=0` runs them) and their default cases run in the newest-JAX
pass, which compiles with XLA's defaults
(`NVFP4_TEST_XLA_OPTIMIZE=1`, scripts/test.sh). The JAX processes a test starts compile with
the same flags (`helpers.xla_compile_flags`).
"""

from __future__ import annotations

import os
import subprocess
import sys

OPTIMIZE = os.environ.get("NVFP4_TEST_XLA_OPTIMIZE", "0") == "1"
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
_LEGACY_EMITTERS_ENV = "NVFP4_TEST_XLA_LEGACY_EMITTERS"


def _xla_has_legacy_emitters() -> bool:
    """Whether this Python's XLA takes `LEGACY_EMITTERS_FLAG` (asked of a child process once
    per run; the answer is passed on in the environment)."""
    answer = os.environ.get(_LEGACY_EMITTERS_ENV)
    if answer is None:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=LEGACY_EMITTERS_FLAG),
            capture_output=True,
            check=False,
        )
        answer = os.environ[_LEGACY_EMITTERS_ENV] = "1" if probe.returncode == 0 else "0"
    return answer == "1"


def xla_flags() -> str:
    """The XLA_FLAGS of a test process: the caller's, then the module docstring's."""
    flags = [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    if not OPTIMIZE:
        flags.append("--xla_backend_optimization_level=0")
        if _xla_has_legacy_emitters():
            flags.append(LEGACY_EMITTERS_FLAG)
    return " ".join(filter(None, flags))


def legacy_emitters() -> bool:
    """Whether this process compiles with XLA's older CPU emitters (see the module docstring)."""
    return LEGACY_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "").split()
