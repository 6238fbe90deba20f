"""The specification of nvfp4_jax's numbers as free, pure, jit-able jnp functions.

Every function here is docs/NUMERICS.md written in jnp, with the same arguments as the
public op of the same name (minus `implementation`): call them to see what the library
computes, or to check another implementation against it. The public ops
(`nvfp4_jax.quantize`, ...) run these when `implementation="reference"`, and the native
kernels are tested against them bit for bit. The modules: `hadamard` (the RHT), `stochastic`
(the SR bits), `quantize` (the format's quantize, fake quantize and dequantize), `ms_eden`
(MS-EDEN's rotation and scales) and `kv_cache`; the face `nvfp4_jax.reference` re-exports
their public names, and this package holds no names of its own.

Example:
  >>> import jax.numpy as jnp
  >>> from nvfp4_jax import reference
  >>> q = reference.quantize(jnp.ones((4, 32)), block_2d=False)
  >>> reference.dequantize(q).shape
  (4, 32)
"""
