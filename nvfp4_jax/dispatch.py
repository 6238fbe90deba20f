"""Choosing between the pure-jnp reference and the native FFI kernels.

The backend is an argument (`implementation=`), never an environment variable:

* `"reference"`: the pure-jnp specification; runs wherever JAX runs.
* `"ffi"`: the XLA FFI custom call (C++ on CPU, CUDA on NVIDIA GPUs). If the native library
  is not built for the current platform this raises; it never falls back silently.
* `None`: `"ffi"` when the native library is available for the current platform, else
  `"reference"`.
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = (None, "reference", "ffi")


def kernels():
    """Returns the `nvfp4_jax.kernels` module (imported lazily: it loads native code)."""
    from nvfp4_jax import kernels as module  # noqa: PLC0415

    return module


def current_platform() -> str:
    """Returns the platform that jitted code runs on by default: "cpu", "cuda", "rocm", ..."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = jax.devices()[0].client.platform_version.lower()
    return "rocm" if "rocm" in version else "cuda"


def resolve(implementation: str | None, op: str) -> str:
    """Returns "reference" or "ffi" for `op`, raising for an impossible request.

    Args:
      implementation: None, "reference" or "ffi".
      op: the public operation's name, for error messages.

    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation == "reference":
        return "reference"
    platform = current_platform()
    available = kernels().is_available(platform)
    if implementation is None:
        return "ffi" if available else "reference"
    if not available:
        raise ValueError(
            f"{op}: implementation='ffi' was requested but the nvfp4_jax native library is not "
            f"available for platform {platform!r}: {kernels().unavailable_reason(platform)}"
        )
    return "ffi"
