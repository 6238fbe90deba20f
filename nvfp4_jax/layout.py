"""The GEMM layout: padding to the kernels' alignment and the swizzled scale tiles.

The public face of `nvfp4_jax._src.core.layout`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.core.layout import (
    GEMM_ALIGNMENT,
    TILE_BYTES,
    TILE_COLS,
    TILE_ROWS,
    packed_shape,
    pad_to_alignment,
    scales_shape,
    swizzle_scales,
    swizzled_size,
    unpad,
    unswizzle_scales,
)

__all__ = [
    "GEMM_ALIGNMENT",
    "packed_shape",
    "pad_to_alignment",
    "scales_shape",
    "swizzle_scales",
    "swizzled_size",
    "TILE_BYTES",
    "TILE_COLS",
    "TILE_ROWS",
    "unpad",
    "unswizzle_scales",
]
