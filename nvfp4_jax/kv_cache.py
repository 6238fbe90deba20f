"""The NVFP4 KV cache in vLLM's byte format: the cache pytree, its append, read and attention.

The public face of `nvfp4_jax._src.core.kv_cache`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.core.kv_cache import (
    NVFP4KVCache,
    append,
    attention,
    init_cache,
    quantize_heads,
    read,
    scale_from_amax,
)
from nvfp4_jax._src.core.kv_spec import KV_SCALE_DIVISOR, KVCacheConfig

__all__ = [
    "append",
    "attention",
    "init_cache",
    "KV_SCALE_DIVISOR",
    "KVCacheConfig",
    "NVFP4KVCache",
    "quantize_heads",
    "read",
    "scale_from_amax",
]
