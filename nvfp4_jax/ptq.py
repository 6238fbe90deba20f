"""Post-training quantization for export: RTN, MSE and GPTQ scales, W4A16 and W4A4.

The public face of `nvfp4_jax._src.model.ptq` (`freeze`, `report`, `settings`): it re-exports
only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.flax.frozen import ACTIVATIONS
from nvfp4_jax._src.flax.walk import DEFAULT_FUSED_GROUPS
from nvfp4_jax._src.model.ptq.freeze import quantize_for_export
from nvfp4_jax._src.model.ptq.report import PTQLayer, PTQReport
from nvfp4_jax._src.model.ptq.settings import (
    DEFAULT_GPTQ_DAMP,
    DEFAULT_MSE_GRID,
    METHODS,
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
