"""Loading the native libraries and registering their XLA FFI targets.

The C++ (`nvfp4_jax._nvfp4_cpu`) and CUDA (`nvfp4_jax._nvfp4_cuda`) handlers are built by
CMake from `ffi/` as tiny extension modules whose `registrations()` return PyCapsules. Each
target is registered under one name for both platforms ("cpu" and "CUDA"), so XLA picks the
handler for wherever the computation runs.

`register()` runs when `nvfp4_jax` is imported: it imports the modules and registers every
target without touching JAX's backends (registration is deferred by XLA until a backend
starts, so it is safe before `jax.distributed.initialize`), which is what a function
serialized with `jax.export` needs to run in a fresh process. It never raises: a missing or
broken module is recorded and reported by `unavailable_reason`.

Availability is decided separately and lazily, per platform, on the first op that asks: the
CPU library when it loaded; the CUDA library when it loaded, JAX has a CUDA backend, and the
module's `probe()` says its kernels can run on the device (a GPU of too low a compute
capability, or too old a driver, makes it unavailable with the reason).
"""

from __future__ import annotations

import importlib
import threading

import jax

# nvfp4_jax's platform name -> (extension module, XLA platform name).
MODULES = {"cpu": ("nvfp4_jax._nvfp4_cpu", "cpu"), "cuda": ("nvfp4_jax._nvfp4_cuda", "CUDA")}


def _target_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the targets both platforms have, those only the CPU has), as the CPU module says.

    The C++ module (ffi/python/module.cc) is the one list of target names: its
    `registrations()` holds every target of the platform, `shared_targets()` those the CUDA
    module has too. Empty when the CPU module does not load (then no target can run).
    """
    try:
        module = importlib.import_module(MODULES["cpu"][0])
        shared = tuple(module.shared_targets())
        names = tuple(module.registrations())
    except Exception:  # noqa: BLE001  (any import failure must leave the package usable)
        return (), ()
    return shared, tuple(name for name in names if name not in shared)


# The targets of both platforms (the quantizing ops, dequantize, the RHT, MS-EDEN), and the
# targets only the CPU library has (the NVFP4 GEMM, the weight-only GEMM, ragged_dot's
# grouped quantize, the threefry hash of the SR keys, the NVFP4 KV cache's write, read and
# attention).
TARGETS, CPU_TARGETS = _target_names()

_lock = threading.Lock()
# platform -> the loaded module, or the reason it did not load.
_loaded: dict[str, object] = {}
# platform -> None when the kernels can run there, else the reason they cannot.
_status: dict[str, str | None] = {}


def current_platform() -> str:
    """Returns the platform jitted code runs on by default: "cpu", "cuda", "rocm", "tpu"..."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = jax.devices()[0].client.platform_version.lower()
    return "rocm" if "rocm" in version else "cuda"


def _import(platform: str):
    """Imports and registers the module of `platform`; returns it or the reason it failed."""
    module_name, xla_platform = MODULES[platform]
    try:
        module = importlib.import_module(module_name)
        capsules = module.registrations()
    except Exception as error:  # noqa: BLE001  (any import failure must leave the package usable)
        return f"importing {module_name} failed: {type(error).__name__}: {error}"
    if not TARGETS:  # a CPU module built from older sources, without shared_targets()
        return f"{MODULES['cpu'][0]} does not name its targets; rebuild nvfp4_jax"
    # Every target the module has; it must have at least those both platforms share.
    missing = sorted(set(TARGETS) - set(capsules))
    if missing:
        return f"{module_name} lacks the targets {missing}; rebuild nvfp4_jax"
    for name, capsule in capsules.items():
        jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
    return module


def _module(platform: str):
    with _lock:
        if platform not in _loaded:
            _loaded[platform] = _import(platform)
        return _loaded[platform]


def register() -> None:
    """Imports every native module and registers its targets (no backend is started)."""
    for platform in MODULES:
        _module(platform)


def _gpu_backend_present() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _cuda_reason(module) -> str | None:
    """Why the loaded CUDA module cannot run here (no GPU backend, or its probe says), or None.

    `probe()` checks the driver, the device and that the module holds a kernel image for the
    device's compute capability, without launching anything.
    """
    if not _gpu_backend_present():
        return "the CUDA kernels are built, but this JAX has no CUDA GPU backend"
    probe = getattr(module, "probe", None)
    if probe is None:  # built from older sources, whose targets have other signatures
        return f"{module.__name__} has no probe(); rebuild nvfp4_jax"
    try:
        reason = str(probe())
    except Exception as error:  # noqa: BLE001  (a failing probe must leave the package usable)
        reason = f"probe() failed: {type(error).__name__}: {error}"
    return f"the CUDA kernels in {module.__name__} cannot run here: {reason}" if reason else None


def _decide(platform: str) -> str | None:
    if platform not in MODULES:
        return f"nvfp4_jax has no native kernels for platform {platform!r}"
    module = _module(platform)
    if isinstance(module, str):
        return module
    return _cuda_reason(module) if platform == "cuda" else None


def unavailable_reason(platform: str | None = None) -> str:
    """Says why the native kernels cannot run on `platform` (default: the current one).

    Returns "" when they can.
    """
    platform = current_platform() if platform is None else platform
    with _lock:
        known = platform in _status
    if not known:
        reason = _decide(platform)
        with _lock:
            _status.setdefault(platform, reason)
    return _status[platform] or ""


def is_available(platform: str | None = None) -> bool:
    """Returns True when the native kernels run on `platform` ("cpu", "cuda"; default current)."""
    return not unavailable_reason(platform)


def require(op: str) -> None:
    """Raises a ValueError naming `op` and the reason when the current platform has none."""
    platform = current_platform()
    reason = unavailable_reason(platform)
    if reason:
        raise ValueError(
            f"{op}: implementation='ffi' was requested but the nvfp4_jax native library is not "
            f"available for platform {platform!r}: {reason}"
        )


def export_safety_checks() -> list:
    """The `jax.export` safety checks to disable for a function that runs native kernels.

    `jax.export` refuses custom calls it does not know unless told; pass these as
    `jax.export.export(fn, disabled_checks=nvfp4_jax.kernels.export_safety_checks())`. The
    process that runs the exported function must `import nvfp4_jax` first (the import
    registers the targets).
    """
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in TARGETS + CPU_TARGETS]


def module(platform: str):
    """The loaded extension module of `platform` (for tests), or None."""
    loaded = _module(platform)
    return None if isinstance(loaded, str) else loaded


def cpu_isa() -> str | None:
    """The x86 level whose CPU kernels run ("baseline", "x86-64-v3", "x86-64-v4"), or None.

    "baseline" is the portable build (no AVX2; every non-x86 CPU): plain integer and f32 code.
    """
    loaded = module("cpu")
    return None if loaded is None or not hasattr(loaded, "isa") else loaded.isa()
