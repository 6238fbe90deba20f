"""What the test modules share: the implementations, test data, bit-level comparisons.

Fixtures live in conftest.py; this module is plain code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import xla_setup

import nvfp4_jax
from nvfp4_jax import kernels

DTYPE_NAMES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
DENSE = (((1,), (0,)), ((), ()))


# --- implementations ---------------------------------------------------------------------


def _gpu_device():
    try:
        return jax.devices("cuda")[0]
    except RuntimeError:
        return None


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation on one device: "reference", "cpu" (C++ FFI) or "cuda" (CUDA FFI).

    `run(op, *args, **static)` calls the public op `nvfp4_jax.<op>` with `implementation=`
    set, under `jax.jit` (one compilation per op and static arguments), on this device.
    Arguments that are None pass through; every other one is placed on the device.
    """

    name: str
    implementation: str
    device: jax.Device

    def run(self, op: str, *args, **static):
        # The types are part of the cache key: 1 == True, but inverse=1 must not hit inverse=True.
        key = tuple((k, type(v), v) for k, v in sorted(static.items()))
        fn = _jitted(op, self.implementation, key)
        placed = [None if a is None else jax.device_put(a, self.device) for a in args]
        return fn(*placed)

    def quantize(self, x, *, key=None, amax=None, **static):
        return self.run("quantize", x, key, amax, **static)

    def fake_quantize(self, x, *, key=None, amax=None, **static):
        return self.run("fake_quantize", x, key, amax, **static)

    def dequantize(self, q, dtype=np.float32):
        return self.run("dequantize", q, dtype=np.dtype(dtype))

    def tensor_amax(self, x, **static):
        return self.run("tensor_amax", x, **static)

    def apply_rht(self, x, **static):
        return self.run("apply_rht", x, **static)


@functools.cache
def _jitted(op: str, implementation: str, static: tuple):
    fn = getattr(nvfp4_jax, op)
    kw = {k: v for k, _, v in static}
    kw["implementation"] = implementation
    if op in ("quantize", "fake_quantize"):
        return jax.jit(lambda x, key, amax: fn(x, key=key, amax=amax, **kw))
    if op == "dequantize":
        dtype = kw.pop("dtype")
        return jax.jit(lambda q: fn(q, dtype, **kw))
    return jax.jit(lambda x: fn(x, **kw))


IMPLEMENTATIONS = ["reference", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NATIVE = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def skip_eager_reference(impl: Impl, mode: str) -> None:
    """Skips the eager run of the pure-jnp reference in the heaviest composite tests.

    Eager dispatch is the same code on every implementation: the native kernels cover it
    (and the reference's numbers are covered under `jit`), while the reference op by op
    costs minutes of the suite.
    """
    if mode == "eager" and impl.implementation == "reference":
        pytest.skip("eager dispatch is covered on the native kernels; the reference under jit")


def make_impl(name: str) -> Impl:
    """The `Impl` called `name`, or a pytest skip saying why it cannot run here."""
    if name == "reference":
        return Impl("reference", "reference", jax.devices("cpu")[0])
    if name == "cpu":
        if not kernels.is_available("cpu"):
            pytest.skip(f"native CPU kernels unavailable: {kernels.unavailable_reason('cpu')}")
        return Impl("cpu", "ffi", jax.devices("cpu")[0])
    gpu = _gpu_device()
    if gpu is None or not kernels.is_available("cuda"):
        reason = kernels.unavailable_reason("cuda") if gpu else "no CUDA GPU in this JAX"
        pytest.skip(f"CUDA kernels unavailable: {reason}")
    return Impl("cuda", "ffi", gpu)


# --- data ---------------------------------------------------------------------------------


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for a short name: f32, bf16, f16."""
    return np.dtype(DTYPE_NAMES[name])


def heavy_tailed(shape, dtype="f32", *, seed=0, outliers=True, row_axis=-1) -> np.ndarray:
    """Standard normal times a lognormal factor per row (rows along ``row_axis``), + outliers.

    The per-row factor spans several decades (sigma=1.5), so tensor and block amaxes differ
    widely; about 0.1% of the elements are multiplied by 30 to 300 (outliers). The values
    are representable in ``dtype`` (rounded once, here) and returned in that dtype.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float64)
    fshape = list(shape)
    fshape[row_axis % len(shape)] = 1  # one factor per row: constant along the row axis
    x *= rng.lognormal(0.0, 1.5, size=fshape)
    if outliers:
        mask = rng.random(shape) < 1e-3
        x = np.where(mask, x * rng.uniform(30, 300, size=shape), x)
    if np_dtype(dtype) == np.float16:
        x = x / np.max(np.abs(x)) * 3e4  # keep inside f16 range
    return x.astype(np.float32).astype(np_dtype(dtype))


def with_underflow_block(x: np.ndarray, *, row=0, block=0, scale=1e-7) -> np.ndarray:
    """Overwrite one 16-block along the last axis with values far below the tensor amax."""
    x = x.copy()
    amax = float(np.max(np.abs(x.astype(np.float32))))
    rng = np.random.default_rng(123)
    vals = rng.uniform(0.5, 1.0, 16) * rng.choice([-1.0, 1.0], 16) * amax * scale
    idx = (row,) * (x.ndim - 1) if x.ndim > 1 else ()
    x[idx + (slice(16 * block, 16 * block + 16),)] = vals.astype(x.dtype)
    return x


def normal(shape, seed=0, dtype=jnp.float32) -> jax.Array:
    """Standard normal data from a JAX key, cast to `dtype`."""
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def same_bits(a, b) -> bool:
    """Whether two arrays have the same shape, dtype and bytes."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.shape, a.dtype) == (b.shape, b.dtype) and np.array_equal(
        a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    )


def bits(a) -> np.ndarray:
    """Raw bits of an array (uint view) for bit-for-bit comparisons."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(actual, expected, what=""):
    """Equal shapes, dtypes and bits. NaNs compare equal to NaNs (payloads are not part of
    the contract)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if jnp.issubdtype(actual.dtype, jnp.floating):
        nan_a, nan_e = np.isnan(actual.astype(np.float32)), np.isnan(expected.astype(np.float32))
        np.testing.assert_array_equal(nan_a, nan_e, f"{what}: NaN positions")
        actual, expected = np.where(nan_a, 0, actual), np.where(nan_e, 0, expected)
        actual, expected = actual.astype(expected.dtype), expected.astype(expected.dtype)
    diff = bits(actual) != bits(expected)
    if diff.any():
        idx = tuple(np.argwhere(diff)[0])
        raise AssertionError(
            f"{what}: {diff.sum()} of {diff.size} differ; first at {idx}: "
            f"got {actual[idx]!r} want {expected[idx]!r}"
        )


def assert_same_q(actual, expected, what=""):
    """Two NVFP4Arrays (or oracle results) with the same codes, scale bytes and amax."""
    exp_codes = getattr(expected, "packed", None)
    exp_codes = expected.codes if exp_codes is None else exp_codes
    assert_same_bits(actual.codes, exp_codes, f"{what} codes")
    assert_same_bits(
        np.asarray(actual.scales).view(np.uint8),
        np.asarray(expected.scales).view(np.uint8),
        f"{what} scale bytes",
    )
    assert_same_bits(
        np.asarray(actual.amax, np.float32), np.asarray(expected.amax, np.float32), f"{what} amax"
    )
    if hasattr(expected, "axis") and hasattr(actual, "axis"):
        meta = ("dtype", "axis", "block_2d", "rht")
        assert [getattr(actual, m) for m in meta] == [getattr(expected, m) for m in meta], what


REPO = pathlib.Path(__file__).resolve().parent.parent


def build_host_check(source: str, binary: pathlib.Path, *flags: str) -> pathlib.Path:
    """Compiles `tests/<source>` (plain C++ against ffi/include) with the host compiler.

    Skips the test when there is no C++ compiler; fails with the compiler's output when the
    program does not build (warnings are errors).
    """
    names = (os.environ.get("CXX", ""), "c++", "g++", "clang++")
    found = next((name for name in names if name and shutil.which(name)), None)
    if found is None:
        pytest.skip("no host C++ compiler")
    command = [found, "-std=c++17", "-O1", *flags, "-Wall", "-Wextra", "-Werror"]
    command += ["-I", str(REPO / "ffi" / "include"), str(REPO / "tests" / source)]
    build = subprocess.run(
        [*command, "-o", str(binary)], capture_output=True, text=True, timeout=120, check=False
    )
    assert build.returncode == 0, build.stderr
    return binary


# --- meshes: JAX's axis types --------------------------------------------------------------

# How a test uses a mesh: "auto" (Auto axes, the shardings only on the arrays), "auto_set_mesh"
# (Auto axes under `jax.set_mesh`) or "explicit" (Explicit axes, `jax.make_mesh`'s default,
# under `jax.set_mesh`: the shardings are in the types).
MESH_MODES = ("auto", "auto_set_mesh", "explicit")


def make_mesh(shape, names, mode: str = "auto") -> jax.sharding.Mesh:
    """A mesh of the first CPU devices with the axis types of `mode` (see MESH_MODES)."""
    kind = jax.sharding.AxisType.Explicit if mode == "explicit" else jax.sharding.AxisType.Auto
    count = int(np.prod(shape))
    devices = jax.devices("cpu")[:count]
    return jax.make_mesh(
        tuple(shape), tuple(names), axis_types=(kind,) * len(names), devices=devices
    )


def mesh_context(mesh: jax.sharding.Mesh, mode: str):
    """`jax.set_mesh(mesh)` where `mode` uses it, else a context that does nothing."""
    return jax.set_mesh(mesh) if mode != "auto" else contextlib.nullcontext()


def skip_where_xla_sums_follow_the_program(what: str) -> None:
    """Skips a test that holds two programs' f32 sums in XLA's own order (the reference's
    GEMMs, the high-precision ones) to the same bits, where XLA's older CPU emitters run:
    under them that order can differ between two programs of the same math
    (tests/xla_setup.py). `NVFP4_TEST_XLA_LEGACY_EMITTERS=0` runs it here; the newest-JAX
    pass, with XLA's defaults, runs the cases marked `newest` (conftest.py)."""
    if xla_setup.legacy_emitters():
        pytest.skip(
            f"{what}: under XLA's older CPU emitters (tests/xla_setup.py) XLA's f32 sums may "
            "round differently in each program; NVFP4_TEST_XLA_LEGACY_EMITTERS=0 runs it (the "
            "newest-JAX pass runs the cases marked newest)"
        )


def xla_compile_flags() -> str:
    """This process's XLA flags without the device count: what a test passes to the JAX
    processes it starts (which set their own device count), so that they compile their
    programs as this one does (tests/xla_setup.py's flags)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))
