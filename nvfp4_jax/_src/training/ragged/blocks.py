"""The block math of many tensors at once: each row or block with its own tensor amax.

The reference's quantization (docs/NUMERICS.md sections 2, 7, 8), in jnp, where the encode
scale comes from an amax per row or per block rather than one per tensor: how `ragged_dot`
quantizes its groups' activations and gradients where the native grouped kernel does not
run (the two give the same bits).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.reference.quantize import encode_scale
from nvfp4_jax._src.core.reference.stochastic import stochastic_magnitude

_F32 = jnp.float32
_BLOCK = formats.BLOCK_SIZE


class Blocks(NamedTuple):
    """A quantized stored layout (R, C): unpacked codes uint8 (R, C), scales e4m3 (R, C/16)."""

    codes: jax.Array
    scales: jax.Array


def quantize_blocks(xs, amax, random) -> Blocks:
    """The reference's block math (docs/NUMERICS.md sections 2, 7, 8) with many tensor amaxes.

    `xs` is an f32 stored layout (R, C), quantized along C; `amax` the stored amax (NaN for
    a non-finite group) broadcast against the blocks (R, C/16): one per row or one per
    block, each its group's. `random`: the SR bytes uint8 (R, C), or None for nearest.
    """
    bad = formats.invalid_amax(amax)  # a NaN amax: a non-finite group
    s_enc = encode_scale(amax)
    s_dec = _F32(1) / s_enc
    blocks = xs.reshape(*xs.shape[:-1], xs.shape[-1] // _BLOCK, _BLOCK)
    block_max = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = jnp.minimum(block_max * (s_enc * _F32(formats.RCP6)), _F32(formats.E4M3_MAX))
    scales = scaled.astype(jnp.float8_e4m3fn)
    encode = jnp.minimum(_F32(1) / (scales.astype(_F32) * s_dec), _F32(formats.FLT_MAX))
    y = blocks * encode[..., None]
    magnitude = jnp.abs(y)
    if random is not None:
        magnitude = stochastic_magnitude(magnitude, random.reshape(y.shape))
    codes = formats.e2m1_magnitude_code(magnitude) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    bad = jnp.broadcast_to(bad, scales.shape)
    codes = jnp.where(bad[..., None], jnp.uint8(0), codes)
    nan = jax.lax.bitcast_convert_type(
        jnp.full(scales.shape, formats.E4M3_NAN_BYTE, jnp.uint8), jnp.float8_e4m3fn
    )
    scales = jnp.where(bad, nan, scales)
    return Blocks(codes.reshape(xs.shape), scales)


def block_values(q: Blocks, dtype) -> jax.Array:
    """`value(code) * f32(s_b)` (R, C) in `dtype`: an emulated GEMM operand (section 9)."""
    blocks = q.codes.reshape(*q.scales.shape, _BLOCK)
    values = formats.scaled_code_values(blocks, q.scales.astype(_F32)[..., None])
    return values.reshape(q.codes.shape).astype(dtype)


def pack(q: Blocks) -> Blocks:
    return Blocks(formats.pack_nibbles(q.codes), q.scales)


def unpack(q: Blocks) -> Blocks:
    return Blocks(formats.unpack_nibbles(q.codes), q.scales)
