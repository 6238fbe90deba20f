"""The native kernels: loading, one `ffi_call` per XLA FFI target, each with its sharding rule.

Every function takes the *stored layout* (the quantized axis last, C a multiple of 16) and
arguments the public ops (`nvfp4_jax.ops`) have already checked; each raises a ValueError
saying why when the native library cannot run on the current platform. One module per
target: `_amax`, `_quantize` (quantize and fake quantize, each taking the `QuantSpec` whole),
`_dequantize`, `_rht`, `_gemm` (the NVFP4 GEMM and the weight-only GEMM, CPU only),
`_grouped` (ragged_dot's grouped quantize, CPU only), `_threefry` (the hash of the SR keys,
CPU only), `_kv_cache` (the NVFP4 KV cache's write, read and attention, CPU only). Which of them
runs where is `backends.runs_natively`'s question, asked nowhere else.
"""

from nvfp4_jax._src.core.kernels._amax import amax
from nvfp4_jax._src.core.kernels._dequantize import dequantize
from nvfp4_jax._src.core.kernels._gemm import gemm, w4a16
from nvfp4_jax._src.core.kernels._grouped import grouped_quantize
from nvfp4_jax._src.core.kernels._kv_cache import kv_attention, kv_cache_read, kv_cache_write
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
    bits_words,
    fold_in_words,
    is_threefry_key,
    split_bits_words,
    threefry2x32,
)

__all__ = [
    "CPU_TARGETS",
    "TARGETS",
    "amax",
    "bits_words",
    "cpu_isa",
    "current_platform",
    "dequantize",
    "export_safety_checks",
    "fold_in_words",
    "fake_quantize",
    "gemm",
    "grouped_quantize",
    "is_available",
    "is_threefry_key",
    "kv_attention",
    "kv_cache_read",
    "kv_cache_write",
    "pmax_keep_nan",
    "quantize",
    "register",
    "rht",
    "split_bits_words",
    "threefry2x32",
    "unavailable_reason",
    "w4a16",
]
