"""cuBLAS scale swizzle (against docs/NUMERICS.md section 11 written as loops), shapes, padding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax import quantize
from nvfp4_jax._src.core import layout


def swizzle_oracle(scales: np.ndarray) -> np.ndarray:
    """docs/NUMERICS.md section 11 element by element: offset(r, c) for all (r, c), zero pads."""
    rows, cols = scales.shape
    padded_rows, padded_cols = math.ceil(rows / 128) * 128, math.ceil(cols / 4) * 4
    out = np.zeros(padded_rows * padded_cols, scales.dtype)
    for r in range(rows):
        for c in range(cols):
            offset = (
                ((r // 128) * math.ceil(cols / 4) + c // 4) * 512
                + (r % 32) * 16
                + ((r % 128) // 32) * 4
                + (c % 4)
            )
            out[offset] = scales[r, c]
    return out


def distinct_scales(rows, cols, lead=(), seed=0):
    """Distinct nonzero values, so a misplaced or dropped scale cannot go unnoticed."""
    count = math.prod(lead) * rows * cols
    values = np.random.default_rng(seed).permutation(count).astype(np.float32) + 1
    return values.reshape(*lead, rows, cols)


SHAPES = [(128, 4), (1, 1), (16, 2), (100, 7), (256, 12), (300, 9)]


@pytest.mark.parametrize("rows,cols", SHAPES, ids=[f"r{r}_c{c}" for r, c in SHAPES])
def test_swizzle_matches_numerics_formula(rows, cols):
    scales = distinct_scales(rows, cols)
    np.testing.assert_array_equal(np.asarray(layout.swizzle_scales(scales)), swizzle_oracle(scales))


@pytest.mark.parametrize("rows,cols", SHAPES, ids=[f"r{r}_c{c}" for r, c in SHAPES])
def test_unswizzle_inverts_swizzle(rows, cols):
    scales = distinct_scales(rows, cols)
    flat = layout.swizzle_scales(scales)
    assert flat.shape == (layout.swizzled_size(rows, cols),)
    np.testing.assert_array_equal(np.asarray(layout.unswizzle_scales(flat, (rows, cols))), scales)


def test_padding_is_zero_and_sized_in_whole_tiles():
    flat = np.asarray(layout.swizzle_scales(distinct_scales(130, 5)))
    assert flat.size == 2 * 2 * layout.TILE_BYTES  # 2 row blocks x 2 column blocks
    assert np.count_nonzero(flat) == 130 * 5


def test_leading_dims_swizzle_each_matrix():
    batch = distinct_scales(40, 6, lead=(2, 3))
    flat = np.asarray(layout.swizzle_scales(batch))
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(flat[i, j], swizzle_oracle(batch[i, j]))
    np.testing.assert_array_equal(np.asarray(layout.unswizzle_scales(flat, (40, 6))), batch)


def test_swizzle_jit_and_e4m3_weight_scales_from_2d_blocks():
    w = jax.random.normal(jax.random.key(0), (256, 48), jnp.float32)
    q = quantize(w, axis=0, block_2d=True)  # stored (48, 256): scales (48, 16), one per row
    flat = jax.jit(layout.swizzle_scales)(q.scales)
    assert flat.dtype == jnp.float8_e4m3fn
    expected = swizzle_oracle(np.asarray(q.scales).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(flat).astype(np.float32), expected)
    back = jax.jit(layout.unswizzle_scales, static_argnums=1)(flat, q.scales.shape)
    np.testing.assert_array_equal(
        np.asarray(back).view(np.uint8), np.asarray(q.scales).view(np.uint8)
    )


def test_unswizzle_rejects_wrong_length():
    with pytest.raises(ValueError, match="swizzle to 512 entries"):
        layout.unswizzle_scales(jnp.zeros((500,)), (128, 4))


@pytest.mark.parametrize("axis", [-1, 0, 1], ids=lambda a: f"axis{a}")
def test_packed_and_scales_shape_match_quantize(axis):
    shape = (32, 48, 64)
    q = quantize(jnp.ones(shape), axis=axis)
    assert layout.packed_shape(shape, axis) == q.codes.shape
    assert layout.scales_shape(shape, axis) == q.scales.shape


def test_shapes_reject_unaligned_axis():
    with pytest.raises(ValueError, match="not a multiple of 16"):
        layout.packed_shape((4, 24))


def test_pad_to_alignment_and_unpad_round_trip():
    x = jnp.arange(3 * 48, dtype=jnp.float32).reshape(3, 48)
    padded = layout.pad_to_alignment(x, axis=1)
    assert padded.shape == (3, 64) and layout.GEMM_ALIGNMENT == 32
    assert float(jnp.abs(padded[:, 48:]).sum()) == 0.0
    np.testing.assert_array_equal(layout.unpad(padded, 1, 48), x)
    assert layout.pad_to_alignment(x, axis=0, multiple=4).shape == (4, 48)
    assert layout.pad_to_alignment(padded, axis=1) is padded


def test_padding_k_leaves_the_product_unchanged():
    x = jax.random.normal(jax.random.key(1), (8, 48))
    w = jax.random.normal(jax.random.key(2), (48, 16))
    padded = layout.pad_to_alignment(x, axis=1) @ layout.pad_to_alignment(w, axis=0)
    np.testing.assert_allclose(padded, x @ w, rtol=1e-6, atol=1e-5)
