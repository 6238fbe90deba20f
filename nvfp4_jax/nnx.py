"""Flax nnx layers whose GEMMs run in NVFP4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4_jax.dot_general import constrain_output, dot_general
from nvfp4_jax.recipe import NVFP4Recipe


class Linear(nnx.Linear):
    """`flax.nnx.Linear` with NVFP4 forward, data-gradient and weight-gradient GEMMs.

    Takes `nnx.Linear`'s arguments (except `dot_general`) plus:

    Args:
      recipe: the `NVFP4Recipe`.
      rng_collection: the rng stream stochastic rounding draws a fresh key from on every call
        (falls back to `rngs`' default stream when `rngs` has no stream of that name).

    Example:
      >>> layer = Linear(64, 32, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((8, 64))).shape
      (8, 32)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: NVFP4Recipe = NVFP4Recipe(),
        rng_collection: str = "quantize",
        rngs: nnx.Rngs,
        **kwargs,
    ):
        if "dot_general" in kwargs:
            raise TypeError("nvfp4_jax.nnx.Linear: dot_general is fixed to the NVFP4 one")
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.recipe = recipe
        if recipe.stochastic_rounding:
            self.quantize_rngs = rngs[rng_collection].fork()
        else:
            self.quantize_rngs = nnx.data(None)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        """Applies the quantized linear map along the last axis of `inputs`."""
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        key = self.quantize_rngs() if self.quantize_rngs is not None else None
        y = dot_general(
            inputs,
            kernel,
            (((inputs.ndim - 1,), (0,)), ((), ())),
            self.precision,
            self.preferred_element_type,
            recipe=self.recipe,
            key=key,
        )
        y = constrain_output(y, out_sharding)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y
