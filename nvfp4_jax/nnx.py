"""Flax nnx layers that train with the NVFP4 recipe, and their frozen forms.

The public face of `nvfp4_jax._src.flax.nnx`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.flax.nnx import (
    Experts,
    FrozenExperts,
    FrozenLinear,
    InputAmax,
    InputScale,
    Linear,
    QuantizedKernel,
    calibrate,
)

__all__ = [
    "calibrate",
    "Experts",
    "FrozenExperts",
    "FrozenLinear",
    "InputAmax",
    "InputScale",
    "Linear",
    "QuantizedKernel",
]
