"""Flax linen layers whose GEMMs run in NVFP4, for training and for serving quantized weights.

`Dense` is `flax.linen.Dense` with NVFP4 GEMMs. With `calibrate=True` it records the largest
activation magnitude it sees in the `calibration` collection (`apply(...,
mutable=["calibration"])`), which a W4A4 export turns into `input_scale`. When its `kernel`
parameter is an `NVFP4Array` (e.g. from `nvfp4_jax.load_hf_checkpoint`) it computes with that
frozen weight instead: weight-only, or W4A4 with `activations="nvfp4"` and the static
`input_scale` parameter beside the kernel, as vLLM's emulation does (both operands
dequantized, one matmul in the activations' dtype). Exclude the `NVFP4Array` leaves from the
optimizer (e.g. `optax.set_to_zero` through `optax.multi_transform`) to fine-tune the rest.

`Experts` is the linen twin of `nvfp4_jax.nnx.Experts`: the (G, in, out) kernel of a
mixture-of-experts layer, each expert's GEMMs in NVFP4 (`recipe=None`: high precision).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from nvfp4_jax._src.core import checks
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.flax import frozen
from nvfp4_jax._src.training import weight_only
from nvfp4_jax._src.training.dot_general import dot_general
from nvfp4_jax._src.training.ragged.groups import group_amax
from nvfp4_jax._src.training.ragged.ragged_dot import ragged_dot
from nvfp4_jax._src.training.recipe import NVFP4Recipe


class Dense(nn.Dense):
    """`flax.linen.Dense` with NVFP4 forward, data-gradient and weight-gradient GEMMs.

    Attributes:
      recipe: the `NVFP4Recipe`.
      rng_collection: the rng collection stochastic rounding draws its key from
        (`apply(..., rngs={"quantize": key})`). Without it, the key is derived from the
        incoming gradient's bits, which change from step to step.
      calibrate: record max |inputs| as `calibration/input_amax` (when that collection is
        mutable).
      activations: with an `NVFP4Array` kernel: "high_precision" (weight-only) or "nvfp4"
        (W4A4, quantized with the amax `input_scale * 2688` of the `input_scale` param; that
        param is data: a NaN, inf or negative one gives NaN, eagerly as under `jit`).

    Example:
      >>> layer = Dense(32)
      >>> params = layer.init(jax.random.key(0), jnp.ones((8, 64)))
      >>> layer.apply(params, jnp.ones((8, 64))).shape
      (8, 32)
    """

    recipe: NVFP4Recipe = NVFP4Recipe()
    rng_collection: str = "quantize"
    calibrate: bool = False
    activations: frozen.Activations = "high_precision"

    def _record(self, inputs: jax.Array) -> None:
        amax = self.variable("calibration", "input_amax", jnp.zeros, (), jnp.float32)
        if self.is_mutable_collection("calibration"):
            seen = jnp.max(jnp.abs(inputs.astype(jnp.float32)), initial=jnp.float32(0))
            amax.value = jnp.maximum(amax.value, jax.lax.stop_gradient(seen))

    def _quantized(self, inputs: jax.Array, kernel: NVFP4Array) -> jax.Array:
        """`inputs @ W` with the frozen weight (`frozen.linear_product`)."""
        amax = None
        if self.activations == "nvfp4":
            if not self.has_variable("params", "input_scale"):
                raise ValueError(
                    "nvfp4_jax.linen.Dense: activations='nvfp4' (W4A4) needs an 'input_scale' "
                    "parameter beside the NVFP4 kernel"
                )
            amax = jnp.asarray(self.get_variable("params", "input_scale"), jnp.float32) * 2688
            # A param is data: a NaN/inf/negative scale gives NaN, eagerly as under jit.
            amax = amax.reshape(())
        return frozen.linear_product(
            inputs, kernel, dtype=self.dtype or inputs.dtype, input_amax=amax
        )

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the quantized linear map along the last axis of `inputs`."""
        if self.dot_general is not None or self.dot_general_cls is not None:
            raise TypeError("nvfp4_jax.linen.Dense: dot_general is fixed to the NVFP4 one")
        checks.check_choice(
            "nvfp4_jax.linen.Dense: activations", self.activations, frozen.Activations
        )
        if self.calibrate:
            self._record(inputs)
        kernel = (
            self.get_variable("params", "kernel") if self.has_variable("params", "kernel") else None
        )
        if not isinstance(kernel, NVFP4Array):
            shape = (jnp.shape(inputs)[-1], self.features)
            kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        if isinstance(kernel, NVFP4Array):
            y = self._quantized(inputs, kernel)
        else:
            inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
            key = None
            if self.recipe.random_backward and self.has_rng(self.rng_collection):
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
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)
        return y


class Experts(nn.Module):
    """The linear maps of `num_experts` experts, a (G, in, out) `kernel` param, for MoE layers.

    The twin of `nvfp4_jax.nnx.Experts`: `apply(params, x, group_sizes)` with tokens (M, in)
    sorted by expert computes `nvfp4_jax.ragged_dot` (dropless); `apply(params, x)` with x of
    shape (G, capacity, in) the batched `nvfp4_jax.dot_general` (dropping). Each expert's
    GEMMs run in NVFP4 with its own tensor amaxes; with `recipe=None`, in high precision.

    Attributes:
      num_experts: G.
      features: the output size.
      recipe: the `NVFP4Recipe`, or None for high precision.
      dtype: the computation dtype (default: the inputs').
      param_dtype: the kernel's dtype.
      kernel_init: initializes the (G, in, out) kernel.
      precision: passed to the high-precision GEMMs.
      rng_collection: the rng collection stochastic rounding draws its key from (without it,
        the key derives from the incoming gradient's bits).
      calibrate: record each expert's max |inputs| as `calibration/input_amax` (G,) (when that
        collection is mutable).

    Example:
      >>> layer = Experts(num_experts=4, features=32)
      >>> x, sizes = jnp.ones((10, 64)), jnp.array([3, 0, 5, 2])
      >>> params = layer.init(jax.random.key(0), x, sizes)
      >>> layer.apply(params, x, sizes).shape
      (10, 32)
    """

    num_experts: int
    features: int
    recipe: NVFP4Recipe | None = NVFP4Recipe()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
    )
    precision: Any = None
    rng_collection: str = "quantize"
    calibrate: bool = False

    @nn.compact
    def __call__(self, inputs: jax.Array, group_sizes: jax.Array | None = None) -> jax.Array:
        """Each expert's tokens times its matrix: (M, in) with `group_sizes`, or (G, C, in)."""
        g, k = self.num_experts, jnp.shape(inputs)[-1]
        if group_sizes is None and (inputs.ndim != 3 or inputs.shape[0] != g):
            raise ValueError(
                f"nvfp4_jax.linen.Experts: without group_sizes, inputs must be ({g}, capacity, "
                f"in) (tokens dispatched per expert), got {inputs.shape}"
            )
        if group_sizes is not None and inputs.ndim != 2:
            raise ValueError(
                "nvfp4_jax.linen.Experts: with group_sizes, inputs must be (tokens, in) sorted "
                f"by expert, got {inputs.shape}"
            )
        kernel = self.param("kernel", self.kernel_init, (g, k, self.features), self.param_dtype)
        if self.calibrate:
            amax = self.variable("calibration", "input_amax", jnp.zeros, (g,), jnp.float32)
            if self.is_mutable_collection("calibration"):
                seen = jax.lax.stop_gradient(group_amax(inputs, group_sizes, g))
                amax.value = jnp.maximum(amax.value, seen)
        dtype = self.dtype or jnp.result_type(inputs, kernel)
        inputs, kernel = inputs.astype(dtype), kernel.astype(dtype)
        if self.recipe is None:
            if group_sizes is None:
                return jnp.einsum("gck,gkn->gcn", inputs, kernel, precision=self.precision)
            return weight_only.lax_ragged_dot(inputs, kernel, group_sizes, self.precision)
        key = None
        if self.recipe.random_backward and self.has_rng(self.rng_collection):
            key = self.make_rng(self.rng_collection)
        if group_sizes is None:
            dims = (((2,), (1,)), ((0,), (0,)))
            return dot_general(inputs, kernel, dims, recipe=self.recipe, key=key)
        return ragged_dot(inputs, kernel, group_sizes, recipe=self.recipe, key=key)
