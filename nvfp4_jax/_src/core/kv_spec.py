"""KVCacheConfig: the static shape and byte layout of an NVFP4 KV cache, as one frozen value.

The cache holds, per layer, the keys and values of every token quantized per token and
head in 1x16 blocks along the head dimension E, with an E4M3 scale per block and one f32
decode scale per side (docs/NUMERICS.md section 15). Its pages are vLLM's `nvfp4` KV cache
bytes (docs/SERVING_FORMATS.md section 6): for each page of `page_size` tokens and each side
(K, then V), all packed codes `(heads, page_size, E/2)` (HND, or `(page_size, heads, E/2)`
NHD) and then all scales `(heads, page_size, E/16)`, the scales of a swizzled side in
vLLM's 4-token interleave within each head's `(page_size, E/16)` tile.

This module holds the configuration and the index arithmetic of the layout; the reference
(`reference/kv_cache.py`) and the native kernels (`ffi/include/nvfp4/kv_cache.h`) share it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import numpy as np

from nvfp4_jax._src.core import checks, formats

Layout = Literal["HND", "NHD"]
ScaleSwizzle = Literal["v", "kv", "none"]
LAYOUTS = typing.get_args(Layout)
SCALE_SWIZZLES = typing.get_args(ScaleSwizzle)
# vLLM's 4-token scale interleave groups 4 tokens (its writer needs page_size % 4 == 0) and
# splits a token's E/16 scales into 4 groups (E a multiple of 64 on a swizzled side).
SWIZZLE_TOKENS = 4
# The KV decode scale convention of ModelOpt's exporter (`unified_export_hf.py`: "kv cache
# scale as amax / 448 for both FP8 and NVFP4"): k_scale = amax / 448.
KV_SCALE_DIVISOR = 448.0


def _positive_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"KVCacheConfig: {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"KVCacheConfig: {name} must be positive, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """The static description of one layer's NVFP4 KV cache; validated when it is made.

    Attributes:
      kv_heads: key/value heads G stored per token.
      head_dim: E, a multiple of 16 (of 64 where a side's scales are swizzled).
      page_size: tokens per page (vLLM's `block_size`), a multiple of 4.
      layout: "HND" (each head's tokens together inside a page, vLLM's layout for the
        trtllm-gen kernels) or "NHD" (each token's heads together).
      scale_swizzle: which sides store their scales in vLLM's 4-token interleave: "v" (the
        writer of vLLM 0.25.1 and later, for the SM100 trtllm-gen kernel), "kv" (vLLM's
        first writer, commit c46deb95) or "none" (linear scales, what the SM120 readers
        take).
      four_over_six: vLLM's `nvfp4_4over6`: each block keeps its amax mapped to 6 or to 4,
        whichever reconstructs it with the smaller squared error (same bytes and reader).

    Example:
      >>> config = KVCacheConfig(kv_heads=8, head_dim=128)
      >>> config.full_dim, config.page_bytes
      (72, 9216)
    """

    kv_heads: int
    head_dim: int
    page_size: int = 16
    layout: Layout = "HND"
    scale_swizzle: ScaleSwizzle = "v"
    four_over_six: bool = False

    def __post_init__(self):
        for name in ("kv_heads", "head_dim", "page_size"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))
        if self.head_dim % formats.BLOCK_SIZE:
            raise ValueError(
                f"KVCacheConfig: head_dim must be a multiple of {formats.BLOCK_SIZE}, got "
                f"{self.head_dim}"
            )
        if self.page_size % SWIZZLE_TOKENS:
            raise ValueError(
                f"KVCacheConfig: page_size must be a multiple of {SWIZZLE_TOKENS} (vLLM's "
                f"writer needs it), got {self.page_size}"
            )
        checks.check_choice("KVCacheConfig: layout", self.layout, Layout)
        checks.check_choice("KVCacheConfig: scale_swizzle", self.scale_swizzle, ScaleSwizzle)
        if self.scale_swizzle != "none" and self.scale_dim % SWIZZLE_TOKENS:
            raise ValueError(
                f"KVCacheConfig: scale_swizzle={self.scale_swizzle!r} splits a token's "
                f"head_dim/16 scales in 4 groups: head_dim must be a multiple of 64, got "
                f"{self.head_dim} (use scale_swizzle='none')"
            )
        if not isinstance(self.four_over_six, (bool, np.bool_)):
            raise TypeError(
                f"KVCacheConfig: four_over_six must be a bool, got {self.four_over_six!r}"
            )
        object.__setattr__(self, "four_over_six", bool(self.four_over_six))

    @property
    def data_dim(self) -> int:
        """Bytes of packed codes per token and head: E / 2."""
        return self.head_dim // 2

    @property
    def scale_dim(self) -> int:
        """E4M3 scales per token and head: E / 16."""
        return self.head_dim // formats.BLOCK_SIZE

    @property
    def full_dim(self) -> int:
        """E/2 + E/16 bytes per token and head (vLLM's `nvfp4_kv_cache_full_dim`)."""
        return self.data_dim + self.scale_dim

    @property
    def data_bytes(self) -> int:
        """Bytes of one side's packed codes in a page (its scales start here)."""
        return self.kv_heads * self.page_size * self.data_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one side of one page: codes, then scales."""
        return self.kv_heads * self.page_size * self.full_dim

    @property
    def kv_cache_dtype(self) -> str:
        """The `--kv-cache-dtype` vLLM reads these bytes with: "nvfp4" or "nvfp4_4over6"."""
        return "nvfp4_4over6" if self.four_over_six else "nvfp4"

    def swizzled(self, side: int) -> bool:
        """Whether side 0 (K) or 1 (V) stores its scales in the 4-token interleave."""
        return self.scale_swizzle == "kv" or (self.scale_swizzle == "v" and side == 1)

    def pages_for(self, length: int) -> int:
        """Pages holding `length` tokens: ceil(length / page_size)."""
        return -(-int(length) // self.page_size)

    def cache_bytes(self, length: int) -> int:
        """Bytes of one sequence's cache of `length` tokens (whole pages, both sides)."""
        return 2 * self.pages_for(length) * self.page_bytes

    def data_offset(self, t, h, i):
        """Byte offset in a side of a page of code byte i of (token t, head h).

        Elementwise, with broadcasting, on ints or NumPy or JAX arrays.
        """
        if self.layout == "HND":
            return (h * self.page_size + t) * self.data_dim + i
        return (t * self.kv_heads + h) * self.data_dim + i

    def scale_offset(self, side: int, t, h, s):
        """Byte offset in a side of a page of scale s of (token t, head h); elementwise.

        A swizzled side moves (t, s) of a head's tile to
        `t' = 4 * (t // 4) + s // (S / 4)`, `s' = (s % (S / 4)) * 4 + t % 4` (S = E/16).
        """
        if self.swizzled(side):
            group = self.scale_dim // SWIZZLE_TOKENS
            t, s = (
                SWIZZLE_TOKENS * (t // SWIZZLE_TOKENS) + s // group,
                (s % group) * SWIZZLE_TOKENS + t % SWIZZLE_TOKENS,
            )
        if self.layout == "HND":
            return self.data_bytes + (h * self.page_size + t) * self.scale_dim + s
        return self.data_bytes + (t * self.kv_heads + h) * self.scale_dim + s

    def data_offsets(self) -> np.ndarray:
        """`data_offset` of every (t, h, i) of a page: int64 (page, G, E/2)."""
        t, h, i = np.ix_(
            np.arange(self.page_size), np.arange(self.kv_heads), np.arange(self.data_dim)
        )
        return self.data_offset(t, h, i)

    def scale_offsets(self, side: int) -> np.ndarray:
        """`scale_offset` of every (t, h, s) of a page: int64 (page, G, E/16)."""
        t, h, s = np.ix_(
            np.arange(self.page_size), np.arange(self.kv_heads), np.arange(self.scale_dim)
        )
        return self.scale_offset(side, t, h, s)

    def ffi_attributes(self) -> dict:
        """The FFI attributes of the KV cache targets (docs/NUMERICS.md section 15)."""
        return dict(
            page_size=np.int32(self.page_size),
            hnd=self.layout == "HND",
            swizzle_k=self.swizzled(0),
            swizzle_v=self.swizzled(1),
            four_over_six=self.four_over_six,
        )
