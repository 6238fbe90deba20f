"""Per-layer NVFP4 error of a model's three GEMMs, and the rules it suggests.

The public face of `nvfp4_jax._src.model.diagnostics` (`numbers`, `report`, `inspection`): it
re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.model.diagnostics.inspection import inspect_model
from nvfp4_jax._src.model.diagnostics.numbers import (
    OPERANDS,
    LayerStats,
    OperandStats,
    analyze_layer,
    angle_degrees,
    operand_stats,
)
from nvfp4_jax._src.model.diagnostics.report import SCORES, SHORT_NAMES, ModelReport

__all__ = [
    "analyze_layer",
    "angle_degrees",
    "inspect_model",
    "LayerStats",
    "ModelReport",
    "operand_stats",
    "OPERANDS",
    "OperandStats",
    "SCORES",
    "SHORT_NAMES",
]
