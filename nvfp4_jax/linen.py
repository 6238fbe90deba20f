"""Flax linen layers that train with the NVFP4 recipe.

The public face of `nvfp4_jax._src.flax.linen`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.flax.linen import (
    Dense,
    Experts,
)

__all__ = [
    "Dense",
    "Experts",
]
