"""Flax linen layers whose GEMMs run in NVFP4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from nvfp4_jax.dot_general import dot_general
from nvfp4_jax.recipe import NVFP4Recipe


class Dense(nn.Dense):
    """`flax.linen.Dense` with NVFP4 forward, data-gradient and weight-gradient GEMMs.

    Attributes:
      recipe: the `NVFP4Recipe`.
      rng_collection: the rng collection stochastic rounding draws its key from
        (`apply(..., rngs={"quantize": key})`). Without it, the key is derived from the
        incoming gradient's bits, which change from step to step.

    Example:
      >>> layer = Dense(32)
      >>> params = layer.init(jax.random.key(0), jnp.ones((8, 64)))
      >>> layer.apply(params, jnp.ones((8, 64))).shape
      (8, 32)
    """

    recipe: NVFP4Recipe = NVFP4Recipe()
    rng_collection: str = "quantize"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the quantized linear map along the last axis of `inputs`."""
        if self.dot_general is not None or self.dot_general_cls is not None:
            raise TypeError("nvfp4_jax.linen.Dense: dot_general is fixed to the NVFP4 one")
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        key = None
        if self.recipe.stochastic_rounding and self.has_rng(self.rng_collection):
            key = self.make_rng(self.rng_collection)
        y = dot_general(
            inputs,
            kernel,
            (((inputs.ndim - 1,), (0,)), ((), ())),
            self.precision,
            recipe=self.recipe,
            key=key,
        )
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y
