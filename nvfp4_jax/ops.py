"""The public ops, each with its `implementation=` argument and derivative rules.

The public face of `nvfp4_jax._src.core.ops`: it re-exports only (docs/ARCHITECTURE.md).
The same functions are `nvfp4_jax.quantize`, `nvfp4_jax.dequantize`, ...; `block_values`
(the decoded values of every block, as the GEMM emulation multiplies them) lives here only.
"""

from nvfp4_jax._src.core.ops import (
    apply_rht,
    block_values,
    dequantize,
    fake_quantize,
    quantize,
    tensor_amax,
)

__all__ = [
    "apply_rht",
    "block_values",
    "dequantize",
    "fake_quantize",
    "quantize",
    "tensor_amax",
]
