"""Layouts for handing NVFP4 tensors to Blackwell GEMMs and inference engines.

Shape letters: a scale matrix has `R` rows and `G = K / 16` columns (one E4M3 scale per 16
elements along the contraction axis K); leading dimensions, if any, are a batch of matrices.

* `swizzle_scales` / `unswizzle_scales`: the cuBLAS/cuDNN block-scale layout of
  docs/NUMERICS.md section 11. Zero-padded to `R % 128 == 0`, `G % 4 == 0`, flattened into
  512-byte tiles of 128 rows x 4 columns, tiles ordered by row block then column block, and
  inside a tile

      offset(r, c) = ((r // 128) * ceil(G / 4) + c // 4) * 512
                     + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)

  16x16 weight scales are already stored once per row (docs/NUMERICS.md section 4), so
  they swizzle like any other.
* `packed_shape` / `scales_shape`: the shapes of an `NVFP4Array`'s codes and scales.
* `GEMM_ALIGNMENT`, `pad_to_alignment`, `unpad`: FP4 GEMM kernels want K (and usually N) in
  multiples of 32 elements (16 bytes of packed FP4); zero padding adds nothing to a product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import checks, formats

# Rows and scale columns of one cuBLAS scale tile (128 x 4 scales = 512 bytes).
TILE_ROWS = 128
TILE_COLS = 4
TILE_BYTES = TILE_ROWS * TILE_COLS
# Elements along K that FP4 GEMM kernels need (16 bytes of packed codes).
GEMM_ALIGNMENT = 32


def swizzled_size(rows: int, cols: int) -> int:
    """Returns the number of scales in the swizzled layout of a `(rows, cols)` scale matrix.

    The layout is made of whole 128 x 4 tiles (docs/NUMERICS.md section 11): rows are padded to
    a multiple of `TILE_ROWS` and columns to a multiple of `TILE_COLS`.

    Example:
      >>> import nvfp4_jax
      >>> nvfp4_jax.layout.swizzled_size(200, 5)  # (256 rows) x (8 columns)
      2048

    """
    return _round_up(rows, TILE_ROWS) * _round_up(cols, TILE_COLS)


def swizzle_scales(scales: jax.Array) -> jax.Array:
    """Lays out scales `(..., R, G)` as the flat, zero-padded cuBLAS/cuDNN tiles.

    Args:
      scales: the block scales of one matrix `(R, G)` (e.g. `NVFP4Array.scales` of a 2-D
        tensor, G = K / 16), or a batch `(..., R, G)`, of any dtype (usually float8_e4m3fn).

    Returns:
      `(..., swizzled_size(R, G))` of the same dtype: scale `(r, c)` at `offset(r, c)` above,
      padding entries zero. jit-able.

    Example:
      >>> s = jnp.arange(8, dtype=jnp.float32).reshape(2, 4)
      >>> flat = swizzle_scales(s)
      >>> flat.shape, float(flat[16 + 1])   # (r=1, c=1) sits at 1 * 16 + 1
      ((512,), 5.0)

    """
    scales = jnp.asarray(scales)
    if scales.ndim < 2:
        raise ValueError(f"swizzle_scales: scales must be (..., rows, cols), got {scales.shape}")
    *lead, rows, cols = scales.shape
    pad_rows, pad_cols = -rows % TILE_ROWS, -cols % TILE_COLS
    widths = [(0, 0)] * len(lead) + [(0, pad_rows), (0, pad_cols)]
    padded = jnp.pad(scales, widths) if pad_rows or pad_cols else scales
    row_blocks, col_blocks = (rows + pad_rows) // TILE_ROWS, (cols + pad_cols) // TILE_COLS
    # r = rb * 128 + q * 32 + p and c = cb * 4 + j go to ((rb, cb) tile, p * 16 + q * 4 + j).
    tiles = padded.reshape(*lead, row_blocks, 4, 32, col_blocks, TILE_COLS)
    n = len(lead)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]  # (rb, cb, p, q, j)
    return jnp.transpose(tiles, order).reshape(*lead, -1)


def unswizzle_scales(flat: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Inverts `swizzle_scales`: flat tiles `(..., swizzled_size(R, G))` to `(..., R, G)`.

    Args:
      flat: the swizzled scales, a batch of them along leading dimensions.
      shape: `(R, G)`, the unpadded scale matrix shape.

    Returns:
      The scales `(..., R, G)`, padding dropped.
    """
    flat = jnp.asarray(flat)
    rows, cols = (int(d) for d in shape)
    size = swizzled_size(rows, cols)
    if flat.ndim < 1 or flat.shape[-1] != size:
        raise ValueError(
            f"unswizzle_scales: scales of shape {(rows, cols)} swizzle to {size} entries "
            f"(padded to {_round_up(rows, TILE_ROWS)} x {_round_up(cols, TILE_COLS)}), but the "
            f"last axis of the input of shape {flat.shape} has {flat.shape[-1:]}"
        )
    *lead, _ = flat.shape
    row_blocks, col_blocks = _ceil_div(rows, TILE_ROWS), _ceil_div(cols, TILE_COLS)
    tiles = flat.reshape(*lead, row_blocks, col_blocks, 32, 4, TILE_COLS)  # (rb, cb, p, q, j)
    n = len(lead)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]  # (rb, q, p, cb, j)
    padded = jnp.transpose(tiles, order).reshape(*lead, row_blocks * TILE_ROWS, -1)
    return padded[..., :rows, :cols]


def packed_shape(logical_shape: tuple[int, ...], axis: int = -1) -> tuple[int, ...]:
    """Returns the shape of the packed codes of a tensor quantized along `axis`.

    The quantized axis moves last and holds two codes per byte.

    Example:
      >>> packed_shape((64, 32), axis=0)
      (32, 32)

    """
    stored = _stored_shape(logical_shape, axis, "packed_shape")
    return (*stored[:-1], stored[-1] // 2)


def scales_shape(logical_shape: tuple[int, ...], axis: int = -1) -> tuple[int, ...]:
    """Returns the shape of the E4M3 scales of a tensor quantized along `axis`.

    Example:
      >>> scales_shape((64, 32))
      (64, 2)

    """
    stored = _stored_shape(logical_shape, axis, "scales_shape")
    return (*stored[:-1], stored[-1] // formats.BLOCK_SIZE)


def pad_to_alignment(x: jax.Array, axis: int = -1, multiple: int = GEMM_ALIGNMENT) -> jax.Array:
    """Zero-pads `x` at the end of `axis` to a multiple of `multiple` (see `unpad`).

    Example:
      >>> pad_to_alignment(jnp.ones((2, 48))).shape
      (2, 64)

    """
    x = jnp.asarray(x)
    axis = _check_axis(x.shape, axis, "pad_to_alignment")
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_to_alignment: multiple must be a positive int, got {multiple!r}")
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def unpad(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Keeps the first `size` entries of `axis` (undoes `pad_to_alignment`).

    Args:
      x: an array of any rank.
      axis: the axis to cut.
      size: how many leading entries of `axis` to keep, from 0 to `x.shape[axis]`.

    Returns:
      `x` with `axis` cut to `size` entries.

    Raises:
      ValueError: `axis` is out of range or `size` is outside `[0, x.shape[axis]]`.

    Example:
      >>> import jax.numpy as jnp, nvfp4_jax
      >>> padded = nvfp4_jax.pad_to_alignment(jnp.ones((3, 20)))
      >>> padded.shape, nvfp4_jax.unpad(padded, -1, 20).shape
      ((3, 32), (3, 20))

    """
    x = jnp.asarray(x)
    axis = _check_axis(x.shape, axis, "unpad")
    if not 0 <= size <= x.shape[axis]:
        raise ValueError(f"unpad: size {size} is outside [0, {x.shape[axis]}] for shape {x.shape}")
    return jax.lax.slice_in_dim(x, 0, size, axis=axis)


def _stored_shape(shape, axis, op):
    shape = tuple(int(d) for d in shape)
    axis = checks.normalize_axis(axis, shape, op)
    checks.check_blocks(shape, axis, False, op)
    return formats.stored_shape(shape, axis)


def _check_axis(shape, axis, op) -> int:
    return checks.normalize_axis(axis, tuple(shape), op) % len(shape)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b
