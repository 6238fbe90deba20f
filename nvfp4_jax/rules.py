"""Rules: which layers of a model get which NVFP4 recipe, and `quantize_model`.

The public face of `nvfp4_jax._src.model.convert` (`rules`, `report`, `nnx`, `linen`): it
re-exports only (docs/ARCHITECTURE.md). The helpers that walk a model's layers
(`layer_paths`, `layer_recipe`, `einsum_plan`, ...) have their own face, `nvfp4_jax.layers`;
this module re-exports them too, as it always has.
"""

from nvfp4_jax._src.flax.einsum import EinsumPlan, NVFP4Einsum, einsum_plan
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
from nvfp4_jax._src.model.convert.linen import quantize_linen, quantized
from nvfp4_jax._src.model.convert.nnx import quantize_model
from nvfp4_jax._src.model.convert.report import LayerDecision, QuantizeReport
from nvfp4_jax._src.model.convert.rules import (
    DEFAULT_RNG_COLLECTION,
    EMBED_AND_HEAD,
    LAYER_PATTERN,
    ROUTER,
    Rule,
    check_rules,
    default_rules,
    keep_bf16,
    match_layer,
    match_rule,
    recipe_from_dict,
    recipe_to_dict,
)

__all__ = [
    "check_rules",
    "DEFAULT_RNG_COLLECTION",
    "default_rules",
    "einsum_plan",
    "EinsumPlan",
    "EMBED_AND_HEAD",
    "experts_problem",
    "experts_stack",
    "frozen_problem",
    "keep_bf16",
    "layer_paths",
    "LAYER_PATTERN",
    "layer_recipe",
    "layer_stack",
    "LayerDecision",
    "linear_problem",
    "linear_stack",
    "match_layer",
    "match_rule",
    "named_layers",
    "NNX_LAYERS",
    "NVFP4Einsum",
    "quantize_linen",
    "quantize_model",
    "quantized",
    "QuantizeReport",
    "recipe_from_dict",
    "recipe_to_dict",
    "replace_layers",
    "ROUTER",
    "Rule",
    "weight_problem",
]
