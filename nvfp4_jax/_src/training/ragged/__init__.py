"""`ragged_dot`, the grouped GEMMs of a dropless mixture-of-experts layer, in NVFP4.

`ragged_dot` (the op and its custom_vjp, in `ragged_dot.py`) builds on the modules beside
it, one concern each: `groups` (the group layout, each group's amax) < `sr` (the SR bytes
at each group's positions); `blocks` (the block math with an amax per row or block);
`operands` (every group and expert quantized as its own tensor); `grouped_gemm`
(`jax.lax.ragged_dot_general`'s forms, batched under `vmap`). This package holds no names
of its own.
"""
