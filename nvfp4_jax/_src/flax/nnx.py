"""Flax nnx layers whose GEMMs run in NVFP4, for training and for serving quantized weights.

`Linear` is `flax.nnx.Linear` with every GEMM of the forward and backward passes in NVFP4
(`NVFP4Recipe`). With `calibrate(model)` on, each layer records the largest activation
magnitude it sees (`input_amax`), which a W4A4 export turns into `input_scale`.

`FrozenLinear` (built by `Linear.from_quantized`, e.g. from `nvfp4_jax.load_hf_checkpoint`)
computes with a frozen, already quantized weight: weight-only (activations in high precision,
what engines serve as "W4A16_NVFP4") or W4A4 (activations quantized with the static input
scale, what engines serve as "NVFP4"), computed as vLLM's emulation does: both operands
dequantized, then one matmul in the activations' dtype. It is a `Linear` (it calibrates
alike), whose weight no optimizer and no rule touches.

`Experts` holds the G weight matrices of a mixture-of-experts layer as one (G, in, out)
kernel and multiplies each expert's tokens with its own matrix, in NVFP4 (each expert's weight
and each expert's tokens their own tensors) or in high precision (`recipe=None`): dropless,
with tokens sorted by expert and `group_sizes` (`nvfp4_jax.ragged_dot`), or dropping, with
tokens dispatched into a (G, capacity, in) tensor (the batched `nvfp4_jax.dot_general`).
`FrozenExperts` (built by `Experts.from_quantized`) does so with frozen NVFP4 weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4_jax._src.core import checks, formats
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.sr_keys import step_key
from nvfp4_jax._src.flax import frozen
from nvfp4_jax._src.flax.frozen import Activations
from nvfp4_jax._src.training import weight_only
from nvfp4_jax._src.training.dot_general import constrain_output, dot_general
from nvfp4_jax._src.training.ragged.groups import group_amax
from nvfp4_jax._src.training.ragged.ragged_dot import ragged_dot
from nvfp4_jax._src.training.recipe import NVFP4Recipe

# The names the messages of a frozen layer give: the constructors users call.
_FROZEN_LINEAR = "Linear.from_quantized"
_FROZEN_EXPERTS = "Experts.from_quantized"


class InputAmax(nnx.Variable):
    """The largest |input| a layer has seen in calibration (an f32 scalar; not a parameter)."""


class InputScale(nnx.Variable):
    """A checkpoint's static activation scale (`input_amax * RCP2688`), kept bit for bit."""


class QuantizedKernel(nnx.Variable):
    """A frozen NVFP4 weight (an `NVFP4Array`): not an `nnx.Param`, so optimizers skip it."""


def _step_key(stream: nnx.RngStream | None, recipe: NVFP4Recipe | None):
    """The next key of a layer's SR stream (None without one): `stream()`, bit for bit.

    The stream's key folded with its count, then the count advances, as nnx does, but hashed
    by `keys.step_key`: one native custom call on the CPU instead of XLA's rolled
    threefry loop.
    """
    if stream is None:
        return None
    implementation = None if recipe is None else recipe.implementation
    key = step_key(stream.key[...], stream.count[...], implementation)
    stream.count[...] += 1
    return key


class Linear(nnx.Linear):
    """`flax.nnx.Linear` with NVFP4 forward, data-gradient and weight-gradient GEMMs.

    Takes `nnx.Linear`'s arguments (except `dot_general`) plus:

    Args:
      recipe: the `NVFP4Recipe`.
      rng_collection: the rng stream stochastic rounding draws a fresh key from on every call
        (falls back to `rngs`' default stream when `rngs` has no stream of that name).

    Attributes:
      input_amax: `InputAmax`, the running max of |inputs| recorded while calibrating
        (0 until then).
      calibrating: record `input_amax` on every call (see `calibrate`).

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
        if recipe.random_backward:
            self.quantize_rngs = rngs[rng_collection].fork()
        else:
            self.quantize_rngs = nnx.data(None)
        self.input_amax = InputAmax(jnp.zeros((), jnp.float32))
        self.calibrating = False

    @classmethod
    def from_quantized(
        cls,
        kernel: NVFP4Array,
        *,
        bias: jax.Array | None = None,
        input_scale: jax.Array | None = None,
        activations: Activations = "high_precision",
        dtype=jnp.bfloat16,
    ) -> FrozenLinear:
        """A `FrozenLinear`: a frozen NVFP4 weight, an (in, out) kernel quantized along in.

        Args:
          kernel: the weight, an `NVFP4Array` of logical shape (in, out) quantized along axis
            0 (what `load_hf_checkpoint` gives for a linear: the HF (out, in) bytes).
          bias: an optional (out,) float bias (a trainable `nnx.Param`); another shape is a
            `ValueError`, another dtype a `TypeError`.
          input_scale: the static activation scale of W4A4 (`input_amax * RCP2688`, the
            checkpoint's `.input_scale`); required with `activations="nvfp4"`. A concrete
            NaN, inf or negative one is a `ValueError`; once stored in the layer it is data
            (a traced one, or one restored or calibrated into it): then W4A4 outputs NaN.
          activations: "high_precision" (weight-only) or "nvfp4" (W4A4: the inputs are
            quantized in 1x16 blocks with the tensor amax `input_scale * 2688`; larger
            values saturate).
          dtype: the dtype activations and the dequantized weight are multiplied in.

        The layer is differentiable in its inputs (`gemm.weight_only_matmul`: the gradient
        of `x @ dequantize(W)` at every batch size); the weight has no gradient.

        Example:
          >>> import jax.numpy as jnp, nvfp4_jax
          >>> q = nvfp4_jax.quantize(jnp.ones((64, 32)), axis=0)
          >>> nvfp4_jax.nnx.Linear.from_quantized(q)(jnp.ones((2, 64))).shape
          (2, 32)
        """
        return FrozenLinear(
            kernel, bias=bias, input_scale=input_scale, activations=activations, dtype=dtype
        )

    def _record(self, inputs: jax.Array) -> None:
        seen = jnp.max(jnp.abs(inputs.astype(jnp.float32)), initial=jnp.float32(0))
        self.input_amax[...] = jnp.maximum(self.input_amax[...], jax.lax.stop_gradient(seen))

    def _product(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(`inputs @ kernel` through the NVFP4 `dot_general`, the bias), in the layer's dtype."""
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        key = _step_key(self.quantize_rngs, self.recipe)
        y = dot_general(
            inputs,
            kernel,
            (((inputs.ndim - 1,), (0,)), ((), ())),
            self.precision,
            self.preferred_element_type,
            recipe=self.recipe,
            key=key,
        )
        return y, bias

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        """Applies the quantized linear map along the last axis of `inputs`."""
        if self.calibrating:
            self._record(inputs)
        y, bias = self._product(inputs)
        y = constrain_output(y, out_sharding)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)
        return y


class FrozenLinear(Linear):
    """A `Linear` computing with a frozen NVFP4 weight (what `Linear.from_quantized` builds).

    The weight is a `QuantizedKernel` (an `NVFP4Array`, not an `nnx.Param`: optimizers skip
    it, and `quantize_model`'s rules leave the layer as it is); the bias stays trainable.
    Weight-only, or W4A4 with `activations="nvfp4"`, as `Linear.from_quantized` says; the
    layer calibrates as a `Linear` does, its `input_scale` following the recorded amax.

    Args:
      kernel: the (in, out) `NVFP4Array` quantized along axis 0.
      bias: an optional (out,) bias.
      input_scale: the static activation scale of W4A4 (`input_amax * RCP2688`).
      activations: "high_precision" (weight-only) or "nvfp4" (W4A4).
      dtype: the dtype activations and the dequantized weight are multiplied in.

    Attributes:
      activations: "high_precision" or "nvfp4".
      input_amax: `InputAmax`, the amax W4A4 quantizes the inputs with (`input_scale * 2688`).
      input_scale: `InputScale`, the checkpoint's scale, kept bit for bit.
    """

    def __init__(
        self,
        kernel: NVFP4Array,
        *,
        bias: jax.Array | None = None,
        input_scale: jax.Array | None = None,
        activations: Activations = "high_precision",
        dtype=jnp.bfloat16,
    ):
        frozen.check_linear(kernel, activations, input_scale, _FROZEN_LINEAR)
        in_features, out_features = kernel.shape
        frozen.check_bias(bias, out_features, _FROZEN_LINEAR)
        dtype = checks.check_dtype(dtype, _FROZEN_LINEAR)
        scale = frozen.input_scale_of(input_scale, _FROZEN_LINEAR)
        super().__init__(
            in_features,
            out_features,
            use_bias=bias is not None,
            dtype=dtype,
            recipe=NVFP4Recipe(stochastic_rounding=False),
            kernel_init=_no_weight,
            bias_init=_no_weight,
            rngs=nnx.Rngs(0),
        )
        self.kernel = QuantizedKernel(kernel)
        if bias is not None:
            self.bias = nnx.Param(jnp.asarray(bias))
        # The amax W4A4 quantizes with; the scale itself is kept too, so that exporting the
        # layer again writes the checkpoint's `input_scale` bits (amax * RCP2688 may not).
        self.input_amax = InputAmax(scale * 2688)
        self.input_scale = InputScale(scale)
        self.activations = activations

    def _record(self, inputs: jax.Array) -> None:
        super()._record(inputs)
        self.input_scale[...] = formats.decode_scale(self.input_amax[...])

    def _product(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(`inputs @ W` with the frozen weight, weight-only or W4A4; the bias)."""
        # The stored amax is data: a NaN/inf/negative one gives NaN, eagerly as under jit.
        amax = self.input_amax[...] if self.activations == "nvfp4" else None
        y = frozen.linear_product(
            inputs,
            self.kernel.get_value(),
            dtype=self.dtype or inputs.dtype,
            input_amax=amax,
            preferred_element_type=self.preferred_element_type,
        )
        return y, self.bias[...] if self.bias is not None else None


def _no_weight(key, shape, dtype) -> jax.Array:
    """The placeholder a frozen layer's float weight starts as (replaced; never allocated)."""
    del key, shape
    return jnp.zeros((0,), dtype)


class Experts(nnx.Module):
    """The linear maps of G experts, `(G, in, out)`, for mixture-of-experts layers.

    Called with tokens sorted by expert and their `group_sizes` (dropless MoE), it computes
    `nvfp4_jax.ragged_dot(inputs, kernel, group_sizes)`: the rows of group g times expert g's
    matrix; rows past `sum(group_sizes)` give zeros. Called with `inputs` of shape
    (G, capacity, in) (dropping MoE: tokens dispatched per expert), it computes the batched
    `nvfp4_jax.dot_general`. Either way, with a recipe, each expert's GEMMs (forward, data
    gradient, weight gradient) run in NVFP4 with its own tensor amaxes, as a `Linear` per
    expert would; with `recipe=None` they run in high precision (`jax.lax.ragged_dot`,
    `jnp.einsum`), which is what a rule keeping the experts in bf16 gives.

    Args:
      num_experts: G.
      in_features: the input size (a multiple of 16 for NVFP4).
      out_features: the output size (a multiple of 16 for NVFP4).
      recipe: the `NVFP4Recipe`, or None for high precision.
      dtype: the computation dtype (default: the inputs').
      param_dtype: the kernel's dtype.
      kernel_init: initializes the (G, in, out) kernel (default: each expert's matrix as
        `nnx.Linear`'s default initializer would).
      rng_collection: the rng stream stochastic rounding draws a fresh key from per call.
      rngs: the `nnx.Rngs`.

    Attributes:
      input_amax: `InputAmax` of shape (G,): the running max of each expert's |inputs| while
        calibrating (see `calibrate`).

    Example:
      >>> experts = Experts(4, 64, 32, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((10, 64))
      >>> experts(x, jnp.array([3, 0, 5, 2])).shape
      (10, 32)
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        recipe: NVFP4Recipe | None = NVFP4Recipe(),
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=None,
        precision=None,
        rng_collection: str = "quantize",
        rngs: nnx.Rngs,
    ):
        for name, value in (
            ("num_experts", num_experts),
            ("in_features", in_features),
            ("out_features", out_features),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"nvfp4_jax.nnx.Experts: {name} must be a positive int, got {value!r}"
                )
        if recipe is not None and not isinstance(recipe, NVFP4Recipe):
            raise TypeError(
                f"nvfp4_jax.nnx.Experts: recipe must be an NVFP4Recipe or None, got {recipe!r}"
            )
        shape = (num_experts, in_features, out_features)
        if kernel_init is None:
            kernel_init = nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
            )
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))
        self.num_experts, self.in_features, self.out_features = shape
        self.dtype, self.precision = dtype, precision
        self.rng_collection = rng_collection
        self.recipe = recipe
        self.quantize_rngs = nnx.data(None)
        self.set_recipe(recipe, rngs)
        self.input_amax = InputAmax(jnp.zeros((num_experts,), jnp.float32))
        self.calibrating = False

    def set_recipe(self, recipe: NVFP4Recipe | None, rngs: nnx.Rngs | None = None) -> None:
        """Computes with `recipe` from now on (None: high precision); the kernel stays.

        A recipe with stochastic rounding needs an rng stream: forked from `rngs` (its
        `rng_collection` stream, else its default), or the layer's own if it has one.
        """
        if recipe is not None and recipe.random_backward and self.quantize_rngs is None:
            if rngs is None:
                raise ValueError(
                    "nvfp4_jax.nnx.Experts: a stochastic-rounding recipe needs rngs to draw "
                    "its keys from"
                )
            self.quantize_rngs = rngs[self.rng_collection].fork()
        self.recipe = recipe

    @classmethod
    def from_quantized(cls, kernel: NVFP4Array, *, dtype=jnp.bfloat16) -> FrozenExperts:
        """`FrozenExperts`: frozen NVFP4 weights (weight-only), a `(G, in, out)` stack.

        Args:
          kernel: the G experts' weights, an `NVFP4Array` of logical shape (G, in, out)
            quantized along `in` with one tensor amax per expert, (G,) (what
            `load_hf_checkpoint` gives for an MoE layer's experts), or one for all.
          dtype: the dtype activations and the dequantized weights are multiplied in.

        Called with `group_sizes` it computes `gemm.weight_only_ragged_dot` (on the CPU the
        native weight-only kernel for up to `gemm.WEIGHT_ONLY_MAX_ROWS` rows, decoding each
        expert's weight in registers); with (G, capacity, in) inputs, each expert's
        `gemm.weight_only_matmul`. The weights are not trainable (`QuantizedKernel`); the
        layer is differentiable in its inputs (the gradient of the dequantized experts'
        product at every batch size). `input_amax` starts at zeros, as a `Linear`'s does;
        `calibrate` records it.

        Example:
          >>> import jax, jax.numpy as jnp, nvfp4_jax
          >>> w = jnp.ones((4, 64, 32))
          >>> q = jax.tree.map(lambda *l: jnp.stack(l), *[nvfp4_jax.quantize(e, axis=0) for e in w])
          >>> experts = nvfp4_jax.nnx.Experts.from_quantized(q)
          >>> experts(jnp.ones((10, 64)), jnp.array([3, 0, 5, 2])).shape
          (10, 32)
        """
        return FrozenExperts(kernel, dtype=dtype)

    def _record(self, inputs: jax.Array, group_sizes: jax.Array | None) -> None:
        seen = group_amax(inputs, group_sizes, self.num_experts)
        self.input_amax[...] = jnp.maximum(self.input_amax[...], jax.lax.stop_gradient(seen))

    def __call__(self, inputs: jax.Array, group_sizes: jax.Array | None = None) -> jax.Array:
        """Each expert's tokens times its matrix: (M, in) with `group_sizes`, or (G, C, in)."""
        g, k = self.num_experts, self.in_features
        if group_sizes is None and (inputs.ndim != 3 or inputs.shape[::2] != (g, k)):
            raise ValueError(
                f"nvfp4_jax.nnx.Experts: without group_sizes, inputs must be ({g}, capacity, "
                f"{k}) (tokens dispatched per expert), got {inputs.shape}"
            )
        if group_sizes is not None and (inputs.ndim != 2 or inputs.shape[1] != k):
            raise ValueError(
                f"nvfp4_jax.nnx.Experts: with group_sizes, inputs must be (tokens, {k}) sorted "
                f"by expert, got {inputs.shape}"
            )
        if self.calibrating:
            self._record(inputs, group_sizes)
        return self._product(inputs, group_sizes)

    def _product(self, inputs: jax.Array, group_sizes: jax.Array | None) -> jax.Array:
        """The experts' GEMMs: in NVFP4 with the recipe, else in high precision."""
        dtype = self.dtype or jnp.result_type(inputs, self.kernel[...])
        inputs, kernel = inputs.astype(dtype), self.kernel[...].astype(dtype)
        if self.recipe is None:
            if group_sizes is None:
                return jnp.einsum("gck,gkn->gcn", inputs, kernel, precision=self.precision)
            return weight_only.lax_ragged_dot(inputs, kernel, group_sizes, self.precision)
        key = _step_key(self.quantize_rngs, self.recipe)
        if group_sizes is None:
            dims = (((2,), (1,)), ((0,), (0,)))
            return dot_general(inputs, kernel, dims, recipe=self.recipe, key=key)
        return ragged_dot(inputs, kernel, group_sizes, recipe=self.recipe, key=key)


class FrozenExperts(Experts):
    """`Experts` computing with frozen NVFP4 weights (what `Experts.from_quantized` builds).

    Weight-only: each expert's tokens times its dequantized weight, in `dtype`, as
    `Experts.from_quantized` says. The weights are a `QuantizedKernel` (not trainable; rules
    leave the layer as it is) and `recipe` is None; the layer calibrates as `Experts` does.

    Args:
      kernel: the (G, in, out) `NVFP4Array` quantized along in, one amax per expert or one
        for all, without the RHT.
      dtype: the dtype activations and the dequantized weights are multiplied in.
    """

    def __init__(self, kernel: NVFP4Array, *, dtype=jnp.bfloat16):
        frozen.check_experts(kernel, _FROZEN_EXPERTS)
        dtype = checks.check_dtype(dtype, _FROZEN_EXPERTS)
        # `input_amax` starts at zeros (calibration fills it), as a `Linear`'s.
        super().__init__(*kernel.shape, recipe=None, kernel_init=_no_weight, rngs=nnx.Rngs(0))
        self.kernel = QuantizedKernel(kernel)
        self.dtype = dtype

    def _product(self, inputs: jax.Array, group_sizes: jax.Array | None) -> jax.Array:
        """Each expert's tokens times its dequantized weight (`frozen.experts_product`)."""
        return frozen.experts_product(inputs, self.kernel.get_value(), group_sizes, self.dtype)


def calibrate(model: nnx.Module, enabled: bool = True) -> int:
    """Turns recording of `input_amax` on (or off) in every `Linear` and `Experts` of `model`.

    Run a few representative batches through the model with it on, then turn it off; the
    recorded amaxes are what a W4A4 export writes as `input_scale`.

    Returns:
      The number of layers switched.
    """
    enabled = checks.check_flag(enabled, "calibrate", "enabled")
    count = 0
    for _, module in nnx.iter_graph(model):
        if isinstance(module, (Linear, Experts)):
            module.calibrating = enabled
            count += 1
    return count
