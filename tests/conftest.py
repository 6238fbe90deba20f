"""Session setup, the `impl` fixture that runs one test suite on every implementation, and
the `integration` marker.

JAX sees 8 CPU devices in every test process (the flag must be set before JAX starts), so
the multi-device tests are ordinary tests; single-device tests run on device 0 as usual.

XLA compiles the tests' programs with LLVM's optimizations off and, where this XLA has
them, with its older CPU emitters (`xla_setup.py` says why and what it changes): the suite's
time is mostly XLA compiling small programs that then run for milliseconds. The JAX
processes a test starts compile with the same flags (`helpers.xla_compile_flags`). The test
command's second environment (the newest JAX, scripts/test.sh) runs the fast tests with
XLA's defaults; `NVFP4_TEST_XLA_OPTIMIZE=1` keeps them here too. The run's processes share
one compilation cache (`pytest_configure`).

`tests/` mirrors the package: `core/`, `training/`, `flax/`, `io/`, `model/` hold the tests of
`nvfp4_jax/_src/<package>/`, one file per module or feature. `integration/` holds the tests
that start processes, train the example or need optional engines: every test there is
marked `integration`. The fast inner loop is `pytest -m "not slow"` (about 2 minutes on 2
cores); `slow` marks, besides the integration tests, the sharding tests of
`training/test_distributed*.py` (marked `distributed`), the training ops' cases on the
reference implementation (`tests/training/`, `impl` or `implementation` "reference": the
native cases stay, and `tests/core/` shows both implementations quantize to the same bits)
and the tests marked `@pytest.mark.slow` in their file (several seconds each on 2 cores).
CI runs them all, but for the reference sweep below.

The reference sweep: eleven tests of the training GEMMs (`REFERENCE_KEPT`) repeat one check
over many parameter sets on both implementations. Their composition (the custom_vjp, the
recipe's operands, the sharding rules) is the same code whatever implementation quantizes,
and `tests/core/` shows both implementations quantize to the same bits, op by op: on the
reference each of them runs one chosen case by default (the native cases all run), and the
others are marked `reference_sweep` and deselected. `pytest --reference-sweep -m
reference_sweep tests/training` runs them (a heavy optional check: 58 tests, about a
minute on 2 cores; run it before a change to the training ops is merged; with
`NVFP4_TEST_XLA_LEGACY_EMITTERS=0` for the sharded train step's reference cases, which skip
under the older emitters, see xla_setup.py). The two-process
tests (`integration/test_multiprocess.py`) likewise run the reference's hardest cases
only; `pytest --reference-sweep tests/integration/test_multiprocess.py` runs all of them.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import xla_setup

os.environ["XLA_FLAGS"] = xla_setup.xla_flags()  # before JAX starts

import jax
import pytest
from helpers import IMPLEMENTATIONS, NATIVE, Impl, make_impl

from nvfp4_jax._src.core.kernels import _library

INTEGRATION = pathlib.Path(__file__).resolve().parent / "integration"
TRAINING = pathlib.Path(__file__).resolve().parent / "training"
_CACHE_ENV = "NVFP4_TEST_XLA_CACHE"


def pytest_configure(config):
    """One XLA compilation cache for the whole run: its workers and the processes tests start.

    The workers compile many of the same programs (and every started process all of its
    own), so they share JAX's persistent compilation cache in a temporary folder made by
    the controlling process and removed when the run ends. `NVFP4_TEST_XLA_CACHE=0` turns
    it off. With `--reference-sweep`, `NVFP4_REFERENCE_SWEEP=1` tells the multi-process
    tasks (and the processes that run them) to run every reference case.
    """
    if config.getoption("--reference-sweep"):  # for integration/multiprocess_tasks.py too
        os.environ["NVFP4_REFERENCE_SWEEP"] = "1"
    if os.environ.get(_CACHE_ENV) == "0":
        return
    if not hasattr(config, "workerinput"):  # the controlling process (or the only one)
        config._nvfp4_cache = tempfile.mkdtemp(prefix="nvfp4-jax-xla-cache-")
        os.environ[_CACHE_ENV] = config._nvfp4_cache  # the workers start after this
    folder = os.environ.get(_CACHE_ENV)
    if not folder:
        return
    settings = {
        "jax_compilation_cache_dir": folder,
        # Only programs that take a second to compile: those are what the workers and the
        # started processes share (train steps, the example's programs); the thousands of
        # small ones gain nothing from it, and writing each one serializes an executable
        # (jax 0.10.2 once crashed a worker in that serialization, in a small sharded program).
        "jax_persistent_cache_min_compile_time_secs": 1.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # for the processes tests start


def pytest_unconfigure(config):
    folder = getattr(config, "_nvfp4_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


# The markers of the longest modules, which run first (`pytest_collection_modifyitems`).
LONGEST = ("integration", "distributed")
# The native kernels' training under JAX's default mesh (Explicit axes), which jax 0.12 once
# broke (`_partition.whole_under_explicit_axes`): marked `newest`, so that scripts/test.sh
# runs them again in .venv-newest (the rest of test_distributed*.py runs on one JAX version).
NEWEST_DISTRIBUTED = (
    "test_train_step_sharded_equals_one_device",
    "test_layer_data_parallel_equals_one_device",
)
# The kept reference case of the sharded train step holds two programs' f32 sums (XLA's own
# order) to the same bits: it skips where the older CPU emitters run (xla_setup.py), so the
# newest-JAX pass, which compiles with XLA's defaults, runs it too.
NEWEST_REFERENCE = ("test_train_step_sharded_equals_one_device",)

# The reference sweep (see the module docstring): test name -> the one reference case (its id)
# that runs by default; the test's other reference cases run with --reference-sweep.
REFERENCE_KEPT = {
    "test_train_step_sharded_equals_one_device": "reference-explicit-fsdp",
    "test_shard_map_replicated_weight_grads": "reference-explicit-dot_general-nvfp4",
    "test_layer_data_parallel_equals_one_device": "reference-nnx_linear-explicit",
    "test_forward_equals_scaled_gemm_of_block_values": "dense_general_2_axes-bf16-reference",
    "test_backward_equals_hand_built_gemms": "m40_k32_n32_padded-f32-default-reference",
    "test_batched_equals_loop_of_unbatched_calls": "reference-experts_leading-key-eager+jit",
    "test_vmap_over_token_sets_is_the_loop_bit_for_bit": "reference-key-jit",
    "test_vmap_of_every_gemm_form_is_the_loop": "reference-nested",
    "test_empty_dimensions_give_jax_ragged_dots_zeros": "reference-k0_n0-jit",
    "test_each_gemm_is_the_product_of_the_four_over_six_operands": (
        "mse-weight+activation+gradient-reference"
    ),
    "test_the_runtime_flag_gives_the_fprop_switchs_bits": "dot_general-True-reference",
}


def pytest_addoption(parser):
    parser.addoption(
        "--reference-sweep",
        action="store_true",
        help="also run the reference sweep (tests/conftest.py: REFERENCE_KEPT), deselected "
        "by default",
    )


def _in_reference_sweep(item, on_reference: bool) -> bool:
    kept = REFERENCE_KEPT.get(item.originalname)
    return on_reference and kept is not None and item.callspec.id != kept


def pytest_collection_modifyitems(config, items):
    """Marks `integration` every test under tests/integration/, `slow` those and the rest the
    inner loop leaves out (see the module docstring), `newest` `NEWEST_DISTRIBUTED`'s native
    Explicit-axes cases and `NEWEST_REFERENCE`'s kept reference case, `reference_sweep` the
    reference sweep (deselected without --reference-sweep); then puts the `LONGEST` modules
    first."""
    sweep = config.getoption("--reference-sweep")
    swept = []
    for item in items:
        path = pathlib.Path(str(item.path)).resolve()
        params = getattr(getattr(item, "callspec", None), "params", {})
        on_reference = "reference" in (params.get("impl"), params.get("implementation"))
        if INTEGRATION in path.parents:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("distributed") or (TRAINING in path.parents and on_reference):
            item.add_marker(pytest.mark.slow)
        if (
            item.originalname in NEWEST_DISTRIBUTED
            and params.get("impl") == "cpu"
            and params.get("mode") == "explicit"
        ) or (
            item.originalname in NEWEST_REFERENCE
            and item.callspec.id == REFERENCE_KEPT[item.originalname]
        ):
            item.add_marker(pytest.mark.newest)
        if _in_reference_sweep(item, on_reference):
            item.add_marker(pytest.mark.reference_sweep)
            swept.append(item)
    # A renamed case must not take a test's every reference case out of the default run.
    kept = {(item.originalname, item.callspec.id) for item in items if hasattr(item, "callspec")}
    for name in {item.originalname for item in swept}:
        if (name, REFERENCE_KEPT[name]) not in kept:
            raise pytest.UsageError(f"REFERENCE_KEPT[{name!r}]: no case {REFERENCE_KEPT[name]!r}")
    if swept and not sweep:
        config.hook.pytest_deselected(items=swept)
        deselected = set(map(id, swept))
        items[:] = [item for item in items if id(item) not in deselected]
    # The longest modules first (a stable sort: each module stays in one piece, in order):
    # pytest-xdist gives each worker a contiguous share and a worker that runs out steals
    # from the end of another's, so the run ends on short tests, and a module's fixtures
    # (the two processes of test_multiprocess.py) are not built on both workers.
    items.sort(key=lambda item: not any(map(item.get_closest_marker, LONGEST)))


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request) -> Impl:
    """Every implementation in turn: the reference, the CPU kernels, the CUDA kernels."""
    return make_impl(request.param)


@pytest.fixture(params=NATIVE)
def native(request) -> Impl:
    """Every native implementation in turn (the CPU kernels, the CUDA kernels)."""
    return make_impl(request.param)


@pytest.fixture(params=["baseline", "x86-64-v3", "x86-64-v4"])
def cpu_isa(request):
    """Runs the CPU kernels built for one x86 level (each level is a separate build) and yields
    its name; skips where this build or CPU lacks it. Afterwards the best level and all threads
    again."""
    module = _library.module("cpu")
    if module is None or not hasattr(module, "set_isa") or not module.set_isa(request.param):
        pytest.skip(f"this build or CPU has no {request.param} kernels")
    yield request.param
    module.set_isa("")
    module.set_gemm_threads(0)
