"""The NVFP4 KV cache: a pytree of vLLM's page bytes, its append, its read and its attention.

`NVFP4KVCache` holds one layer's keys and values for B sequences as the bytes vLLM's
`--kv-cache-dtype nvfp4` (or `nvfp4_4over6`) cache holds for the same values and scales
(docs/SERVING_FORMATS.md section 6; numbers: docs/NUMERICS.md section 15). `append` quantizes
new tokens into it (one token per step, or a whole prefill), `read` dequantizes it, and
`attention` computes decode attention over it. Each runs on the pure-jnp reference or, on the
CPU, on native kernels that write and read the same bits (`implementation=`).

Shape letters: B sequences, T tokens, G key/value heads, H query heads (a multiple of G), E
the head dimension, P pages of `page_size` tokens, L = P * page_size slots, W the bytes of
one side of a page (`KVCacheConfig.page_bytes`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> config = KVCacheConfig(kv_heads=2, head_dim=64)
  >>> cache = init_cache(config, batch=1, length=32)
  >>> k = v = jnp.ones((1, 3, 2, 64), jnp.bfloat16)
  >>> cache = append(cache, k, v, positions=0)
  >>> q = jnp.ones((1, 1, 4, 64), jnp.bfloat16)
  >>> attention(q, cache, lengths=3).shape
  (1, 1, 4, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import backends, checks
from nvfp4_jax._src.core.backends import Implementation
from nvfp4_jax._src.core.interception import opaque
from nvfp4_jax._src.core.kernels._kv_cache import kv_attention as native_kv_attention
from nvfp4_jax._src.core.kernels._kv_cache import kv_cache_read as native_kv_cache_read
from nvfp4_jax._src.core.kernels._kv_cache import kv_cache_write as native_kv_cache_write
from nvfp4_jax._src.core.kernels._library import current_platform
from nvfp4_jax._src.core.kv_spec import KV_SCALE_DIVISOR, KVCacheConfig
from nvfp4_jax._src.core.reference import kv_cache as ref

_F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4KVCache:
    """One layer's NVFP4 KV cache for B sequences.

    Invariants (checked by every op that takes one):
      * `pages`: uint8 (B, P, 2, W), W = `config.page_bytes`: page p of sequence b holds
        slots `p * page_size` .. `(p + 1) * page_size - 1`; `pages[b, p, 0]` is the K side
        and `pages[b, p, 1]` the V side, each vLLM's bytes: packed codes, then scales.
      * `k_scale`, `v_scale`: f32 scalars, the decode scales (vLLM's `k_scale`, `v_scale`):
        a slot decodes as `value(code) * (f32(sf) * scale)`. A stack of caches (one per
        layer, `jax.tree.map(jnp.stack, ...)`) has one per layer; index it, or `vmap`, to
        get a layer's cache.
      * `config`: the static `KVCacheConfig` (heads, head dimension, page size, layout,
        scale swizzle, Four Over Six).

    The cache does not record which slots hold tokens: `attention` takes the lengths, and
    slots never written hold zeros (which decode to 0).
    """

    pages: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    config: KVCacheConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def batch(self) -> int:
        """B, the number of sequences."""
        return self.pages.shape[-4]

    @property
    def capacity(self) -> int:
        """L, the slots per sequence: P * page_size."""
        return self.pages.shape[-3] * self.config.page_size


def scale_from_amax(amax) -> jax.Array:
    """The decode scale of a side whose calibrated max |x| is `amax`: `f32(amax / 448)`.

    ModelOpt's convention for NVFP4 (and FP8) KV caches: blocks of a value as large as the
    amax get the scale 448 / 6 (about 75), leaving the E4M3 range above it for tokens
    larger than the calibration saw. An amax of 0 gives 1 (vLLM's default scale).
    """
    amax = jnp.asarray(amax, _F32)
    scale = amax / (amax * 0 + _F32(KV_SCALE_DIVISOR))  # a true division (docs/NUMERICS.md)
    return jnp.where(amax > 0, scale, _F32(1))


def _check_scale(value, name: str) -> jax.Array:
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"init_cache: {name} must be a float scalar, got {value!r}")
    array = jnp.asarray(value)
    if array.shape != () or not jnp.issubdtype(array.dtype, jnp.floating):
        if array.shape != () or not jnp.issubdtype(array.dtype, jnp.integer):
            raise TypeError(
                f"init_cache: {name} must be a float scalar, got {array.dtype} {array.shape}"
            )
    if not isinstance(value, jax.core.Tracer):
        concrete = float(np.asarray(value, np.float32))
        if not 0 < concrete < np.inf:
            raise ValueError(f"init_cache: {name} must be finite and positive, got {concrete}")
    return jnp.array(array, _F32)  # a copy: the cache may be donated, the caller's scale not


def init_cache(
    config: KVCacheConfig, batch: int, length: int, *, k_scale=1.0, v_scale=1.0
) -> NVFP4KVCache:
    """An empty cache of `batch` sequences with room for `length` tokens each.

    Args:
      config: the cache's `KVCacheConfig`.
      batch: B, the sequences.
      length: the slots each sequence needs; rounded up to whole pages.
      k_scale: the keys' decode scale (vLLM's `k_scale`; `scale_from_amax` of a calibrated
        amax, or 1.0, vLLM's default without one): finite and positive.
      v_scale: the values' decode scale, likewise.

    Returns:
      An `NVFP4KVCache` of zero pages (B, ceil(length / page_size), 2, W).
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"init_cache: config must be a KVCacheConfig, got {type(config).__name__}")
    for name, value in (("batch", batch), ("length", length)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"init_cache: {name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"init_cache: {name} must be positive, got {value}")
    pages = jnp.asarray(ref.empty_pages(config, int(batch), int(length)))
    return NVFP4KVCache(
        pages, _check_scale(k_scale, "k_scale"), _check_scale(v_scale, "v_scale"), config
    )


# --- checks ------------------------------------------------------------------------------------


def _check_cache(cache, op: str) -> KVCacheConfig:
    if not isinstance(cache, NVFP4KVCache):
        raise TypeError(f"{op}: cache must be an NVFP4KVCache, got {type(cache).__name__}")
    config = cache.config
    pages = cache.pages
    if pages.dtype != jnp.uint8 or pages.ndim != 4 or pages.shape[2:] != (2, config.page_bytes):
        raise ValueError(
            f"{op}: cache.pages must be uint8 (B, P, 2, {config.page_bytes}) for {config}, got "
            f"{pages.dtype} {tuple(pages.shape)} (a stack of layers' caches: index one layer, "
            "or vmap)"
        )
    for name in ("k_scale", "v_scale"):
        scale = getattr(cache, name)
        if jnp.shape(scale) != () or jnp.result_type(scale) != _F32:
            raise ValueError(
                f"{op}: cache.{name} must be an f32 scalar, got {jnp.result_type(scale)} "
                f"{jnp.shape(scale)}"
            )
    return config


def _check_tokens(x, name: str, op: str, batch: int, heads: int | None, config) -> jax.Array:
    x = checks.as_float_array(x, op, name)
    if x.ndim != 4 or x.shape[0] != batch or x.shape[3] != config.head_dim:
        raise ValueError(
            f"{op}: {name} must be (B={batch}, T, heads, E={config.head_dim}), got shape "
            f"{tuple(x.shape)}"
        )
    if heads is not None and x.shape[2] != heads:
        raise ValueError(
            f"{op}: {name} must have the cache's {heads} key/value heads, got shape "
            f"{tuple(x.shape)}"
        )
    return x


def _check_per_sequence(value, name: str, op: str, batch: int) -> jax.Array:
    """An int scalar or (B,) array as int32 (B,)."""
    if isinstance(value, (bool, np.bool_)) or value is None:
        raise TypeError(f"{op}: {name} must be an int or an int array (B,), got {value!r}")
    array = jnp.asarray(value)
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{op}: {name} must be integers, got dtype {array.dtype}")
    if array.shape not in ((), (batch,)):
        raise ValueError(f"{op}: {name} must be a scalar or ({batch},), got shape {array.shape}")
    return jnp.broadcast_to(array.astype(jnp.int32), (batch,))


def _native(implementation: Implementation | None, op: str, **args) -> bool:
    """Whether the native kernels run `op`; "ffi" where they cannot is an error saying why.

    The backends decide (`backends.runs_natively`): "kv_cache" (write, read) and
    "kv_attention" (with `tokens`, the new tokens per sequence); "ffi" asks for the
    native kernels whatever the tokens.
    """
    backends.resolve(implementation, op)  # an unknown name is an error
    if implementation == "ffi":
        if not backends.runs_natively("kv_cache", "ffi"):
            raise ValueError(
                f"{op}: implementation='ffi' was requested, but the native KV cache kernels "
                f"run on the CPU only (platform {current_platform()!r})"
            )
        return True
    native_op = "kv_attention" if op == "attention" else "kv_cache"
    return backends.runs_natively(native_op, implementation, **args)


# --- the ops -----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1))
def _append(config: KVCacheConfig, native: bool, pages, k_scale, v_scale, k, v, positions):
    if native:
        return native_kv_cache_write(config, pages, k_scale, v_scale, k, v, positions)
    return ref.write(config, pages, k_scale, v_scale, k, v, positions)


@opaque
def append(
    cache: NVFP4KVCache, k, v, positions, *, implementation: Implementation | None = None
) -> NVFP4KVCache:
    """The cache with T new tokens of each sequence quantized into it.

    Args:
      cache: the layer's `NVFP4KVCache`.
      k: the new keys, bf16, f16 or f32 (B, T, G, E) (after the rotary embedding).
      v: the new values, like `k`.
      positions: the slot of each sequence's first new token, an int or int (B,); token t
        goes to slot `positions + t`. Slots outside [0, L) are skipped (vLLM's negative
        slot), so padding tokens can be dropped with a negative position.
      implementation: None (the native kernels where they run, else the reference),
        "reference" or "ffi".

    Returns:
      The cache with the new pages (the scales unchanged). Under `jax.jit` with the cache
      donated (`donate_argnums`) the pages are written in place.

    Raises:
      TypeError, ValueError: a cache, shape or dtype the op cannot take, named.
    """
    config = _check_cache(cache, "append")
    k = _check_tokens(k, "k", "append", cache.batch, config.kv_heads, config)
    v = _check_tokens(v, "v", "append", cache.batch, config.kv_heads, config)
    if k.shape != v.shape:
        raise ValueError(f"append: k and v must have one shape, got {k.shape} and {v.shape}")
    positions = _check_per_sequence(positions, "positions", "append", cache.batch)
    native = _native(implementation, "append")
    pages = _append(config, native, cache.pages, cache.k_scale, cache.v_scale, k, v, positions)
    return dataclasses.replace(cache, pages=pages)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _read(config: KVCacheConfig, native: bool, dtype, pages, k_scale, v_scale):
    if native:
        return native_kv_cache_read(config, pages, k_scale, v_scale, dtype)
    return ref.read(config, pages, k_scale, v_scale, dtype)


@opaque
def read(
    cache: NVFP4KVCache, dtype=jnp.float32, *, implementation: Implementation | None = None
) -> tuple[jax.Array, jax.Array]:
    """The dequantized keys and values of every slot: `value(code) * (f32(sf) * scale)`.

    Args:
      cache: the layer's `NVFP4KVCache`.
      dtype: bf16, f16 or f32: the result dtype (the f32 value rounded once).
      implementation: None, "reference" or "ffi".

    Returns:
      (k, v), each (B, L, G, E) in `dtype`; slots never written are 0.
    """
    config = _check_cache(cache, "read")
    dtype = checks.check_dtype(dtype, "read")
    native = _native(implementation, "read")
    return _read(config, native, dtype, cache.pages, cache.k_scale, cache.v_scale)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _attention(config, native, q, pages, k_scale, v_scale, lengths, softmax_scale):
    if native:
        out = native_kv_attention(config, q, pages, k_scale, v_scale, lengths, softmax_scale)
    else:
        out = ref.attention(config, q, pages, k_scale, v_scale, lengths, softmax_scale)
    return out.astype(q.dtype)


@opaque
def attention(
    q,
    cache: NVFP4KVCache,
    lengths,
    *,
    scale: float | None = None,
    implementation: Implementation | None = None,
) -> jax.Array:
    """Decode attention of T queries per sequence over the NVFP4 cache (GQA, MQA, MHA).

    Query head h attends with key/value head `h // (H / G)`. Query t of T sees the slots
    `j < lengths - (T - 1 - t)` (causal among the T queries: `lengths` counts the slots the
    last query sees, its own included); the others are masked, whatever they hold.

    Args:
      q: the queries, bf16, f16 or f32 (B, T, H, E) (after the rotary embedding).
      cache: the layer's `NVFP4KVCache`, already holding the queries' own tokens.
      lengths: an int or int (B,): the slots the last query of each sequence sees.
      scale: the softmax scale; None: 1 / sqrt(E).
      implementation: None (on the CPU the native kernel, which decodes each block in
        registers inside the q.k and p.v products, for up to 16 new tokens per sequence;
        else the reference), "reference" (the cache dequantized in f32, then XLA's dots)
        or "ffi" (the native kernel whatever T).

    Returns:
      (B, T, H, E) in q's dtype; a query that sees no slot gets zeros.
    """
    config = _check_cache(cache, "attention")
    q = _check_tokens(q, "q", "attention", cache.batch, None, config)
    if q.shape[2] % config.kv_heads:
        raise ValueError(
            f"attention: q's {q.shape[2]} heads must be a multiple of the cache's "
            f"{config.kv_heads} key/value heads (shape {tuple(q.shape)})"
        )
    lengths = _check_per_sequence(lengths, "lengths", "attention", cache.batch)
    softmax_scale = _F32(1 / math.sqrt(config.head_dim)) if scale is None else scale
    if isinstance(softmax_scale, (bool, np.bool_, str)):
        raise TypeError(f"attention: scale must be a float, got {scale!r}")
    native = _native(implementation, "attention", tokens=q.shape[1])
    args = (q, cache.pages, cache.k_scale, cache.v_scale, lengths, jnp.asarray(softmax_scale, _F32))
    return _attention(config, native, *args)


def quantize_heads(x, scale, *, four_over_six: bool = False) -> tuple[jax.Array, jax.Array]:
    """Quantizes head vectors as the cache stores them (the reference; no page layout).

    Args:
      x: bf16, f16 or f32 (..., E), E a multiple of 16.
      scale: the side's f32 decode scale s.
      four_over_six: vLLM's `nvfp4_4over6` choice per block.

    Returns:
      (codes uint8 (..., E/2), element 2i in the low nibble; scales float8_e4m3fn (..., E/16)).
    """
    x = checks.as_float_array(x, "quantize_heads")
    if x.ndim == 0 or x.shape[-1] % 16:
        raise ValueError(
            f"quantize_heads: x's last axis must be a multiple of 16, got shape {tuple(x.shape)}"
        )
    return ref.quantize_heads(x, jnp.asarray(scale, _F32), four_over_six=bool(four_over_six))
