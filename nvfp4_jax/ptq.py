"""Post-training quantization for export: RTN, MSE and GPTQ scales, W4A16 and W4A4.

The public face of `nvfp4_jax._src.model.ptq`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.model.ptq import (
    ACTIVATIONS,
    DEFAULT_FUSED_GROUPS,
    DEFAULT_GPTQ_DAMP,
    DEFAULT_MSE_GRID,
    METHODS,
    PTQLayer,
    PTQReport,
    quantize_for_export,
)

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_FUSED_GROUPS",
    "DEFAULT_GPTQ_DAMP",
    "DEFAULT_MSE_GRID",
    "METHODS",
    "PTQLayer",
    "PTQReport",
    "quantize_for_export",
]
