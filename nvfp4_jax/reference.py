"""The specification of nvfp4_jax's numbers as free, pure, jit-able jnp functions.

The public face of `nvfp4_jax._src.core.reference`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.core.reference import (
    apply_rht,
    block_values,
    decode_scale,
    dequantize,
    encode_scale,
    fake_quantize,
    get_hadamard_matrix,
    get_rht_matrix,
    get_sign_from_vector,
    get_wgrad_sign_vector,
    quantize,
    random_bytes,
    stochastic_magnitude,
    tensor_amax,
)

__all__ = [
    "apply_rht",
    "block_values",
    "decode_scale",
    "dequantize",
    "encode_scale",
    "fake_quantize",
    "get_hadamard_matrix",
    "get_rht_matrix",
    "get_sign_from_vector",
    "get_wgrad_sign_vector",
    "quantize",
    "random_bytes",
    "stochastic_magnitude",
    "tensor_amax",
]
