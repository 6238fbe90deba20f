"""The native kernels (XLA FFI custom calls): availability, ISA, registration.

The public face of `nvfp4_jax._src.core.kernels`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.core.kernels import (
    CPU_TARGETS,
    TARGETS,
    amax,
    cpu_isa,
    current_platform,
    dequantize,
    export_safety_checks,
    fake_quantize,
    fold_in_words,
    gemm,
    grouped_quantize,
    is_available,
    is_threefry_key,
    pmax_keep_nan,
    quantize,
    register,
    rht,
    split_bits_words,
    threefry2x32,
    unavailable_reason,
)

__all__ = [
    "amax",
    "cpu_isa",
    "CPU_TARGETS",
    "current_platform",
    "dequantize",
    "export_safety_checks",
    "fake_quantize",
    "fold_in_words",
    "gemm",
    "grouped_quantize",
    "is_available",
    "is_threefry_key",
    "pmax_keep_nan",
    "quantize",
    "register",
    "rht",
    "split_bits_words",
    "TARGETS",
    "threefry2x32",
    "unavailable_reason",
]
