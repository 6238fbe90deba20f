"""Saving and restoring NVFP4Arrays (and pytrees or Flax nnx states holding them) with orbax.

The checkpoint is three modules of one concern each: `format` (the layout on disk, the
metadata and its digests, the helpers both sides share) < `save` (the atomic, multi-process
save) and `restore` (the checks, then the bit-exact restore; neither side imports the
other). The face `nvfp4_jax.checkpoint` re-exports their public names; this package holds
no names of its own.

Example (an nnx model):
    save_checkpoint(path, nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Model(...)))
    model = nnx.merge(graphdef, restore_checkpoint(path, abstract))
"""
