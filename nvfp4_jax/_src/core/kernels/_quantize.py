"""`nvfp4_quantize` and `nvfp4_fake_quantize`: the quantizing kernels and their sharding rule.

Native twins: `Quantize` / `FakeQuantize` in ffi/cpu/handlers.cc (the per-block
work in ffi/cpu/kernels_isa.cc) and ffi/cuda/handlers.cu (ffi/cuda/kernels.cuh); the
numbers of both in ffi/include/nvfp4/numerics.h.

Operands: the stored layout `x (..., C)`, the f32 tensor amax `A` to use, and the SR seed
operand uint32 `(k0, k1, counter lo, counter hi)`. Quantize returns codes uint8
`(..., C/2)`, scales float8_e4m3fn `(..., C/16)` and the stored amax (A, or NaN for
non-finite input or an invalid A); fake quantize returns the dequantized values.

Four Over Six (docs/NUMERICS.md section 13) runs on the twin targets `nvfp4_quantize_4over6`
and `nvfp4_fake_quantize_4over6`: the same operands and results, and two more attributes,
`error` ("mae" or "mse") and `e4m3_max` (i32, 256 or 448); the plain targets keep their
signature, so functions exported with them still run. The target and its attributes come
from the call's `QuantSpec` (`QuantSpec.ffi_target`), the one place that spells them.

Sharding: every leading dim keeps its sharding, and so does the quantized axis when each
shard holds a multiple of 16 of it; the kernel runs on the local shard with the global
amax. With SR only the first stored axis may stay sharded (a shard must be a contiguous slab
of the flattened layout), and its shard's seed is advanced by `axis_index * local size`, so
the random bits are the global ones; other sharded axes are gathered along that axis. 16x16
blocks keep the second-to-last axis sharded only when each shard holds whole tiles.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.kernels import _library
from nvfp4_jax._src.core.kernels import _partition as part
from nvfp4_jax._src.core.spec import QuantSpec, spec_of_call
from nvfp4_jax._src.core.sr_seed import SRSeed, constant_words

_F32 = jnp.float32
_BLOCK = formats.BLOCK_SIZE
_ZERO_SEED = constant_words([0, 0, 0, 0])


def _call_quantize(x, amax, words, *rotation, spec: QuantSpec):
    lead, cols = x.shape[:-1], x.shape[-1]
    out = (
        jax.ShapeDtypeStruct((*lead, cols // 2), jnp.uint8),
        jax.ShapeDtypeStruct((*lead, cols // _BLOCK), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), _F32),
    )
    target, attrs = spec.ffi_target("nvfp4_quantize")
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    return tuple(call(x, amax, words, *rotation, **attrs))


def _call_fake_quantize(x, amax, words, *rotation, spec: QuantSpec):
    """(values, stored amax): the stored amax is `_call_quantize`'s, NaN when the values are.

    The kernels decide the NaN fill on the device from it, so it is a result (whose memory
    outlives the kernels), not scratch memory.
    """
    out = (jax.ShapeDtypeStruct(x.shape, spec.dtype), jax.ShapeDtypeStruct((), _F32))
    target, attrs = spec.ffi_target("nvfp4_fake_quantize")
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    return tuple(call(x, amax, words, *rotation, **attrs))


def _entries(mesh, x, *, block_2d: bool, sr: bool, block: int = _BLOCK) -> list:
    shape = x.shape
    entries = part.blockwise_entries(mesh, x.sharding, shape, block)
    if sr:
        # A shard must be a contiguous slab of the flattened layout: only axis 0 stays
        # sharded, and its shard offsets must fit the 32-bit counter arithmetic below.
        entries = [entries[0]] + [None] * (len(shape) - 1)
        if len(shape) == 1 or math.prod(shape) // 8 >= part.MAX_SR_COUNTERS:
            entries = [None] * len(shape)
    if block_2d:
        entries = part.keep_whole_blocks(mesh, entries, shape, dim=-2)
    return entries


def _shard_words(words, entries, local_shape):
    """The seed operand of this shard: advanced by (axis 0 index) * (local elements)."""
    names = part.axes(entries[0])
    if not names:
        return words
    offset = lax.axis_index(names).astype(jnp.uint32) * jnp.uint32(math.prod(local_shape))
    return SRSeed.from_operand(words).advance(offset).operand()


def _blockwise_rule(raw, *, spec: QuantSpec, blocked: int, poison):
    """`infer` and `partition` of a quantizing target (sharded by whole blocks of x).

    x is sharded as `_entries` allows, A, the seed and MS-EDEN's rotation are replicated; the
    first `blocked` results are sharded as x, the last (the stored amax) is replicated. The
    random bits (SR, MS-EDEN's scales) need a contiguous slab per shard: only axis 0 stays
    sharded, and each shard's seed is advanced to its offset; MS-EDEN keeps whole 128-groups.

    The kernel of each shard follows docs/NUMERICS.md section 8 on its own input; one shard
    with non-finite input (or an invalid A) must make the whole tensor non-finite, as on
    one device: `poison(blocked_results, bad)` gives them their section-8 bits where `bad`.
    """
    sr, rotated = spec.random, spec.ms_eden
    options = dict(
        block_2d=spec.block_2d, sr=sr, block=formats.MS_EDEN_GROUP if rotated else _BLOCK
    )

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        out = part.named(mesh, _entries(mesh, arg_shapes[0], **options))
        return (*[out] * blocked, part.replicated(mesh))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        entries = _entries(mesh, arg_shapes[0], **options)
        names = part.used_axes(entries)
        x_sharding, rep = part.named(mesh, entries), part.replicated(mesh)

        def lower(x, amax, words, *rotation):
            if sr:
                words = _shard_words(words, entries, x.shape)
            *results, stored = raw(x, amax, words, *rotation)
            if not names:
                return (*results, stored)
            bad = part.any_device(jnp.isnan(stored), names)
            return (*poison(results, bad), jnp.where(bad, _F32(jnp.nan), stored))

        operands = (x_sharding, rep, rep) + (rep,) * rotated
        return mesh, lower, (*[x_sharding] * blocked, rep), operands

    return infer, partition


def _poison_codes(results, bad):
    """Section 8's bits for non-finite input: codes 0, every scale 0x7F (NaN)."""
    codes, scales = results
    nan_scales = jnp.full(scales.shape, formats.E4M3_NAN_BYTE, jnp.uint8)
    return (
        jnp.where(bad, jnp.uint8(0), codes),
        jnp.where(bad, lax.bitcast_convert_type(nan_scales, scales.dtype), scales),
    )


def _poison_values(results, bad):
    """NaN everywhere (the values of codes 0 with NaN scales)."""
    (out,) = results
    return (lax.cond(bad, lambda o: jnp.full_like(o, jnp.nan), lambda o: o, out),)


@functools.cache
def _partitioned_quantize(ndim: int, spec: QuantSpec, one_block: bool):
    raw = part.positional(_call_quantize, spec=spec)
    infer, partition = _blockwise_rule(raw, spec=spec, blocked=2, poison=_poison_codes)
    d = part.dims(ndim)
    r = ", r" if spec.ms_eden else ""  # MS-EDEN's rotation operand
    if one_block:  # (..., 16): Shardy refuses a compound factor (s k) whose s has size 1
        return part.with_rule(raw, partition, infer, f"{d} k, , w{r} -> {d} h, {d} s, ")
    rule = f"{d} (s k), , w{r} -> {d} (s h), {d} s, "
    return part.with_rule(raw, partition, infer, rule, k=_BLOCK, h=_BLOCK // 2)


@functools.cache
def _partitioned_fake_quantize(ndim: int, spec: QuantSpec):
    raw = part.positional(_call_fake_quantize, spec=spec)
    infer, partition = _blockwise_rule(raw, spec=spec, blocked=1, poison=_poison_values)
    d = part.dims(ndim)
    r = ", r" if spec.ms_eden else ""
    return part.with_rule(raw, partition, infer, f"{d} c, , w{r} -> {d} c, ")


def _seed_operand(seed: SRSeed | None) -> jax.Array:
    # Round to nearest: the zero seed the kernels ignore, one constant for every call.
    return _ZERO_SEED if seed is None else seed.operand()


def _amax_operand(amax) -> jax.Array:
    """The f32 scalar operand A, reshaped only where it is not a scalar already.

    JAX emits a reshape even from () to ().
    """
    amax = jnp.asarray(amax, _F32)
    return amax if amax.shape == () else amax.reshape(())


def _stored_spec(spec: QuantSpec, seed: SRSeed | None) -> QuantSpec:
    """The spec of the stored layout, rounding stochastically exactly when a seed is given.

    An MS-EDEN spec always draws from its seed.
    """
    sr = seed is not None
    spec = spec.stored()
    if spec.ms_eden or spec.stochastic_rounding == sr:
        return spec
    return spec.replace(stochastic_rounding=sr)


def _operands(x, amax, seed, spec: QuantSpec, rotation) -> tuple:
    """(x, A, seed words) and MS-EDEN's rotation words, checked against the spec."""
    operands = (x, _amax_operand(amax), _seed_operand(seed))
    if not spec.ms_eden:
        return operands
    if seed is None or rotation is None:
        raise ValueError("kernels: an MS-EDEN spec needs a seed and a rotation")
    return (*operands, jnp.asarray(rotation, jnp.uint32))


def quantize(
    x: jax.Array,
    amax: jax.Array,
    seed: SRSeed | None,
    spec: QuantSpec | None = None,
    *,
    rotation: jax.Array | None = None,
    **options,
):
    """Quantizes the stored layout x (..., C) with the f32 tensor amax `amax` under `spec`.

    `seed` None rounds to nearest; an `SRSeed` rounds stochastically with its bits. The
    spec's options (16x16 blocks, the RHT, Four Over Six, MS-EDEN) choose the target and its
    attributes (`QuantSpec.ffi_target`); its axis is ignored (x is the stored layout).
    MS-EDEN draws its scales' rounding from `seed` and needs its `rotation` (uint32 (4,)).
    `options`: the spec's fields as keywords instead (deprecated).

    Returns:
      codes uint8 (..., C/2), scales float8_e4m3fn (..., C/16) and the stored amax.
    """
    spec = spec_of_call(spec, options, "kernels.quantize", e4m3_max_default=448, deprecated=True)
    _library.require("quantize")
    one_block = x.shape[-1] == _BLOCK
    op = _partitioned_quantize(x.ndim - 1, _stored_spec(spec, seed), one_block)
    operands = _operands(x, amax, seed, spec, rotation)
    return part.vary_like(tuple(op(*operands)), *operands)


def fake_quantize(
    x: jax.Array,
    amax: jax.Array,
    seed: SRSeed | None,
    spec: QuantSpec | None = None,
    *,
    rotation: jax.Array | None = None,
    **options,
):
    """Quantizes x like `quantize` and returns the dequantized values in `spec.dtype`.

    No inverse RHT: `value(code) * (f32(s_b) * D)` with `spec.global_scale` (`D = A *
    RCP2688`, under Four Over Six `A * f32(1/(6M))`), else `value(code) * f32(s_b)`.
    Non-finite input (or an invalid A) gives NaN everywhere. `spec.dtype` must be set.
    `rotation` as in `quantize`; `options`: the spec's fields as keywords (deprecated).
    """
    spec = spec_of_call(
        spec, options, "kernels.fake_quantize", e4m3_max_default=448, deprecated=True
    )
    _library.require("fake_quantize")
    op = _partitioned_fake_quantize(x.ndim - 1, _stored_spec(spec, seed))
    operands = _operands(x, amax, seed, spec, rotation)
    values, _ = op(*operands)  # the stored amax only served the NaN fill
    return part.vary_like(values, *operands)
