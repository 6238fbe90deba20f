"""The NVFP4 KV cache targets (CPU only): write tokens, read the cache, decode attention.

Native twins: `KvCacheWriteImpl`, `KvCacheReadImpl` and `KvAttentionImpl` in
ffi/cpu/kv_cache.cc (the numerics and the layout in ffi/include/nvfp4/kv_cache.h, the
attention's vector loops in ffi/cpu/kv_attention_isa.cc). Operands, in the stored layout of
`nvfp4_jax.kv_cache` (B sequences, P pages, W bytes per page and side, T tokens, G key/value
heads, H query heads, E the head dimension):

* `nvfp4_kv_cache_write(pages u8 (B, P, 2, W), k, v (B, T, G, E) bf16/f16/f32, positions
  s32 (B,), scales f32 (2,)) -> pages`: the result aliases `pages` (written in place when
  the caller donates it); token t of sequence b goes to slot `positions[b] + t`, slots
  outside the cache are skipped.
* `nvfp4_kv_cache_read(pages, scales) -> (k, v)` (B, P * page_size, G, E) in the result dtype.
* `nvfp4_kv_attention(q (B, T, H, E), pages, scales, lengths s32 (B,), softmax_scale f32 ())
  -> f32 (B, T, H, E)`.

The attributes are `KVCacheConfig.ffi_attributes()` plus `kv_heads` and `head_dim`. Sharded
under `jit`, the sequences (dim 0 of every operand but the scales) keep their sharding and
every other dim is gathered: a page interleaves all heads, so the heads cannot be split.
Under `vmap` the calls run once per example (the scales are per layer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.core.kernels import _partition as part
from nvfp4_jax._src.core.kv_spec import KVCacheConfig

_F32 = jnp.float32


def _attributes(config: KVCacheConfig) -> dict:
    return dict(
        config.ffi_attributes(),
        kv_heads=np.int32(config.kv_heads),
        head_dim=np.int32(config.head_dim),
    )


def _write_call(pages, k, v, positions, scales, *, config):
    call = jax.ffi.ffi_call(
        "nvfp4_kv_cache_write",
        jax.ShapeDtypeStruct(pages.shape, pages.dtype),
        vmap_method="sequential",
        input_output_aliases={0: 0},
    )
    return call(pages, k, v, positions, scales, **_attributes(config))


def _read_call(pages, scales, *, config, dtype):
    b, p = pages.shape[:2]
    shape = (b, p * config.page_size, config.kv_heads, config.head_dim)
    out = jax.ShapeDtypeStruct(shape, dtype)
    call = jax.ffi.ffi_call("nvfp4_kv_cache_read", (out, out), vmap_method="sequential")
    return call(pages, scales, **_attributes(config))


def _attention_call(q, pages, scales, lengths, softmax_scale, *, config):
    call = jax.ffi.ffi_call(
        "nvfp4_kv_attention", jax.ShapeDtypeStruct(q.shape, _F32), vmap_method="sequential"
    )
    return call(q, pages, scales, lengths, softmax_scale, **_attributes(config))


# Each target's operands: (rank, whether dim 0 is the sequences), and its results' ranks.
_OPERANDS = {
    "write": (((4, True), (4, True), (4, True), (1, True), (1, False)), (4,)),
    "read": (((4, True), (1, False)), (4, 4)),
    "attention": (((4, True), (4, True), (1, False), (1, True), (0, False)), (4,)),
}
# The operand whose sharding of the sequences the rule keeps: the pages.
_PAGES = {"write": 0, "read": 0, "attention": 1}


def _rule_string(operands, out_ranks) -> tuple[str, tuple[str, ...]]:
    """The Shardy rule: factor `b` for the sequences, a private factor for every other dim."""
    names, private = [], []
    for i, (rank, batched) in enumerate(operands):
        dims = [f"a{i}d{d}" for d in range(rank)]
        if batched:
            dims[0] = "b"
        names.append(" ".join(dims))
        private += [d for d in dims if d != "b"]
    outs = []
    for i, rank in enumerate(out_ranks):
        dims = ["b", *[f"r{i}d{d}" for d in range(1, rank)]]
        outs.append(" ".join(dims))
        private += dims[1:]
    return f"{', '.join(names)} -> {', '.join(outs)}", tuple(private)


def _batch_rule(raw, operands, out_ranks, lead: int):
    """(infer, partition) of `raw`: the sequences keep the pages' sharding, the rest gathered."""

    def batch_entry(mesh, arg_shapes):
        pages = arg_shapes[lead]
        entry = part.divisible(mesh, part.entries(pages.sharding, 4), pages.shape)[0]
        for shape, (_, batched) in zip(arg_shapes, operands, strict=True):
            if batched and entry is not None and shape.shape[0] % part.ways(mesh, entry):
                return None
        return entry

    def named(mesh, entry, rank: int, batched: bool):
        if rank == 0:
            return part.replicated(mesh)
        return part.named(mesh, [entry if batched else None] + [None] * (rank - 1))

    def results(mesh, entry):
        outs = tuple(named(mesh, entry, rank, True) for rank in out_ranks)
        return outs if len(outs) > 1 else outs[0]

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return results(mesh, batch_entry(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        entry = batch_entry(mesh, arg_shapes)
        args = tuple(named(mesh, entry, rank, batched) for rank, batched in operands)
        return mesh, raw, results(mesh, entry), args

    return infer, partition


@functools.cache
def _partitioned(kind: str, config: KVCacheConfig, dtype):
    if kind == "write":
        raw = part.positional(_write_call, config=config)
    elif kind == "read":
        raw = part.positional(_read_call, config=config, dtype=dtype)
    else:
        raw = part.positional(_attention_call, config=config)
    operands, out_ranks = _OPERANDS[kind]
    rule, private = _rule_string(operands, out_ranks)
    infer, partition = _batch_rule(raw, operands, out_ranks, _PAGES[kind])
    return part.with_rule(raw, partition, infer, rule, need_replication_factors=private)


def _require(op: str) -> None:
    _library.require(op)
    if _library.current_platform() != "cpu":
        raise ValueError(
            f"{op}: the native KV cache kernels run on the CPU only, not "
            f"{_library.current_platform()!r}"
        )


def _scales(k_scale, v_scale) -> jax.Array:
    return jnp.stack([jnp.asarray(k_scale, _F32), jnp.asarray(v_scale, _F32)])


def kv_cache_write(config: KVCacheConfig, pages, k_scale, v_scale, k, v, positions):
    """`nvfp4_kv_cache_write`: the pages with the tokens written (aliasing `pages`)."""
    _require("nvfp4_kv_cache_write")
    args = (pages, k, v, jnp.asarray(positions, jnp.int32), _scales(k_scale, v_scale))
    op = _partitioned("write", config, None)
    return part.vary_like(op(*args), *args)


def kv_cache_read(config: KVCacheConfig, pages, k_scale, v_scale, dtype):
    """`nvfp4_kv_cache_read`: the dequantized keys and values (B, L, G, E) in `dtype`."""
    _require("nvfp4_kv_cache_read")
    args = (pages, _scales(k_scale, v_scale))
    op = _partitioned("read", config, jnp.dtype(dtype))
    return part.vary_like(op(*args), *args)


def kv_attention(config: KVCacheConfig, q, pages, k_scale, v_scale, lengths, softmax_scale):
    """`nvfp4_kv_attention`: decode attention over the cache, f32 (B, T, H, E)."""
    _require("nvfp4_kv_attention")
    args = (
        q,
        pages,
        _scales(k_scale, v_scale),
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(softmax_scale, _F32),
    )
    op = _partitioned("attention", config, None)
    return part.vary_like(op(*args), *args)
