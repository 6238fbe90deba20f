"""The implementations of the public ops, and the one place that decides which one runs.

Every implementation computes the same bits (docs/NUMERICS.md) on the *stored layout* (the
quantized axis last) with arguments the public ops in `nvfp4_jax.ops` have already checked:

* `"reference"`: the pure-jnp specification (`nvfp4_jax.reference`); runs wherever JAX runs.
* `"ffi"`: the native XLA FFI kernels (`nvfp4_jax.kernels`: C++ on CPU, CUDA on NVIDIA
  GPUs). Asking for it where it cannot run is an error that says why; it never falls back.

`resolve(None, op)` picks "ffi" when its kernels run on the current platform, else
"reference". The backend is always an argument, never an environment variable.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

import jax

from nvfp4_jax._src.core import kernels, reference
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.reference.quantize import fake_quantize_stored, quantize_stored
from nvfp4_jax._src.core.seed import SRSeed

Implementation = Literal["reference", "ffi"]


class Backend(Protocol):
    """What an implementation provides: the five operations on the stored layout `(..., C)`."""

    name: Implementation

    def unavailable_reason(self) -> str:
        """Why this backend cannot run on the current platform ("" when it can)."""

    def amax(self, x: jax.Array, *, rht: bool) -> jax.Array:
        """Max |x| as f32 (after the RHT with `rht`); NaN if x is not finite."""

    def quantize(
        self,
        x,
        amax: jax.Array | None,
        seed: SRSeed | None,
        *,
        block_2d: bool,
        rht: bool,
        four_over_six: str | None = None,
        e4m3_max: int = 448,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(packed codes, scales, stored amax); `amax` None: computed; `seed` None: RN.

        `four_over_six` "mae" or "mse" (checked): Four Over Six with the E4M3 max `e4m3_max`.
        """

    def fake_quantize(
        self,
        x,
        amax,
        seed,
        *,
        block_2d: bool,
        rht: bool,
        global_scale: bool,
        dtype,
        four_over_six: str | None = None,
        e4m3_max: int = 448,
    ) -> jax.Array:
        """The dequantized values of `quantize` (no inverse RHT), in `dtype`."""

    def dequantize(self, codes, scales, decode_scale, *, rht: bool, dtype) -> jax.Array:
        """`value(code) * (f32(s_b) * D)` (the inverse RHT with `rht`) in `dtype`; D: f32."""

    def rht(self, x: jax.Array, *, inverse: bool) -> jax.Array:
        """The RHT (or its inverse) of every 16-group along the last axis."""


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
    """The pure-jnp specification."""

    name: Implementation = "reference"

    def unavailable_reason(self) -> str:
        """Always "": the reference runs wherever JAX runs."""
        return ""

    def amax(self, x, *, rht):
        """`reference.tensor_amax`."""
        return reference.tensor_amax(x, rht=rht)

    def quantize(self, x, amax, seed, *, block_2d, rht, four_over_six=None, e4m3_max=448):
        """(codes, scales, stored amax): `reference.quantize` of the stored layout."""
        return quantize_stored(
            x,
            amax,
            seed,
            block_2d=block_2d,
            rht=rht,
            four_over_six=four_over_six,
            e4m3_max=e4m3_max,
        )

    def fake_quantize(
        self,
        x,
        amax,
        seed,
        *,
        block_2d,
        rht,
        global_scale,
        dtype,
        four_over_six=None,
        e4m3_max=448,
    ):
        """`reference.fake_quantize` of the stored layout (checked by `ops`)."""
        return fake_quantize_stored(
            x,
            amax,
            seed,
            block_2d=block_2d,
            rht=rht,
            global_scale=global_scale,
            dtype=dtype,
            four_over_six=four_over_six,
            e4m3_max=e4m3_max,
        )

    def dequantize(self, codes, scales, decode_scale, *, rht, dtype):
        """`reference.dequantize` of the stored layout."""
        amax = decode_scale * 2688  # unused: the decode scale is given
        q = NVFP4Array(codes, scales, amax, dtype, -1, False, rht, decode_scale=decode_scale)
        return reference.dequantize(q, dtype)

    def rht(self, x, *, inverse):
        """`reference.apply_rht`."""
        return reference.apply_rht(x, inverse=inverse)


@dataclasses.dataclass(frozen=True)
class FfiBackend:
    """The native kernels (C++ on CPU, CUDA on NVIDIA GPUs)."""

    name: Implementation = "ffi"

    def unavailable_reason(self) -> str:
        """Why the native kernels cannot run on the current platform ("" when they can)."""
        return kernels.unavailable_reason()

    def amax(self, x, *, rht):
        """The `nvfp4_amax` kernel."""
        return kernels.amax(x, rht=rht)

    def quantize(self, x, amax, seed, *, block_2d, rht, four_over_six=None, e4m3_max=448):
        """The `nvfp4_quantize` kernel, after `nvfp4_amax` when no amax is given.

        Under Four Over Six its twin target `nvfp4_quantize_4over6`.
        """
        if amax is None:
            amax = kernels.amax(x, rht=rht)
        return kernels.quantize(
            x,
            amax,
            seed,
            block_2d=block_2d,
            rht=rht,
            four_over_six=four_over_six,
            e4m3_max=e4m3_max,
        )

    def fake_quantize(
        self,
        x,
        amax,
        seed,
        *,
        block_2d,
        rht,
        global_scale,
        dtype,
        four_over_six=None,
        e4m3_max=448,
    ):
        """The `nvfp4_fake_quantize` kernel, after `nvfp4_amax` when no amax is given.

        Under Four Over Six its twin target `nvfp4_fake_quantize_4over6`.
        """
        if amax is None:
            amax = kernels.amax(x, rht=rht)
        return kernels.fake_quantize(
            x,
            amax,
            seed,
            block_2d=block_2d,
            rht=rht,
            global_scale=global_scale,
            dtype=dtype,
            four_over_six=four_over_six,
            e4m3_max=e4m3_max,
        )

    def dequantize(self, codes, scales, decode_scale, *, rht, dtype):
        """The `nvfp4_dequantize` kernel."""
        return kernels.dequantize(codes, scales, decode_scale, rht=rht, dtype=dtype)

    def rht(self, x, *, inverse):
        """The `nvfp4_rht` kernel."""
        return kernels.rht(x, inverse=inverse)


REGISTRY: dict[str, Backend] = {"reference": ReferenceBackend(), "ffi": FfiBackend()}


def resolve(implementation: Implementation | None, op: str) -> Backend:
    """The backend that runs `op`: the one named; for None, "ffi" where it runs, else reference.

    Raises:
      ValueError: an unknown name, or a backend that cannot run on the current platform.
    """
    if implementation is None:
        ffi = REGISTRY["ffi"]
        return REGISTRY["reference"] if ffi.unavailable_reason() else ffi
    backend = REGISTRY.get(implementation) if isinstance(implementation, str) else None
    if backend is None:
        names = (None, *REGISTRY)
        raise ValueError(f"{op}: implementation must be one of {names}, got {implementation!r}")
    reason = backend.unavailable_reason()
    if reason:
        raise ValueError(
            f"{op}: implementation={implementation!r} was requested but cannot run: {reason}"
        )
    return backend
