"""The implementations of the public ops, and the one place that decides which one runs.

Every implementation computes the same bits (docs/NUMERICS.md) on the *stored layout* (the
quantized axis last) with arguments the public ops in `nvfp4_jax.ops` have already checked:

* `"reference"`: the pure-jnp specification (`nvfp4_jax.reference`); runs wherever JAX runs.
* `"ffi"`: the native XLA FFI kernels (`nvfp4_jax.kernels`: C++ on CPU, CUDA on NVIDIA
  GPUs). Asking for it where it cannot run is an error that says why; it never falls back.

`resolve(None, op)` picks "ffi" when its kernels run on the current platform, else
"reference". The backend is always an argument, never an environment variable.

This module is also the one place that answers "does this run natively here?": every
implementation says which of the ops whose native kernel runs only on some platforms, or for
some arguments, it runs natively (`Backend.runs_natively`), and `runs_natively(op,
implementation, ...)` asks the backend an implementation resolves to. The quantizing ops run
natively wherever the native library does; the NVFP4 GEMM, the weight-only GEMM, the grouped
quantize of `ragged_dot`, the hash of the SR keys and the NVFP4 KV cache's write and read
(`kv_cache`) and attention (`kv_attention`) only on the CPU (the GEMM with AVX2 or AVX-512,
the weight-only GEMM for small bf16/f16 batches, the attention for up to
`KV_ATTENTION_MAX_TOKENS` new tokens); `jax.nn.scaled_matmul`'s cuDNN GEMM
on Blackwell GPUs (`scaled_matmul_unsupported_reason`). Callers never ask the platform.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal, Protocol

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import checks
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.kernels._amax import amax as native_amax
from nvfp4_jax._src.core.kernels._dequantize import dequantize as native_dequantize
from nvfp4_jax._src.core.kernels._library import cpu_isa, current_platform, unavailable_reason
from nvfp4_jax._src.core.kernels._quantize import fake_quantize as native_fake_quantize
from nvfp4_jax._src.core.kernels._quantize import quantize as native_quantize
from nvfp4_jax._src.core.kernels._rht import rht as native_rht
from nvfp4_jax._src.core.reference import ms_eden
from nvfp4_jax._src.core.reference.hadamard import apply_rht as reference_apply_rht
from nvfp4_jax._src.core.reference.quantize import dequantize as reference_dequantize
from nvfp4_jax._src.core.reference.quantize import fake_quantize_stored, quantize_stored
from nvfp4_jax._src.core.reference.quantize import tensor_amax as reference_tensor_amax
from nvfp4_jax._src.core.spec import QuantSpec
from nvfp4_jax._src.core.sr_seed import SRSeed

Implementation = Literal["reference", "ffi"]
# The ops whose native kernels run only on some platforms, or for some arguments.
NativeOp = Literal[
    "quantize",
    "gemm",
    "weight_only_gemm",
    "grouped_quantize",
    "sr_key_hash",
    "kv_cache",
    "kv_attention",
]
NATIVE_OPS = typing.get_args(NativeOp)
# Up to this many rows of activations (tokens) the native weight-only GEMM runs; above it the
# weight is dequantized and XLA's dot runs (prefill-sized batches, where a dense GEMM of the
# dequantized weight is faster than decoding the weight again for every few rows).
WEIGHT_ONLY_MAX_ROWS = 32
# Up to this many new tokens per sequence the native KV cache attention runs (decode); a
# longer prefill dequantizes the cache and runs XLA's dots, whose GEMMs reuse each key for
# many queries (the native kernel keeps partial results per query and chunk of the cache).
KV_ATTENTION_MAX_TOKENS = 16
# The first compute capability whose tensor cores run block-scaled FP4 (Blackwell, sm_100).
SCALED_MATMUL_MIN_CAPABILITY = 10.0


class Backend(Protocol):
    """What an implementation provides: the five operations on the stored layout `(..., C)`."""

    name: Implementation

    def unavailable_reason(self) -> str:
        """Why this backend cannot run on the current platform ("" when it can)."""

    def runs_natively(self, op: NativeOp, **args) -> bool:
        """Whether this backend runs `op` as a native kernel here, for these arguments.

        `args` are the op's: `x_shape`, `x_dtype` and `q` for "weight_only_gemm"; `tokens`
        (new tokens per sequence) for "kv_attention".
        """

    def amax(self, x: jax.Array, rotation: jax.Array | None = None, *, rht: bool) -> jax.Array:
        """Max |x| as f32, NaN if a value is not finite.

        After the RHT with `rht`; of MS-EDEN's rotated x when `rotation` is given.
        """

    def quantize(
        self, x, amax: jax.Array | None, seed: SRSeed | None, rotation, spec: QuantSpec
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(packed codes, scales, stored amax); `amax` None: computed; `seed` None: RN.

        `spec` is checked and of the stored layout (`QuantSpec.stored`); `rotation`: MS-EDEN's
        uint32 (4,) words when `spec.ms_eden`, else None.
        """

    def fake_quantize(self, x, amax, seed, rotation, spec: QuantSpec) -> jax.Array:
        """The dequantized values of `quantize` (no inverse transform), in `spec.dtype`."""

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

    def runs_natively(self, op, **args):
        """Never: the reference is pure jnp (its programs hold no custom call)."""
        del op, args
        return False

    def amax(self, x, rotation=None, *, rht):
        """`reference.tensor_amax`, or of MS-EDEN's rotated x."""
        if rotation is not None:
            return ms_eden.tensor_amax_stored(x, rotation)
        return reference_tensor_amax(x, rht=rht)

    def quantize(self, x, amax, seed, rotation, spec):
        """(codes, scales, stored amax): `reference.quantize` of the stored layout."""
        if spec.ms_eden:
            return ms_eden.quantize_stored(x, amax, seed, rotation)
        return quantize_stored(x, amax, seed, spec)

    def fake_quantize(self, x, amax, seed, rotation, spec):
        """`reference.fake_quantize` of the stored layout (checked by `ops`)."""
        if spec.ms_eden:
            return ms_eden.fake_quantize_stored(
                x, amax, seed, rotation, global_scale=spec.global_scale, dtype=spec.dtype
            )
        return fake_quantize_stored(x, amax, seed, spec)

    def dequantize(self, codes, scales, decode_scale, *, rht, dtype):
        """`reference.dequantize` of the stored layout."""
        amax = decode_scale * 2688  # unused: the decode scale is given
        q = NVFP4Array(codes, scales, amax, dtype, -1, False, rht, decode_scale=decode_scale)
        return reference_dequantize(q, dtype)

    def rht(self, x, *, inverse):
        """`reference.apply_rht`."""
        return reference_apply_rht(x, inverse=inverse)


@dataclasses.dataclass(frozen=True)
class FfiBackend:
    """The native kernels (C++ on CPU, CUDA on NVIDIA GPUs)."""

    name: Implementation = "ffi"

    def unavailable_reason(self) -> str:
        """Why the native kernels cannot run on the current platform ("" when they can)."""
        return unavailable_reason()

    def runs_natively(self, op, **args):
        """Whether the native kernels run `op` here (see the module docstring).

        On the CPU the GEMM runs natively with the AVX2 or AVX-512 kernels only: the portable
        baseline's plain integer code (every non-x86 CPU) is 20x slower than XLA's f32 dot
        of the block values (`benchmarks/bench_gemm.py --isa baseline`); either way the
        result is the exact block products summed in f32, in the kernel's order or XLA's.
        """
        checks.check_choice("runs_natively: op", op, NativeOp)
        if self.unavailable_reason():
            return False
        if op == "quantize":
            return True
        if current_platform() != "cpu":  # the other kernels are CPU-only
            return False
        if op == "gemm":
            return cpu_isa() != "baseline"
        if op == "weight_only_gemm":
            return _weight_only_fits(**args)
        if op == "kv_attention":
            return args["tokens"] <= KV_ATTENTION_MAX_TOKENS
        return True

    def amax(self, x, rotation=None, *, rht):
        """The `nvfp4_amax` kernel (`nvfp4_amax_ms_eden` with a rotation)."""
        return native_amax(x, rht=rht, rotation=rotation)

    def quantize(self, x, amax, seed, rotation, spec):
        """The `nvfp4_quantize` kernel, after `nvfp4_amax` when no amax is given.

        Under Four Over Six its twin target `nvfp4_quantize_4over6`, under MS-EDEN
        `nvfp4_quantize_ms_eden`.
        """
        if amax is None:
            amax = native_amax(x, rht=spec.rht, rotation=rotation)
        return native_quantize(x, amax, seed, spec, rotation=rotation)

    def fake_quantize(self, x, amax, seed, rotation, spec):
        """The `nvfp4_fake_quantize` kernel, after `nvfp4_amax` when no amax is given.

        Under Four Over Six its twin target `nvfp4_fake_quantize_4over6`, under MS-EDEN
        `nvfp4_fake_quantize_ms_eden`.
        """
        if amax is None:
            amax = native_amax(x, rht=spec.rht, rotation=rotation)
        return native_fake_quantize(x, amax, seed, spec, rotation=rotation)

    def dequantize(self, codes, scales, decode_scale, *, rht, dtype):
        """The `nvfp4_dequantize` kernel."""
        return native_dequantize(codes, scales, decode_scale, rht=rht, dtype=dtype)

    def rht(self, x, *, inverse):
        """The `nvfp4_rht` kernel."""
        return native_rht(x, inverse=inverse)


def _weight_only_fits(*, x_shape, x_dtype, q: NVFP4Array) -> bool:
    """Whether the native weight-only GEMM (`nvfp4_w4a16`) takes `x @ dequantize(q)`.

    A 2-D `(in, out)` weight quantized along `in` without the RHT, activations in bf16 or
    f16, and at most `WEIGHT_ONLY_MAX_ROWS` rows. f32 activations keep XLA's f32 dot of the
    dequantized weight, bit for bit as before (the kernel computes them too,
    `_gemm.weight_only_matmul`, in its own summation order).
    """
    rows = 1
    for d in x_shape[:-1]:
        rows *= d
    return (
        len(q.codes.shape) == 2
        and q.axis == -2
        and not q.rht
        and jnp.ndim(q.amax) == 0
        and len(x_shape) >= 1
        and x_shape[-1] == q.stored_shape[-1]
        and jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and rows <= WEIGHT_ONLY_MAX_ROWS
    )


REGISTRY: dict[str, Backend] = {"reference": ReferenceBackend(), "ffi": FfiBackend()}


def runs_natively(op: NativeOp, implementation: Implementation | None, **args) -> bool:
    """Whether `op` runs as a native kernel for `implementation` here, for these arguments.

    The one place that answers it: the native kernels must run `op` here
    (`FfiBackend.runs_natively`), and `implementation` must resolve to them (named "ffi", or
    None where they run); "reference" never does. `args` as `Backend.runs_natively`'s.
    """
    if not REGISTRY["ffi"].runs_natively(op, **args):
        return False
    return resolve(implementation, op).runs_natively(op, **args)


def scaled_matmul_unsupported_reason() -> str | None:
    """Why `jax.nn.scaled_matmul` (cuDNN) cannot run NVFP4 GEMMs here, or None if it can."""
    platform = current_platform()
    if platform != "cuda":
        return f"the default platform is {platform!r}, not a CUDA GPU"
    device = jax.devices()[0]
    capability = float(getattr(device, "compute_capability", 0) or 0)
    if capability < SCALED_MATMUL_MIN_CAPABILITY:
        return (
            f"{device.device_kind} has compute capability {capability}; NVFP4 block-scaled "
            f"GEMMs need {SCALED_MATMUL_MIN_CAPABILITY} or newer (Blackwell)"
        )
    return None


def resolve(implementation: Implementation | None, op: str) -> Backend:
    """The backend that runs `op`: the one named; for None, "ffi" where it runs, else reference.

    Raises:
      ValueError: an unknown name, or a backend that cannot run on the current platform.
    """
    if implementation is None:
        ffi = REGISTRY["ffi"]
        return REGISTRY["reference"] if ffi.unavailable_reason() else ffi
    if not isinstance(implementation, str) or implementation not in REGISTRY:
        checks.check_choice(
            f"{op}: implementation", implementation, tuple(REGISTRY), allow_none=True
        )
    backend = REGISTRY[implementation]
    reason = backend.unavailable_reason()
    if reason:
        raise ValueError(
            f"{op}: implementation={implementation!r} was requested but cannot run: {reason}"
        )
    return backend
