"""The operands of `ragged_dot` (nvfp4_jax/_src/training/ragged/operands.py, groups.py,
blocks.py and the native grouped quantize): every group and expert quantized as its own
tensor, bit for bit the dense operands (the contract of docs/NUMERICS.md section 12), in the
documented grouped padded layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits
from ragged_oracle import IMPLEMENTATIONS, data

from nvfp4_jax import NVFP4Recipe, QuantSpec, kernels
from nvfp4_jax._src.core import backends, sr_keys
from nvfp4_jax._src.core.formats import decode_scale
from nvfp4_jax._src.training.ragged.blocks import block_values
from nvfp4_jax._src.training.ragged.groups import find_groups, padded_rows
from nvfp4_jax._src.training.ragged.operands import quantize_rows, quantize_tokens

# --- the operands: bit for bit the dense ones (the contract of NUMERICS section 12) ---------


@functools.partial(jax.jit, static_argnames=("recipe",))
def ragged_operands(x, dy, group_sizes, key, recipe):
    """The four activation/gradient operands `ragged_dot` builds, as f32 block values (the
    stored layouts: rows (M, C), padded tokens (C, Mp)) and per-group decode factors D."""
    g = 4
    groups = find_groups(group_sizes, x.shape[0])
    dgrad_words, wgrad_words = sr_keys.group_sr_words(
        key, dy, groups.row_group, g, recipe.implementation
    )
    out = {}
    for name, (q, amax) in {
        "x": quantize_rows(x, groups, g, recipe),
        "dy": quantize_rows(dy, groups, g, recipe, dgrad_words),
        "x_tokens": quantize_tokens(x, groups, g, recipe),
        "dy_tokens": quantize_tokens(dy, groups, g, recipe, wgrad_words),
    }.items():
        out[name] = (block_values(q, jnp.float32), decode_scale(amax))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("key_kind", ["key", "none"])
def test_operands_are_bit_for_bit_the_dense_ones(key_kind, implementation):
    """Every quantized operand of every group, against `dot_general`'s own construction on
    that group's rows alone (reference implementation): values, scales and positions of the
    SR bits, and the tensor decode factor; the padded positions outside the groups are 0.
    With "ffi" on the CPU the groups are quantized by the native grouped kernel."""
    from nvfp4_jax._src.core import ops  # noqa: PLC0415
    from nvfp4_jax._src.training import gemm  # noqa: PLC0415
    from nvfp4_jax._src.training.dot_general import pad_tokens  # noqa: PLC0415

    m, sizes = 80, [5, 0, 37, 22]
    x, _, dy = data(m, 64, 32, 4, 10)
    key = jax.random.key(9) if key_kind == "key" else None
    recipe = NVFP4Recipe(implementation=implementation)
    assert backends.runs_natively("grouped_quantize", implementation) == (implementation == "ffi")
    got = ragged_operands(x, dy, jnp.array(sizes, jnp.int32), key, recipe)
    ref = functools.partial(
        gemm.quantize_operand, backend="emulated", dtype=jnp.float32, implementation="reference"
    )

    @jax.jit  # per group shape; quantization alone is the same bits jitted as eagerly
    def dense_operands(x_g, dy_g, key_g):
        dgrad_key, wgrad_key = jax.random.split(key_g)
        q_x_tokens = ops.quantize(pad_tokens(x_g), axis=0, rht=True, implementation="reference")
        sr = dict(stochastic_rounding=True)
        return {
            "x": (lambda o: (o.data, o.decode))(ref(x_g, QuantSpec(axis=-1))),
            "dy": (lambda o: (o.data, o.decode))(
                ref(dy_g, QuantSpec(axis=-1, **sr), key=dgrad_key)
            ),
            "x_tokens": (ops.block_values(q_x_tokens, jnp.float32), q_x_tokens.global_scale),
            "dy_tokens": (lambda o: (o.data, o.decode))(
                ref(pad_tokens(dy_g), QuantSpec(axis=0, rht=True, **sr), key=wgrad_key)
            ),
        }

    start, offset = 0, 0
    used = np.zeros(padded_rows(m, 4), bool)
    for g, size in enumerate(sizes):
        end, padded = start + size, -(-size // 16) * 16
        x_g, dy_g = x[start:end], dy[start:end]
        key_g = sr_keys.gradient_key(dy_g) if key is None else jax.random.fold_in(key, g)
        expected = dense_operands(x_g, dy_g, key_g)
        for name, (values, decode) in expected.items():
            actual, d = got[name]
            if name.endswith("tokens"):
                actual = actual[:, offset : offset + padded]
            else:
                actual = actual[start:end]
            assert_same_bits(actual, values, f"{name} values of group {g}")
            assert_same_bits(d[g], decode, f"{name} decode factor of group {g}")
        used[offset : offset + padded] = True
        start, offset = end, offset + padded
    for name in ("x_tokens", "dy_tokens"):
        assert not np.any(np.asarray(got[name][0])[:, ~used]), f"{name} outside the groups"
    for name in ("x", "dy"):
        assert not np.any(np.asarray(got[name][0])[start:]), f"{name} after the groups"


# --- the grouped padded layout ---------------------------------------------------------------


def test_grouped_padded_layout_is_the_documented_one():
    # docs/NUMERICS.md section 12: Mp = ceil16(M + 15 G); group g at P_g = sum of the
    # earlier groups' sizes rounded up to 16; position P_g + t holds row start_g + t.
    m, sizes = 80, [5, 0, 37, 22]
    assert padded_rows(m, 4) == 144
    layout = find_groups(jnp.array(sizes, jnp.int32), m)
    assert np.asarray(layout.padded_sizes).tolist() == [16, 0, 48, 32]
    rows = np.full(144, m)
    rows[0:5] = np.arange(0, 5)
    rows[16:53] = np.arange(5, 42)
    rows[64:86] = np.arange(42, 64)
    np.testing.assert_array_equal(np.asarray(layout.pad_row), rows)
    groups = np.full(144, 4)
    groups[0:16], groups[16:64], groups[64:96] = 0, 2, 3
    np.testing.assert_array_equal(np.asarray(layout.pad_group), groups)
    np.testing.assert_array_equal(
        np.asarray(layout.row_group), [0] * 5 + [2] * 37 + [3] * 22 + [4] * 16
    )


@pytest.mark.skipif(not kernels.is_available("cpu"), reason="no native CPU kernels")
def test_native_grouped_quantize_rejects_bounds_outside_x_and_fills_nan_groups():
    x = jnp.ones((32, 64), jnp.float32)
    keys = jnp.zeros((2, 2), jnp.uint32)
    amax = jnp.array([1.0, jnp.nan], jnp.float32)
    codes, scales = kernels.grouped_quantize(
        x, jnp.array([[0, 8], [8, 4]]), amax, keys, columns=False, stochastic_rounding=False
    )
    scale_bytes = np.asarray(scales).view(np.uint8)
    assert np.all(scale_bytes[8:12] == 0x7F) and not np.any(np.asarray(codes)[8:12])
    assert not np.any(scale_bytes[12:]) and not np.any(np.asarray(codes)[12:])
    bad = {
        "rows": (jnp.array([[0, 8], [30, 4]]), False),
        "negative": (jnp.array([[0, 8], [-16, 8]]), False),
        "unaligned columns": (jnp.array([[0, 16], [24, 16]]), True),
        "columns": (jnp.array([[0, 16], [64, 16]]), True),
    }
    for bounds, columns in bad.values():
        with pytest.raises(Exception, match="nvfp4_grouped_quantize: group 1 spans"):
            jax.block_until_ready(
                kernels.grouped_quantize(
                    x, bounds, amax, keys, columns=columns, stochastic_rounding=False
                )
            )
