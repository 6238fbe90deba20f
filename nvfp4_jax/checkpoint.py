"""Orbax checkpoints of models that hold NVFP4 arrays: atomic saves, exact restores.

The public face of `nvfp4_jax._src.io.checkpoint` (`format`, `save`, `restore`): it
re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.io.checkpoint.format import FORMAT, FORMAT_V1, FORMAT_V2, POINTER
from nvfp4_jax._src.io.checkpoint.restore import restore_checkpoint
from nvfp4_jax._src.io.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT",
    "FORMAT_V1",
    "FORMAT_V2",
    "POINTER",
    "restore_checkpoint",
    "save_checkpoint",
]
