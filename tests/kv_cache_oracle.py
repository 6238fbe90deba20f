"""An independent NumPy model of the NVFP4 KV cache: vLLM's writer, section 15, the kernel order.

Three parts, none importing `nvfp4_jax`:

* `vllm_write`: the page bytes vLLM's `reshape_and_cache_nvfp4` kernel writes, restated from
  vLLM's source (`csrc/libtorch_stable/quantization/fp4/nvfp4_kv_cache_kernels.cu`, the
  dispatch function's strides and the kernel's `data_dst` / `scale_dst` arithmetic and its
  `swizzle_scale_offset`) for the codes and scale bytes of every token. `swizzle` chooses
  the release: "v" (K linear, V swizzled: vLLM 0.25.1 and later), "kv" (both swizzled: the
  writer's first commit, c46deb95), "none" (linear: the SM120 fix, PRs 50085 / 55976).
* `quantize_heads`: docs/NUMERICS.md section 15's numbers, np.float32 step by step.
* `attention`: the native attention kernel's order (section 15), with its exp.

Shape letters: N tokens, G heads, E head size, S = E / 16.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numerics_oracle import e2m1_code_rn, e2m1_value, pack_nibbles, unpack_nibbles

F32 = np.float32
RCP6 = F32(1.0) / F32(6.0)
E4M3_MAX = F32(448.0)


# ------------------------------------------------------------------------------ vLLM's writer


def _swizzle_scale_offset(t: int, s: int, scale_dim: int) -> int:
    """vLLM's `swizzle_scale_offset(t, s, scale_dim)` (SM100 trtllm-gen scale layout)."""
    s_group = scale_dim // 4
    swizzled_t = (t // 4) * 4 + (s // s_group)
    swizzled_s = (s % s_group) * 4 + (t % 4)
    return swizzled_t * scale_dim + swizzled_s


def vllm_write(
    cache: np.ndarray,
    k_codes: np.ndarray,
    k_scales: np.ndarray,
    v_codes: np.ndarray,
    v_scales: np.ndarray,
    slot_mapping: np.ndarray,
    *,
    num_heads: int,
    head_size: int,
    block_size: int,
    hnd: bool,
    swizzle: str,
) -> None:
    """Writes N tokens into `cache`, uint8 (num_blocks, 2 * W) (a page: K side, then V side).

    `k_codes` (N, G, E/2) packed bytes, `k_scales` (N, G, S) scale bytes, likewise for V;
    `slot_mapping` (N,) int64, negative slots skipped. In vLLM `key_cache = kv_cache[:, 0]`
    and `value_cache = kv_cache[:, 1]` start W bytes apart in each page, `stride(0)` of both
    is the page's 2 * W bytes, and each side's scales start `data_per_kv` bytes after its
    data.
    """
    data_dim = head_size // 2
    scale_dim = head_size // 16
    full_dim = data_dim + scale_dim
    side_bytes = block_size * num_heads * full_dim
    flat = cache.reshape(-1)
    data_block_stride = 2 * side_bytes  # key_cache.stride(0), in bytes
    if hnd:
        data_head_stride, data_block_offset_stride = block_size * data_dim, data_dim
        scale_head_stride, scale_block_offset_stride = block_size * scale_dim, scale_dim
    else:
        data_head_stride, data_block_offset_stride = data_dim, num_heads * data_dim
        scale_head_stride, scale_block_offset_stride = scale_dim, num_heads * scale_dim
    data_per_kv = num_heads * block_size * data_dim
    for kv, (codes, scales) in enumerate(((k_codes, k_scales), (v_codes, v_scales))):
        data_cache = kv * side_bytes  # kv_cache[:, kv].data_ptr()
        scale_cache = data_cache + data_per_kv
        swizzled = swizzle == "kv" or (swizzle == "v" and kv == 1)
        for token, slot in enumerate(slot_mapping):
            if slot < 0:
                continue
            block_idx, block_offset = int(slot) // block_size, int(slot) % block_size
            data_block = data_cache + block_idx * data_block_stride
            scale_block = scale_cache + block_idx * data_block_stride
            for head in range(num_heads):
                for group in range(scale_dim):
                    data_dst = (
                        data_block
                        + head * data_head_stride
                        + block_offset * data_block_offset_stride
                    )
                    at = data_dst + group * 8
                    flat[at : at + 8] = codes[token, head, group * 8 : group * 8 + 8]
                    if swizzled:
                        offset = _swizzle_scale_offset(block_offset, group, scale_dim)
                        t, s = offset // scale_dim, offset % scale_dim
                    else:
                        t, s = block_offset, group
                    scale_dst = (
                        scale_block + head * scale_head_stride + t * scale_block_offset_stride + s
                    )
                    flat[scale_dst] = scales[token, head, group]


# ------------------------------------------------------------------------------ section 15


def _candidate(amax, s_enc, s, factor):
    scaled = np.minimum(s_enc * (amax * F32(factor)), E4M3_MAX).astype(F32)
    scale = scaled.astype(ml_dtypes.float8_e4m3fn)
    sf = scale.astype(F32)
    with np.errstate(divide="ignore"):
        encode = np.where(sf == 0, F32(0), F32(1) / (sf * s)).astype(F32)
    return scale, encode


def _squared_error(blocks, scale, encode, s):
    codes = e2m1_code_rn(blocks * encode[..., None])
    factor = (scale.astype(F32) * s)[..., None]
    d = (e2m1_value(codes) * factor - blocks).astype(F32)
    sq = (d * d).astype(F32)
    err = np.zeros(sq.shape[:-1], F32)
    for i in range(8):
        err = (err + (sq[..., 2 * i] + sq[..., 2 * i + 1])).astype(F32)
    return err


def quantize_heads(x: np.ndarray, s, four_over_six: bool = False):
    """(packed codes uint8 (..., E/2), scale bytes uint8 (..., S)) of f32 `x` (..., E)."""
    x = np.asarray(x, F32)
    s = F32(s)
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    amax = np.max(np.abs(blocks), axis=-1)
    bad = ~np.all(np.isfinite(blocks), axis=-1) | ~(np.isfinite(s) and s > 0)
    with np.errstate(all="ignore"):
        s_enc = F32(1) / s
        scale, encode = _candidate(amax, s_enc, s, RCP6)
        if four_over_six:
            scale4, encode4 = _candidate(amax, s_enc, s, 0.25)
            pick4 = _squared_error(blocks, scale4, encode4, s) < _squared_error(
                blocks, scale, encode, s
            )
            scale = np.where(pick4, scale4, scale)
            encode = np.where(pick4, encode4, encode)
        codes = e2m1_code_rn(blocks * encode[..., None])
    codes = np.where(bad[..., None], np.uint8(0), codes)
    scale_bytes = np.where(bad, np.uint8(0x7F), scale.view(np.uint8))
    return pack_nibbles(codes.reshape(x.shape)), scale_bytes.astype(np.uint8)


def dequantize_heads(codes: np.ndarray, scale_bytes: np.ndarray, s) -> np.ndarray:
    """`value(code) * (f32(sf) * s)`, f32 (..., E)."""
    sf = np.asarray(scale_bytes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
    values = e2m1_value(unpack_nibbles(codes)).reshape(*sf.shape, 16)
    return (values * (sf * F32(s))[..., None]).astype(F32).reshape(*sf.shape[:-1], -1)


# ------------------------------------------------------------------------------ attention order

_LOG2E, _LN2_HI, _LN2_LO = F32(1.44269504088896341), F32(0.693359375), F32(-2.12194440e-4)
_ROUND = F32(12582912.0)
_EXP_P = [
    F32(c)
    for c in (
        1.9875691500e-4,
        1.3981999507e-3,
        8.3334519073e-3,
        4.1665795894e-2,
        1.6666665459e-1,
        5.0000001201e-1,
    )
]
_TINY = F32(2.0**-126)


def kv_exp(x: np.ndarray) -> np.ndarray:
    """The kernel's exp (section 15), with XLA's threads' flush of subnormal results."""
    x = np.asarray(x, F32)
    nan = np.isnan(x)
    x = np.where(x < F32(-104), F32(-104), x)
    x = np.where(x > F32(88), F32(88), x)
    shifted = (x * _LOG2E + _ROUND).astype(F32)
    n = shifted.view(np.int32) - _ROUND.view(np.int32)
    nf = (shifted - _ROUND).astype(F32)
    r = (x - nf * _LN2_HI).astype(F32)
    r = (r - nf * _LN2_LO).astype(F32)
    p = np.full(x.shape, _EXP_P[0], F32)
    for c in _EXP_P[1:]:
        p = (p * r + c).astype(F32)
    p = (p * (r * r) + r + F32(1)).astype(F32)
    half = np.trunc(n / 2).astype(np.int32)
    a = ((half + 127) << 23).astype(np.int32).view(F32)
    b = ((n - half + 127) << 23).astype(np.int32).view(F32)
    y = ((p * a) * b).astype(F32)
    y = np.where(np.abs(y) < _TINY, F32(0), y)
    return np.where(nan, F32(np.nan), y)


def _dot16(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """sum over the last axis (E) in the kernel's 16-slot order: (..., E) x (..., E) -> (...)."""
    prods = (q * k).astype(F32)
    blocks = prods.reshape(*prods.shape[:-1], -1, 16)
    a = np.zeros(blocks.shape[:-2] + (16,), F32)
    for c in range(blocks.shape[-2]):
        a = (a + blocks[..., c, :]).astype(F32)
    s8 = (a[..., :8] + a[..., 8:]).astype(F32)
    s4 = (s8[..., :4] + s8[..., 4:]).astype(F32)
    s2 = (s4[..., :2] + s4[..., 2:]).astype(F32)
    return (s2[..., 0] + s2[..., 1]).astype(F32)


CHUNK = 256


def attention_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, seen: int, softmax_scale):
    """One query row (E,) over decoded k, v (L, E) of which it sees `seen` slots: f32 (E,)."""
    e = q.shape[-1]
    if seen <= 0:
        return np.zeros(e, F32)
    maxes, sums, outs = [], [], []
    for j0 in range(0, seen, CHUNK):
        j1 = min(j0 + CHUNK, seen)
        scores = (_dot16(np.broadcast_to(q, (j1 - j0, e)), k[j0:j1]) * F32(softmax_scale)).astype(
            F32
        )
        mx = F32(-np.inf)
        for s in scores:  # the kernel's `s > mx ? s : mx`: NaN never wins
            mx = s if s > mx else mx
        p = kv_exp((scores - mx).astype(F32))
        total = F32(0)
        out = np.zeros(e, F32)
        for j in range(j1 - j0):
            total = F32(total + p[j])
            out = (out + p[j] * v[j0 + j]).astype(F32)
        maxes.append(mx)
        sums.append(F32(np.nan) if np.isnan(scores).any() else total)
        outs.append(out)
    top = F32(-np.inf)
    for mx in maxes:
        top = mx if mx > top else top
    total = F32(0)
    out = np.zeros(e, F32)
    for mx, part, o in zip(maxes, sums, outs, strict=True):
        w = kv_exp(np.array(mx - top, F32))
        total = F32(total + w * part)
        out = (out + w * o).astype(F32)
    return (out / total).astype(F32)


def attention(q, k, v, lengths, softmax_scale):
    """q (B, T, H, E) f32, decoded k, v (B, L, G, E) f32, lengths (B,): f32 (B, T, H, E)."""
    b_all, t_all, h_all, _ = q.shape
    g_all = k.shape[2]
    out = np.zeros(q.shape, F32)
    for b in range(b_all):
        for t in range(t_all):
            seen = min(max(int(lengths[b]) - (t_all - 1 - t), 0), k.shape[1])
            for h in range(h_all):
                g = h // (h_all // g_all)
                out[b, t, h] = attention_row(
                    q[b, t, h], k[b, :, g], v[b, :, g], seen, softmax_scale
                )
    return out
