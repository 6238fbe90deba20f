"""Hugging Face / ModelOpt NVFP4 checkpoints (what vLLM, SGLang and TensorRT-LLM load).

The public face of `nvfp4_jax._src.io.hf` (`format`, `names`, `safetensors_files`,
`export.main`, `load.main`): it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.flax.walk import DEFAULT_FUSED_GROUPS
from nvfp4_jax._src.io.hf.export.main import ExportReport, export_hf_checkpoint
from nvfp4_jax._src.io.hf.format import (
    CONFIG_NAME,
    INDEX_NAME,
    LEGACY_PRODUCER,
    PRODUCER,
    QUANT_ALGOS,
    QUANT_CONFIG_NAME,
    REQUIRED_CONFIG_KEYS,
    WEIGHTS_NAME,
)
from nvfp4_jax._src.io.hf.load.main import load_hf_checkpoint
from nvfp4_jax._src.io.hf.names import (
    DEFAULT_EXCLUDE,
    KINDS,
    NameMap,
    NameRule,
    llama_name_map,
    mixtral_name_map,
    qwen3_moe_name_map,
)
from nvfp4_jax._src.io.hf.safetensors_files import read_safetensors

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_EXCLUDE",
    "DEFAULT_FUSED_GROUPS",
    "export_hf_checkpoint",
    "ExportReport",
    "INDEX_NAME",
    "KINDS",
    "LEGACY_PRODUCER",
    "llama_name_map",
    "load_hf_checkpoint",
    "mixtral_name_map",
    "NameMap",
    "NameRule",
    "PRODUCER",
    "QUANT_ALGOS",
    "QUANT_CONFIG_NAME",
    "qwen3_moe_name_map",
    "read_safetensors",
    "REQUIRED_CONFIG_KEYS",
    "WEIGHTS_NAME",
]
