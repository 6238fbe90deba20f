"""Quantization under `shard_map`: global amax, per-shard quantize, master weights.

The public face of `nvfp4_jax._src.training.distributed`: it re-exports only (docs/ARCHITECTURE.md).
"""

from nvfp4_jax._src.training.distributed import (
    fake_quantize_shard,
    global_amax,
    quantize_master_weights,
    quantize_shard,
    shard_offset,
)

__all__ = [
    "fake_quantize_shard",
    "global_amax",
    "quantize_master_weights",
    "quantize_shard",
    "shard_offset",
]
