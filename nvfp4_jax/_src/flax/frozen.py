"""Frozen NVFP4 weights: the checks of a quantized kernel and the products served with it.

A frozen layer computes with a weight already quantized (an `NVFP4Array`, e.g. from
`nvfp4_jax.load_hf_checkpoint`), as vLLM's emulation does: weight-only (activations in high
precision, what engines serve as "W4A16_NVFP4") or W4A4 (activations quantized with the
static input scale, "NVFP4"), both operands dequantized, then one matmul in the
activations' dtype. The nnx layers (`nvfp4_jax.nnx.FrozenLinear`, `FrozenExperts`) and the
linen `Dense` (with an `NVFP4Array` kernel) share these.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import checks, ops
from nvfp4_jax._src.core.array import NVFP4Array, validate_nvfp4_array
from nvfp4_jax._src.training import weight_only

Activations = Literal["high_precision", "nvfp4"]
ACTIVATIONS = get_args(Activations)


def check_linear(kernel: NVFP4Array, activations: str, input_scale, op: str) -> None:
    """Checks a frozen linear's kernel and mode.

    The kernel must be an (in, out) `NVFP4Array` quantized along in; W4A4
    (`activations="nvfp4"`) needs an `input_scale`.
    """
    validate_nvfp4_array(kernel, f"{op} kernel")
    if len(kernel.shape) != 2 or kernel.axis != -2:
        raise ValueError(
            f"{op}: kernel must be an (in, out) NVFP4Array quantized along axis 0 (in), got "
            f"{kernel!r}"
        )
    checks.check_choice(f"{op}: activations", activations, Activations)
    if activations == "nvfp4" and input_scale is None:
        raise ValueError(f"{op}: activations='nvfp4' (W4A4) needs input_scale")


def check_bias(bias, out_features: int, op: str) -> None:
    """Checks a frozen linear's optional bias: a float (out,) array, added along the last axis.

    Any other shape would broadcast (a scalar, (1, out)) or fail at the first call.
    """
    if bias is None:
        return
    shape = tuple(np.shape(bias))
    if shape != (out_features,):
        raise ValueError(f"{op}: bias must be ({out_features},), got {shape}")
    dtype = jnp.result_type(bias)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: bias must be a float array, got {dtype}")


def input_scale_of(input_scale, op: str) -> jax.Array:
    """A frozen linear's static input scale as an f32 scalar (0 without one).

    A concrete one must be finite and non-negative; a traced one is data.
    """
    scale = jnp.zeros((), jnp.float32) if input_scale is None else input_scale
    scale = jnp.asarray(scale, jnp.float32).reshape(())
    if not isinstance(scale, jax.core.Tracer) and not 0 <= float(scale) < float("inf"):
        raise ValueError(
            f"{op}: input_scale must be a finite, non-negative number, got {float(scale)}"
        )
    return scale


def check_experts(kernel: NVFP4Array, op: str) -> None:
    """Checks frozen experts' kernel: a (G, in, out) `NVFP4Array` along in, without the RHT."""
    validate_nvfp4_array(kernel, f"{op} kernel")
    if len(kernel.shape) != 3 or kernel.axis != -2 or kernel.rht:
        raise ValueError(
            f"{op}: kernel must be a (G, in, out) NVFP4Array quantized along axis 1 (in), "
            f"without the RHT, got {kernel!r}"
        )


def linear_product(
    inputs: jax.Array,
    kernel: NVFP4Array,
    *,
    dtype,
    input_amax: jax.Array | None = None,
    preferred_element_type=None,
) -> jax.Array:
    """`inputs @ W` with the frozen weight, in `dtype`: weight-only, or W4A4 with `input_amax`.

    With `input_amax` (an f32 scalar) the inputs are quantized in 1x16 blocks with that
    tensor amax first (larger values saturate); the amax is data: a NaN, inf or negative one
    gives NaN, eagerly as under jit.
    """
    inputs = inputs.astype(dtype)
    if input_amax is not None:
        inputs = ops.fake_quantize_with_data_amax(inputs, input_amax, dtype=dtype)
    # x @ dequantize(W, dtype); on the CPU the weight is decoded in registers (weight_only.py).
    return weight_only.weight_only_matmul(
        inputs, kernel, preferred_element_type=preferred_element_type
    )


def experts_product(
    inputs: jax.Array, kernel: NVFP4Array, group_sizes: jax.Array | None, dtype
) -> jax.Array:
    """Each expert's tokens times its frozen weight (weight-only), in `dtype`.

    With `group_sizes`, `weight_only.weight_only_ragged_dot` of (M, in) tokens sorted by expert;
    without, each expert's `weight_only.weight_only_matmul` of (G, capacity, in) inputs.
    """
    inputs = inputs.astype(dtype)
    if group_sizes is not None:
        return weight_only.weight_only_ragged_dot(inputs, kernel, group_sizes)
    return jnp.stack(
        [
            weight_only.weight_only_matmul(inputs[e], weight_only.expert_weight(kernel, e))
            for e in range(kernel.shape[0])
        ]
    )
