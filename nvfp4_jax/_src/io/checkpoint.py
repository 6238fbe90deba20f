"""Saving and restoring NVFP4Arrays (and pytrees or Flax nnx states holding them) with orbax.

The checkpoint is three modules of one concern each: `checkpoint_format` (the layout on disk,
the metadata and its digests, the helpers both sides share), `checkpoint_save` (the atomic,
multi-process save) and `checkpoint_restore` (the checks, then the bit-exact restore). This
module gathers their public names for the face `nvfp4_jax.checkpoint`.

Example (an nnx model):
    save_checkpoint(path, nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Model(...)))
    model = nnx.merge(graphdef, restore_checkpoint(path, abstract))
"""

from nvfp4_jax._src.io.checkpoint_format import FORMAT, FORMAT_V1, FORMAT_V2, POINTER
from nvfp4_jax._src.io.checkpoint_restore import restore_checkpoint
from nvfp4_jax._src.io.checkpoint_save import save_checkpoint

__all__ = [
    "FORMAT",
    "FORMAT_V1",
    "FORMAT_V2",
    "POINTER",
    "restore_checkpoint",
    "save_checkpoint",
]
