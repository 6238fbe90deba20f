"""The specification of nvfp4_jax's numbers as free, pure, jit-able jnp functions.

The public face of `nvfp4_jax._src.core.reference`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.core.formats import decode_scale
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
