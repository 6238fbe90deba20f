"""Per-layer NVFP4 error of a model's three GEMMs, and the rules it suggests.

The public face of `nvfp4_jax._src.model.diagnostics`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.model.diagnostics import (
    OPERANDS,
    SCORES,
    SHORT_NAMES,
    LayerStats,
    ModelReport,
    OperandStats,
    analyze_layer,
    angle_degrees,
    inspect_model,
    operand_stats,
)

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
