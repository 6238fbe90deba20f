"""The methods: how a weight's NVFP4 scales are chosen (round to nearest, MSE search, GPTQ).

* "max": round to nearest with the global amax `A = max |W|` (`quantize_max`).
* "mse": the factor c of `c * A` with the least squared weight error (`search_amax`).
* "gptq": GPTQ's rounding of the input channels in order, each one's error pushed onto the
  later ones through the inverse Hessian of the calibration inputs (`quantize_gptq`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import formats, ops
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.multihost import to_host
from nvfp4_jax._src.core.reference.quantize import block_amax, block_encode, encode_scale
from nvfp4_jax._src.core.spec import QuantSpec
from nvfp4_jax._src.model.ptq.settings import OP

_F32 = jnp.float32
# How often GPTQ multiplies its damping by 10 when H + damping is not positive definite.
_DAMP_RETRIES = 6


def group_amax(kernels: Sequence[jax.Array], paths: Sequence[str]) -> np.float32:
    """The group's max of `max |W|`, as `export_hf_checkpoint` computes it."""
    amaxes = []
    for kernel, path in zip(kernels, paths, strict=True):
        amax = np.float32(to_host(ops.tensor_amax(kernel, axis=0)))
        if not np.isfinite(amax):
            raise ValueError(f"{OP}: the kernel of {path!r} holds NaN or inf")
        amaxes.append(amax)
    return np.float32(max(amaxes))


def dequantized(q: NVFP4Array) -> np.ndarray:
    """`q` dequantized to f32, on the host as f64."""
    return np.asarray(to_host(ops.dequantize(q, _F32)), np.float64)


def _squared_error(q: NVFP4Array, w: np.ndarray) -> float:
    return float(np.sum(np.square(dequantized(q) - w)))


def quantize_max(kernel, amax: np.float32, block_2d: bool) -> NVFP4Array:
    """("max") Round to nearest along `in` with the global amax `amax`."""
    return ops.quantize(kernel, axis=0, block_2d=block_2d, amax=jnp.float32(amax))


def search_amax(kernels, amax: np.float32, block_2d: bool, grid: Sequence[float]):
    """("mse") The factor c and arrays of the least summed squared weight error.

    Tries `c * A` (an f32 product) for every c of `grid`, nearest to 1 first; a later c
    wins only with a strictly smaller error, so ties keep the c nearest to 1.
    """
    weights = [np.asarray(to_host(k), np.float64) for k in kernels]
    best = None
    for c in sorted(grid, key=lambda c: (abs(c - 1.0), c)):
        scaled = np.float32(c) * amax
        arrays = [quantize_max(k, scaled, block_2d) for k in kernels]
        error = sum(_squared_error(q, w) for q, w in zip(arrays, weights, strict=True))
        if best is None or error < best[0]:
            best = (error, float(c), scaled, arrays)
    return best[1], best[2], best[3]


@functools.partial(jax.jit, static_argnames=("block_2d",))
def gptq_codes(w: jax.Array, u: jax.Array, amax: jax.Array, *, block_2d: bool):
    """GPTQ's rounding of the stored weight `w` (out N, in K) f32 with the fixed global `amax`.

    `u` (K, K) f32 is the upper Cholesky factor of H^-1 (`H^-1 = u^T u`, zeros below the
    diagonal). The input channels (columns) run in order, in K-blocks of 16. At the start of
    a K-block its E4M3 scales are fixed from the current (error-updated) weights exactly as
    docs/NUMERICS.md section 2 steps 3-4 compute block scales (per output row, or per 16x16
    tile over 16 rows with `block_2d`), with `S_enc` of `amax`; then each column in turn
    rounds to the nearest E2M1 code with that scale (step 5; values above the scale's range
    saturate at 6), and its error `(w - q) / u[j, j]` is taken off the later columns
    (`w[:, l] -= err * u[j, l]`): within the block at once, beyond it after the block.

    Returns (codes uint8 (N, K) unpacked, scales float8_e4m3fn (N, K/16)).
    """
    n, k = w.shape
    size = formats.BLOCK_SIZE
    s_enc = encode_scale(amax)
    s_dec = _F32(1) / s_enc
    d = formats.decode_scale(amax)

    def block(b, carry):
        w, codes, scales = carry
        start = b * size
        wb = jax.lax.dynamic_slice(w, (0, start), (n, size))
        ub = jax.lax.dynamic_slice(u, (start, start), (size, size))
        block_max = block_amax(wb.reshape(n, 1, size), block_2d)[:, 0]  # tiles over 16 rows
        scaled = jnp.minimum(block_max * (s_enc * _F32(formats.RCP6)), _F32(formats.E4M3_MAX))
        s = scaled.astype(jnp.float8_e4m3fn)
        encode = block_encode(s, s_dec)
        factor = s.astype(_F32) * d

        def column(j, inner):
            wb, errors, block_codes = inner
            x = jax.lax.dynamic_index_in_dim(wb, j, axis=1, keepdims=False)
            y = x * encode
            magnitude = formats.e2m1_magnitude_code(jnp.abs(y))
            code = magnitude | (jnp.signbit(y).astype(jnp.uint8) << 3)
            q = formats.scaled_code_values(code, factor)  # exactly what dequantize gives
            row = jax.lax.dynamic_index_in_dim(ub, j, axis=0, keepdims=False)
            error = (x - q) / row[j]
            # Columns < j are done (u is upper triangular: row[:j] = 0); column j is read.
            wb = wb - error[:, None] * row[None, :]
            errors = jax.lax.dynamic_update_index_in_dim(errors, error, j, axis=1)
            block_codes = jax.lax.dynamic_update_index_in_dim(block_codes, code, j, axis=1)
            return wb, errors, block_codes

        inner = (wb, jnp.zeros((n, size), _F32), jnp.zeros((n, size), jnp.uint8))
        _, errors, block_codes = jax.lax.fori_loop(0, size, column, inner)
        rows = jax.lax.dynamic_slice(u, (start, 0), (size, k))
        # Columns before the block get zeros (u upper triangular), the block's are done.
        w = w - jnp.dot(errors, rows, precision=jax.lax.Precision.HIGHEST)
        codes = jax.lax.dynamic_update_slice(codes, block_codes, (0, start))
        scales = jax.lax.dynamic_update_slice(scales, s[:, None], (0, b))
        return w, codes, scales

    codes = jnp.zeros((n, k), jnp.uint8)
    scales = jnp.zeros((n, k // size), jnp.float8_e4m3fn)
    _, codes, scales = jax.lax.fori_loop(0, k // size, block, (w, codes, scales))
    return codes, scales


def inverse_hessian_factor(gram: np.ndarray, damp: float, path: str) -> tuple[np.ndarray, float]:
    """(the upper Cholesky factor of (H + lambda I)^-1 in f64, lambda / mean(diag H)).

    Dead inputs (diag 0: the channel was always 0) get diag 1, so they round to nearest and
    neither give nor take error. lambda = damp * mean(diag H), multiplied by 10 while the
    factorization fails. A Hessian holding NaN or inf is an error of its own: no damping
    makes it positive definite (calibration refuses such inputs before).
    """
    if not np.all(np.isfinite(gram)):
        raise ValueError(
            f"{OP}: the calibration Hessian of {path!r} is not finite: its inputs held NaN "
            "or inf, or overflowed float32 in X^T X; pass finite inputs of the model's "
            "usual range"
        )
    h = np.array(gram, np.float64)
    k = h.shape[0]
    diag = np.diagonal(h).copy()
    dead = ~(diag > 0)
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    mean = float(np.mean(np.diagonal(h)))
    relative = damp
    for _ in range(_DAMP_RETRIES):
        try:
            lower = np.linalg.cholesky(h + (relative * mean) * np.eye(k))
            inverse_lower = np.linalg.inv(lower)
            inverse = inverse_lower.T @ inverse_lower  # H^-1 (cholesky reads its lower half)
            upper = np.linalg.cholesky(inverse).T
            return np.triu(upper), relative
        except np.linalg.LinAlgError:
            relative *= 10
    raise ValueError(
        f"{OP}: the calibration Hessian of {path!r} is not positive definite even with "
        f"damping {relative / 10:g} x mean(diag H); raise gptq_damp"
    )


def _act_order(gram: np.ndarray) -> np.ndarray:
    """GPTQ's activation order, kept block-aligned (a permutation of the K input channels).

    The K-blocks by decreasing summed diag H, the channels of each block by decreasing diag
    H (a block's scale does not depend on the order of its channels).
    """
    diag = np.diagonal(gram)
    blocks = diag.reshape(-1, formats.BLOCK_SIZE)
    order = np.argsort(-blocks.sum(axis=1), kind="stable")
    within = np.argsort(-blocks, axis=1, kind="stable")
    return (order[:, None] * formats.BLOCK_SIZE + within[order]).reshape(-1)


def quantize_gptq(
    kernel: jax.Array,
    gram: np.ndarray,
    amax: np.float32,
    block_2d: bool,
    damp: float,
    act_order: bool,
    path: str,
) -> tuple[NVFP4Array, float]:
    """(the GPTQ-quantized kernel of the layer `path`, the relative damping used).

    See `gptq_codes`.
    """
    w = np.asarray(to_host(kernel), np.float32).T  # the stored (out, in) layout
    perm = _act_order(gram) if act_order else np.arange(w.shape[1])
    upper, relative = inverse_hessian_factor(gram[np.ix_(perm, perm)], damp, path)
    codes, scales = gptq_codes(
        jnp.asarray(w[:, perm]),
        jnp.asarray(upper, _F32),
        jnp.float32(amax),
        block_2d=block_2d,
    )
    codes, scales = np.asarray(codes), np.asarray(scales)
    inverse = np.argsort(perm)
    codes = codes[:, inverse]
    block_of = perm[:: formats.BLOCK_SIZE] // formats.BLOCK_SIZE  # processed block -> block
    scales = scales[:, np.argsort(block_of)]
    q = QuantSpec(axis=-2, block_2d=bool(block_2d)).array(
        formats.pack_nibbles(jnp.asarray(codes)),
        jnp.asarray(scales),
        jnp.float32(amax),
        kernel.dtype,
    )
    return q, relative


def output_error(gram: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float | None:
    """`tr(dW^T H dW) / tr(W^T H W)`: the relative squared output error on the calibration X."""
    delta = w_hat - w
    exact = float(np.sum((gram @ w) * w))
    if not exact > 0:
        return None
    return max(float(np.sum((gram @ delta) * delta)), 0.0) / exact
