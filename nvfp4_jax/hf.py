"""Hugging Face / ModelOpt NVFP4 checkpoints (what vLLM, SGLang and TensorRT-LLM load).

The public face of `nvfp4_jax._src.io.hf`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.io.hf import (
    CONFIG_NAME,
    DEFAULT_EXCLUDE,
    DEFAULT_FUSED_GROUPS,
    INDEX_NAME,
    KINDS,
    LEGACY_PRODUCER,
    PRODUCER,
    QUANT_ALGOS,
    QUANT_CONFIG_NAME,
    REQUIRED_CONFIG_KEYS,
    WEIGHTS_NAME,
    ExportReport,
    NameMap,
    NameRule,
    export_hf_checkpoint,
    llama_name_map,
    load_hf_checkpoint,
    mixtral_name_map,
    qwen3_moe_name_map,
    read_safetensors,
)

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
