"""The NVFP4 GEMM: emulated, native, and `jax.nn.scaled_matmul` operands.

The public face of `nvfp4_jax._src.training.gemm`, `.recipe` (`GEMM_BACKENDS`), `.scaled_matmul`
and `.weight_only`: it
re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.training.gemm import (
    SCALED_MATMUL_MIN_CAPABILITY,
    NativeBlocks,
    Operand,
    array_operand,
    matmul,
    quantize_operand,
    resolve_gemm_backend,
    scaled_matmul,
    scaled_matmul_unsupported_reason,
    transpose_2d_blocks,
    uses_native_gemm,
)
from nvfp4_jax._src.training.recipe import GEMM_BACKENDS
from nvfp4_jax._src.training.scaled_matmul import (
    ScaledMatmulOperands,
    from_scaled_matmul_operands,
    to_scaled_matmul_operands,
)
from nvfp4_jax._src.training.weight_only import (
    WEIGHT_ONLY_MAX_ROWS,
    expert_weight,
    lax_ragged_dot,
    uses_native_weight_only,
    weight_only_matmul,
    weight_only_ragged_dot,
)

__all__ = [
    "array_operand",
    "expert_weight",
    "from_scaled_matmul_operands",
    "GEMM_BACKENDS",
    "lax_ragged_dot",
    "matmul",
    "NativeBlocks",
    "Operand",
    "quantize_operand",
    "resolve_gemm_backend",
    "scaled_matmul",
    "SCALED_MATMUL_MIN_CAPABILITY",
    "scaled_matmul_unsupported_reason",
    "ScaledMatmulOperands",
    "to_scaled_matmul_operands",
    "transpose_2d_blocks",
    "uses_native_gemm",
    "uses_native_weight_only",
    "weight_only_matmul",
    "WEIGHT_ONLY_MAX_ROWS",
    "weight_only_ragged_dot",
]
