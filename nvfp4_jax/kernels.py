"""The native kernels (XLA FFI custom calls): availability, ISA, registration.

The public face of `nvfp4_jax._src.core.kernels`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.core.kernels._amax import amax
from nvfp4_jax._src.core.kernels._dequantize import dequantize
from nvfp4_jax._src.core.kernels._gemm import gemm
from nvfp4_jax._src.core.kernels._grouped import grouped_quantize
from nvfp4_jax._src.core.kernels._library import (
    CPU_TARGETS,
    TARGETS,
    cpu_isa,
    current_platform,
    export_safety_checks,
    is_available,
    register,
    unavailable_reason,
)
from nvfp4_jax._src.core.kernels._partition import pmax_keep_nan
from nvfp4_jax._src.core.kernels._quantize import fake_quantize, quantize
from nvfp4_jax._src.core.kernels._rht import rht
from nvfp4_jax._src.core.kernels._threefry import (
    fold_in_words,
    is_threefry_key,
    split_bits_words,
    threefry2x32,
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
