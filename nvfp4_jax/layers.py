"""A model's layers as NVFP4 sees them: where they are, what each computes, replacing them.

`layer_paths`, `named_layers` and `replace_layers` walk an nnx model's linear, einsum and
experts layers (`NNX_LAYERS`); `layer_recipe`, `layer_stack` and the `*_problem` functions
say what a layer computes in NVFP4 or why it cannot; `einsum_plan` reads an einsum as a
dense GEMM. `nvfp4_jax.rules` re-exports the same names, as it always has.

The public face of `nvfp4_jax._src.flax` (`walk`, `layer_info`, `einsum`): it re-exports
only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.flax.einsum import EinsumPlan, einsum_plan
from nvfp4_jax._src.flax.layer_info import (
    experts_problem,
    experts_stack,
    frozen_problem,
    layer_recipe,
    layer_stack,
    linear_problem,
    linear_stack,
    weight_problem,
)
from nvfp4_jax._src.flax.walk import NNX_LAYERS, layer_paths, named_layers, replace_layers

__all__ = [
    "einsum_plan",
    "EinsumPlan",
    "experts_problem",
    "experts_stack",
    "frozen_problem",
    "layer_paths",
    "layer_recipe",
    "layer_stack",
    "linear_problem",
    "linear_stack",
    "named_layers",
    "NNX_LAYERS",
    "replace_layers",
    "weight_problem",
]
