"""NVFP4 quantize, dequantize and fake-quantize: the pure-jnp reference and the dispatch.

Shape letters: the input `x` has logical shape `S`; its *stored layout* is `x` with the
quantized axis moved last, `(..., R, C)` with C a multiple of 16 (R, the second-to-last
stored axis, must be a multiple of 16 for 16x16 blocks). Numbers follow NUMERICS.md:

    A     = max |x|                                   (or the caller's amax)
    S_enc = min(2688 / A, FLT_MAX), 1 if A == 0 or S_enc == 0;   S_dec = 1 / S_enc
    s_b   = e4m3(min(amax_b * (S_enc * RCP6), 448))   per block (1x16, or 16x16 tile)
    enc_b = min(1 / (f32(s_b) * S_dec), FLT_MAX)
    code  = e2m1(x * enc_b)                           nearest-even, or stochastic
    x_hat = value(code) * (f32(s_b) * (A * RCP2688))

Every formula is written as the f32 operations NUMERICS.md lists, in its order; constants
are multiplied, never divided by (XLA turns `a / c` into `a * (1/c)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

from nvfp4_jax import dispatch, formats, hadamard
from nvfp4_jax.array import NVFP4Array

_F32 = jnp.float32


def _check_quantize_args(x, axis, block_2d, stochastic_rounding, key, amax, op) -> int:
    """Validates the arguments of quantize/fake_quantize; returns `axis` made negative."""
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got shape {x.shape}")
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{op}: axis={axis!r} is out of range for x of shape {x.shape}")
    axis = int(axis) - x.ndim if axis >= 0 else int(axis)
    if x.shape[axis] % formats.BLOCK_SIZE:
        raise ValueError(
            f"{op}: the quantized axis (axis={axis}) of x with shape {x.shape} has size "
            f"{x.shape[axis]}, which is not a multiple of {formats.BLOCK_SIZE}"
        )
    if block_2d:
        stored = _stored_shape(x.shape, axis)
        if len(stored) < 2 or stored[-2] % formats.BLOCK_SIZE:
            raise ValueError(
                f"{op}: block_2d=True needs 16x16 tiles, but x of shape {x.shape} quantized along "
                f"axis={axis} is stored as {stored}, whose rows (second-to-last axis) are not a "
                f"multiple of {formats.BLOCK_SIZE}"
            )
    if stochastic_rounding and key is None:
        raise ValueError(f"{op}: stochastic_rounding=True needs a PRNG key, got key=None")
    if amax is not None and jnp.shape(amax) != ():
        raise ValueError(f"{op}: amax must be a scalar, got shape {jnp.shape(amax)}")
    return axis


def _stored_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    rest = list(shape)
    last = rest.pop(axis)
    return (*rest, last)


def key_words(key: jax.Array) -> jax.Array:
    """Returns the two uint32 words `(k0, k1)` that seed stochastic rounding for `key`."""
    return jax.random.bits(key, (2,), jnp.uint32)


def counter_offset_words(offset) -> jax.Array:
    """The SR counter offset `offset // 8` of an element offset, as uint32 `(lo, hi)`.

    `offset` is the global flat index of a shard's first element, a multiple of 16: a Python
    int (any size), or a traced integer scalar below 2**32.
    """
    if isinstance(offset, (int, np.integer)):
        offset = int(offset)
        if offset < 0 or offset % formats.BLOCK_SIZE:
            raise ValueError(f"the SR element offset must be a multiple of 16 >= 0, got {offset}")
        counter = offset // 8
        return jnp.array([counter & 0xFFFFFFFF, counter >> 32], jnp.uint32)
    offset = jnp.asarray(offset)
    if offset.shape != () or not jnp.issubdtype(offset.dtype, jnp.integer):
        raise ValueError(f"the SR element offset must be an integer scalar, got {offset}")
    return jnp.stack([offset.astype(jnp.uint32) >> 3, jnp.uint32(0)])


def sr_words(words: jax.Array | None, offset=0) -> jax.Array:
    """The uint32[4] operand of the SR kernels: k0, k1, counter offset lo, counter offset hi."""
    if words is None:
        words = jnp.zeros((2,), jnp.uint32)
    return jnp.concatenate(
        [jnp.asarray(words, jnp.uint32).reshape(2), counter_offset_words(offset)]
    )


def random_bytes(words: jax.Array, count: int, offset=0) -> jax.Array:
    """Returns `count` random uint8 values, element n from counter n // 8 (NUMERICS section 7).

    Counter j is hashed as `threefry2x32((k0, k1), (j >> 32, j & 0xFFFFFFFF))`; element n
    takes byte `n % 8` of the 64-bit word `w0 | w1 << 32`, least significant byte first.
    With `offset` (a multiple of 16, see `counter_offset_words`), these are the bytes of
    elements `offset .. offset + count - 1` of a larger tensor: counters `offset // 8 + j`,
    with 64-bit carry into the high word.
    """
    counters = -(-count // 8)
    if counters > np.iinfo(np.uint32).max:
        raise ValueError(f"stochastic rounding supports fewer than 2**35 elements, got {count}")
    local = jnp.arange(counters, dtype=jnp.uint32)
    base = counter_offset_words(offset)
    low = local + base[0]  # wraps modulo 2**32; the carry goes into the high word
    high = base[1] + (low < local).astype(jnp.uint32)
    # threefry_2x32 hashes the pairs (count[i], count[i + len/2]): high words first, then low.
    hashed = threefry_2x32((words[0], words[1]), jnp.concatenate([high, low]))
    w0, w1 = hashed[:counters], hashed[counters:]
    shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
    parts = [(w[:, None] >> shifts) & 0xFF for w in (w0, w1)]
    return jnp.concatenate(parts, axis=1).reshape(-1)[:count].astype(jnp.uint8)


def global_encode_scale(amax: jax.Array) -> jax.Array:
    """Returns `S_enc = min(2688 / A, FLT_MAX)`, or 1 where A == 0 or S_enc == 0."""
    amax = amax.astype(_F32)
    s_enc = jnp.minimum(_F32(formats.FP4_E4M3_MAX) / amax, _F32(formats.FLT_MAX))
    return jnp.where((amax == 0) | (s_enc == 0), _F32(1), s_enc)


def _block_amax(blocks: jax.Array, block_2d: bool) -> jax.Array:
    """Max |x| per block: (..., R, C/16, 16) -> (..., R, C/16), tiles repeated per row if 2D."""
    block_max = jnp.max(jnp.abs(blocks), axis=-1)
    if not block_2d:
        return block_max
    *lead, rows, cols = block_max.shape
    tiles = block_max.reshape(*lead, rows // formats.BLOCK_SIZE, formats.BLOCK_SIZE, cols)
    tile_max = jnp.max(tiles, axis=-2, keepdims=True)
    return jnp.broadcast_to(tile_max, tiles.shape).reshape(block_max.shape)


def _stochastic_magnitude(magnitude: jax.Array, random: jax.Array) -> jax.Array:
    """Rounds |y| to the E2M1 grid stochastically with 8 random bits each (NUMERICS section 7)."""

    def step(v):
        return jnp.where(v < 2, _F32(0.5), jnp.where(v < 4, _F32(1), _F32(2)))

    u = random.astype(_F32) * _F32(1 / 256)
    t = magnitude + u * step(magnitude)
    t_step = step(t)
    # t / step(t) is exact (step is a power of two): multiply by the exact reciprocal.
    return jnp.minimum(jnp.floor(t * (_F32(1) / t_step)) * t_step, _F32(formats.FP4_MAX))


def _quantize_core(xs, amax, words, block_2d, stochastic_rounding, offset=0):
    """Quantizes the f32 stored layout `xs` (..., C) with tensor amax `amax`.

    Returns unpacked codes uint8 (..., C) and scales float8_e4m3fn (..., C/16).
    """
    s_enc = global_encode_scale(amax)
    s_dec = _F32(1) / s_enc
    blocks = xs.reshape(*xs.shape[:-1], -1, formats.BLOCK_SIZE)
    block_max = _block_amax(blocks, block_2d)
    scaled = jnp.minimum(block_max * (s_enc * _F32(formats.RCP6)), _F32(formats.E4M3_MAX))
    scales = scaled.astype(jnp.float8_e4m3fn)
    encode = jnp.minimum(_F32(1) / (scales.astype(_F32) * s_dec), _F32(formats.FLT_MAX))
    y = blocks * encode[..., None]
    magnitude = jnp.abs(y)
    if stochastic_rounding:
        random = random_bytes(words, y.size, offset).reshape(y.shape)
        magnitude = _stochastic_magnitude(magnitude, random)
    codes = formats.e2m1_magnitude_code(magnitude) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    return codes.reshape(xs.shape), scales


def _stored_amax(max_abs, amax):
    """The amax to store: the one used, or NaN if the input held NaN/inf (NUMERICS 8)."""
    return jnp.where(jnp.isfinite(max_abs) & jnp.isfinite(amax), amax, _F32(jnp.nan))


def tensor_amax(
    x: jax.Array, *, axis: int = -1, rht: bool = False, implementation: str | None = None
) -> jax.Array:
    """Returns the f32 tensor amax `max |x|` that `quantize` would use, NaN if x holds NaN/inf.

    With `rht`, the amax of the transformed tensor (the RHT applied along `axis`). Pass the
    result (or its maximum over devices) as `quantize(..., amax=...)`.

    Example:
      >>> float(tensor_amax(jnp.array([1.0, -3.0] * 8)))
      3.0
    """
    x = formats.as_float_array(x, "tensor_amax")
    axis = _check_quantize_args(x, axis, False, False, None, None, "tensor_amax")
    stored = jnp.moveaxis(x, axis, -1)
    if dispatch.resolve(implementation, "tensor_amax") == "ffi":
        return dispatch.kernels().amax_ffi(stored, rht=rht)
    if rht:
        stored = hadamard.apply_rht_reference(stored)
    max_abs = jnp.max(jnp.abs(stored.astype(_F32)))
    return _stored_amax(max_abs, max_abs)


def _prepare_reference(x, axis, rht, amax):
    """Moves the quantized axis last, applies the RHT; returns (f32 layout, A, stored A)."""
    stored = jnp.moveaxis(x, axis, -1)
    if rht:
        stored = hadamard.apply_rht_reference(stored)
    xs = stored.astype(_F32)
    max_abs = jnp.max(jnp.abs(xs))
    used = max_abs if amax is None else jnp.asarray(amax).astype(_F32)
    return xs, used, _stored_amax(max_abs, used)


def _quantize_reference(x, axis, block_2d, rht, stochastic_rounding, words, amax, offset=0):
    xs, used, stored_amax = _prepare_reference(x, axis, rht, amax)
    codes, scales = _quantize_core(xs, used, words, block_2d, stochastic_rounding, offset)
    return formats.pack_nibbles(codes), scales, stored_amax


def _ffi_operands(x, axis, rht, sr, words, amax, offset):
    """The stored layout, the amax to use and the SR key words the FFI quantizers take."""
    stored = jnp.moveaxis(x, axis, -1)
    if amax is None:
        used = dispatch.kernels().amax_ffi(stored, rht=rht)
    else:
        used = jnp.asarray(amax).astype(_F32)
    return stored, used, sr_words(words, offset if sr else 0)


def _quantize_ffi(x, axis, block_2d, rht, stochastic_rounding, words, amax, offset=0):
    return dispatch.kernels().quantize_ffi(
        *_ffi_operands(x, axis, rht, stochastic_rounding, words, amax, offset),
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=stochastic_rounding,
    )


def quantize(
    x: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | None = None,
    amax: jax.Array | None = None,
    implementation: str | None = None,
    _sr_offset=0,
) -> NVFP4Array:
    """Quantizes `x` to NVFP4 in blocks of 16 along `axis`.

    Args:
      x: bf16, f16 or f32 array; `x.shape[axis]` must be a multiple of 16.
      axis: the quantized axis. It is stored last (like TransformerEngine's column-wise copy);
        `dequantize` restores the original layout.
      block_2d: 16x16 blocks (for weights): one scale per tile, stored once per row. The
        second-to-last axis of the stored layout must be a multiple of 16.
      rht: apply the Random Hadamard Transform along `axis` first (`apply_rht`); the tensor
        amax is taken after it, and `dequantize` applies the inverse.
      stochastic_rounding: round the E2M1 codes stochastically (NUMERICS section 7).
      key: a JAX PRNG key; required with `stochastic_rounding`, ignored otherwise.
      amax: an f32 scalar used instead of `max |x|` (after the RHT); larger values saturate.
      implementation: None, "reference" or "ffi" (see `nvfp4_jax.dispatch`).

    Returns:
      An `NVFP4Array` with packed codes, E4M3 scales and the f32 tensor amax.

    Example:
      >>> x = jnp.linspace(-3.0, 3.0, 32).reshape(2, 16)
      >>> q = quantize(x)
      >>> q.codes.shape, q.scales.shape, q.shape
      ((2, 8), (2, 1), (2, 16))

    """
    x = formats.as_float_array(x, "quantize")
    axis = _check_quantize_args(x, axis, block_2d, stochastic_rounding, key, amax, "quantize")
    words = key_words(key) if stochastic_rounding else None
    if dispatch.resolve(implementation, "quantize") == "ffi":
        impl = _quantize_ffi
    else:
        impl = _quantize_reference
    codes, scales, stored_amax = impl(
        x, axis, block_2d, rht, stochastic_rounding, words, amax, _sr_offset
    )
    return NVFP4Array(
        codes=codes,
        scales=scales,
        amax=stored_amax,
        dtype=jnp.dtype(x.dtype),
        axis=axis,
        block_2d=bool(block_2d),
        rht=bool(rht),
    )


def decode_factor(amax: jax.Array, scales: jax.Array) -> jax.Array:
    """Per-block decode factor `f32(s_b) * (A * RCP2688)`, shaped like `scales`."""
    return scales.astype(_F32) * global_decode_scale(amax)


def block_values(q: NVFP4Array, dtype=jnp.bfloat16) -> jax.Array:
    """Returns `value(code) * f32(s_b)` in the stored layout, without the tensor factor.

    These values have at most 6 significant bits, so they are exact in bf16: the operands of
    an emulated block-scaled GEMM, whose result is then multiplied by `A * RCP2688` of each
    operand (NUMERICS section 9). No inverse RHT is applied.
    """
    codes = formats.unpack_nibbles(q.codes)
    blocks = codes.reshape(*q.scales.shape, formats.BLOCK_SIZE)
    values = formats.scaled_code_values(blocks, q.scales.astype(_F32)[..., None])
    return values.reshape(codes.shape).astype(dtype)


def global_decode_scale(amax: jax.Array) -> jax.Array:
    """Returns the tensor decode factor `D = A * RCP2688` (a multiplication, NUMERICS 3)."""
    return jnp.asarray(amax).astype(_F32) * _F32(formats.RCP2688)


def _dequantize_reference(q: NVFP4Array) -> jax.Array:
    codes = formats.unpack_nibbles(q.codes)
    blocks = codes.reshape(*q.scales.shape, formats.BLOCK_SIZE)
    factor = decode_factor(q.amax, q.scales)[..., None]
    x_hat = formats.scaled_code_values(blocks, factor).reshape(codes.shape)
    if q.rht:
        x_hat = hadamard.apply_rht_reference(x_hat, inverse=True)
    return x_hat


def dequantize(q: NVFP4Array, dtype=jnp.float32, *, implementation: str | None = None) -> jax.Array:
    """Returns the tensor `q` encodes, in its logical shape, cast to `dtype`.

    `x_hat = value(code) * (f32(s_b) * (A * RCP2688))` in f32, then the inverse RHT if `q`
    was quantized with one, then the cast. A NaN amax gives NaN everywhere.

    Example:
      >>> x = jnp.full((16,), 1.5, jnp.float32)
      >>> dequantize(quantize(x)).tolist() == x.tolist()
      True

    """
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"dequantize: q must be an NVFP4Array, got {type(q).__name__}")
    dtype = jnp.dtype(dtype)
    if dtype not in formats.SUPPORTED_DTYPES:
        raise TypeError(f"dequantize: dtype must be bfloat16, float16 or float32, got {dtype}")
    use_ffi = dispatch.resolve(implementation, "dequantize") == "ffi"
    return jnp.moveaxis(_dequantize_stored(q, dtype, use_ffi), -1, q.axis)


def _dequantize_stored(q: NVFP4Array, dtype, use_ffi: bool) -> jax.Array:
    if q.amax.ndim:
        # A batch of tensors made by vmap (one amax each), dequantized outside of vmap.
        return jax.vmap(lambda one: _dequantize_stored(one, dtype, use_ffi))(q)
    if use_ffi:
        return dispatch.kernels().dequantize_ffi(q.codes, q.scales, q.amax, rht=q.rht, dtype=dtype)
    return _dequantize_reference(q).astype(dtype)


def _fake_quantize_reference(x, axis, block_2d, rht, sr, words, amax, global_scale, offset=0):
    xs, used, stored_amax = _prepare_reference(x, axis, rht, amax)
    codes, scales = _quantize_core(xs, used, words, block_2d, sr, offset)
    blocks = codes.reshape(*scales.shape, formats.BLOCK_SIZE)
    factor = decode_factor(stored_amax, scales) if global_scale else scales.astype(_F32)
    return formats.scaled_code_values(blocks, factor[..., None]).reshape(xs.shape)


def fake_quantize(
    x: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | None = None,
    amax: jax.Array | None = None,
    global_scale: bool = True,
    dtype=None,
    implementation: str | None = None,
    _sr_offset=0,
) -> jax.Array:
    """Quantizes and dequantizes in one step, without materializing packed codes.

    Takes `quantize`'s arguments and returns an array of x's shape. The values are those of
    `dequantize(quantize(x, ...))` except that no inverse RHT is applied (with `rht` the
    result stays in the rotated basis, as a GEMM of two rotated operands wants), and with
    `global_scale=False` the tensor factor `A * RCP2688` is left out: each value is then
    `value(code) * f32(s_b)`, exact in bf16, ready for an emulated block-scaled GEMM.

    Args:
      x: as in `quantize`.
      axis: as in `quantize`.
      block_2d: as in `quantize`.
      rht: as in `quantize`.
      stochastic_rounding: as in `quantize`.
      key: as in `quantize`.
      amax: as in `quantize`.
      global_scale: multiply by the tensor decode factor `A * RCP2688`.
      dtype: the result dtype (default: x's dtype).
      implementation: as in `quantize`.

    """
    x = formats.as_float_array(x, "fake_quantize")
    axis = _check_quantize_args(x, axis, block_2d, stochastic_rounding, key, amax, "fake_quantize")
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if dtype not in formats.SUPPORTED_DTYPES:
        raise TypeError(f"fake_quantize: dtype must be bfloat16, float16 or float32, got {dtype}")
    words = key_words(key) if stochastic_rounding else None
    if dispatch.resolve(implementation, "fake_quantize") == "ffi":
        stored = _fake_quantize_ffi(
            x,
            axis,
            block_2d,
            rht,
            stochastic_rounding,
            words,
            amax,
            global_scale,
            dtype,
            _sr_offset,
        )
    else:
        stored = _fake_quantize_reference(
            x, axis, block_2d, rht, stochastic_rounding, words, amax, global_scale, _sr_offset
        ).astype(dtype)
    return jnp.moveaxis(stored, -1, axis)


def _fake_quantize_ffi(x, axis, block_2d, rht, sr, words, amax, global_scale, dtype, offset=0):
    return dispatch.kernels().fake_quantize_ffi(
        *_ffi_operands(x, axis, rht, sr, words, amax, offset),
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=sr,
        global_scale=global_scale,
        dtype=dtype,
    )
