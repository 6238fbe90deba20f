"""nvfp4_jax: NVFP4 quantization for JAX and Flax, bit-exact with TransformerEngine.

The implementation lives in `nvfp4_jax._src`, one package per layer (docs/ARCHITECTURE.md);
this module and the public submodules (`nvfp4_jax.nnx`, `nvfp4_jax.hf`, ...) only re-export.

Example:
  >>> import jax, jax.numpy as jnp, nvfp4_jax
  >>> x = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
  >>> q = nvfp4_jax.quantize(x)
  >>> q.dequantize(jnp.bfloat16).shape
  (32, 64)

"""

from nvfp4_jax import (
    checkpoint,
    diagnostics,
    distributed,
    gemm,
    hf,
    kernels,
    kv_cache,
    layers,
    layout,
    linen,
    nnx,
    ops,
    ptq,
    reference,
    rules,
)
from nvfp4_jax._src.core.array import NVFP4Array, is_nvfp4_array, validate_nvfp4_array
from nvfp4_jax._src.core.formats import BLOCK_SIZE, E4M3_MAX, FP4_MAX, MS_EDEN_GROUP
from nvfp4_jax._src.core.layout import (
    GEMM_ALIGNMENT,
    packed_shape,
    pad_to_alignment,
    scales_shape,
    swizzle_scales,
    unpad,
    unswizzle_scales,
)
from nvfp4_jax._src.core.ops import apply_rht, dequantize, fake_quantize, quantize, tensor_amax
from nvfp4_jax._src.core.reference.hadamard import (
    get_hadamard_matrix,
    get_rht_matrix,
    get_sign_from_vector,
    get_wgrad_sign_vector,
)
from nvfp4_jax._src.core.spec import QuantSpec
from nvfp4_jax._src.core.sr_seed import SRSeed
from nvfp4_jax._src.flax.einsum import NVFP4Einsum
from nvfp4_jax._src.io.checkpoint.restore import restore_checkpoint
from nvfp4_jax._src.io.checkpoint.save import save_checkpoint
from nvfp4_jax._src.io.hf.export.main import export_hf_checkpoint
from nvfp4_jax._src.io.hf.load.main import load_hf_checkpoint
from nvfp4_jax._src.io.hf.names import mixtral_name_map, qwen3_moe_name_map
from nvfp4_jax._src.model.convert.linen import quantize_linen, quantized
from nvfp4_jax._src.model.convert.nnx import quantize_model
from nvfp4_jax._src.model.convert.report import QuantizeReport
from nvfp4_jax._src.model.convert.rules import Rule, default_rules, keep_bf16
from nvfp4_jax._src.model.diagnostics.inspection import inspect_model
from nvfp4_jax._src.model.diagnostics.numbers import analyze_layer
from nvfp4_jax._src.model.diagnostics.report import ModelReport
from nvfp4_jax._src.model.ptq.freeze import quantize_for_export
from nvfp4_jax._src.model.ptq.report import PTQReport
from nvfp4_jax._src.training.distributed import quantize_master_weights
from nvfp4_jax._src.training.dot_general import dot_general, nvfp4_dot_general
from nvfp4_jax._src.training.gemm import scaled_matmul
from nvfp4_jax._src.training.ragged.ragged_dot import ragged_dot
from nvfp4_jax._src.training.recipe import NVFP4Recipe, high_precision_forward
from nvfp4_jax._src.training.scaled_matmul import (
    from_scaled_matmul_operands,
    to_scaled_matmul_operands,
)
from nvfp4_jax._version import __version__

# Register the native targets now (no JAX backend is started), so that a function
# serialized with `jax.export` runs in a fresh process before any op has been called.
kernels.register()

__all__ = [
    "analyze_layer",
    "apply_rht",
    "BLOCK_SIZE",
    "checkpoint",
    "default_rules",
    "dequantize",
    "diagnostics",
    "distributed",
    "dot_general",
    "E4M3_MAX",
    "export_hf_checkpoint",
    "fake_quantize",
    "FP4_MAX",
    "from_scaled_matmul_operands",
    "gemm",
    "GEMM_ALIGNMENT",
    "get_hadamard_matrix",
    "get_rht_matrix",
    "get_sign_from_vector",
    "get_wgrad_sign_vector",
    "high_precision_forward",
    "hf",
    "inspect_model",
    "is_nvfp4_array",
    "keep_bf16",
    "kernels",
    "kv_cache",
    "layers",
    "layout",
    "linen",
    "load_hf_checkpoint",
    "mixtral_name_map",
    "MS_EDEN_GROUP",
    "ModelReport",
    "nnx",
    "nvfp4_dot_general",
    "ops",
    "NVFP4Array",
    "NVFP4Einsum",
    "NVFP4Recipe",
    "packed_shape",
    "pad_to_alignment",
    "ptq",
    "PTQReport",
    "quantize",
    "quantize_for_export",
    "QuantSpec",
    "quantize_linen",
    "quantize_master_weights",
    "quantize_model",
    "quantized",
    "QuantizeReport",
    "qwen3_moe_name_map",
    "ragged_dot",
    "reference",
    "restore_checkpoint",
    "Rule",
    "rules",
    "save_checkpoint",
    "scaled_matmul",
    "scales_shape",
    "SRSeed",
    "swizzle_scales",
    "tensor_amax",
    "to_scaled_matmul_operands",
    "unpad",
    "unswizzle_scales",
    "validate_nvfp4_array",
    "__version__",
]
