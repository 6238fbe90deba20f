"""The specification of nvfp4_jax's numbers as free, pure, jit-able jnp functions.

Every function here is docs/NUMERICS.md written in jnp, with the same arguments as the
public op of the same name (minus `implementation`): call them to see what the library
computes, or to check another implementation against it. The public ops
(`nvfp4_jax.quantize`, ...) run these when `implementation="reference"`, and the native
kernels are tested against them bit for bit.

Example:
  >>> import jax.numpy as jnp
  >>> from nvfp4_jax import reference
  >>> q = reference.quantize(jnp.ones((4, 32)), block_2d=False)
  >>> reference.dequantize(q).shape
  (4, 32)
"""

from nvfp4_jax._src.core.reference.hadamard import (
    apply_rht,
    get_hadamard_matrix,
    get_rht_matrix,
    get_sign_from_vector,
    get_wgrad_sign_vector,
)
from nvfp4_jax._src.core.reference.ms_eden import (
    apply_rotation,
    block_uniforms,
    rotation_words,
    round_scale,
)
from nvfp4_jax._src.core.reference.ms_eden import decode_scale as ms_eden_decode_scale
from nvfp4_jax._src.core.reference.ms_eden import encode_scale as ms_eden_encode_scale
from nvfp4_jax._src.core.reference.quantize import (
    block_values,
    decode_scale,
    dequantize,
    encode_scale,
    fake_quantize,
    quantize,
    tensor_amax,
)
from nvfp4_jax._src.core.reference.stochastic import random_bytes, stochastic_magnitude

__all__ = [
    "apply_rht",
    "apply_rotation",
    "block_uniforms",
    "block_values",
    "decode_scale",
    "dequantize",
    "encode_scale",
    "fake_quantize",
    "get_hadamard_matrix",
    "get_rht_matrix",
    "get_sign_from_vector",
    "get_wgrad_sign_vector",
    "ms_eden_decode_scale",
    "ms_eden_encode_scale",
    "quantize",
    "random_bytes",
    "rotation_words",
    "round_scale",
    "stochastic_magnitude",
    "tensor_amax",
]
