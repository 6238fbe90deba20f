"""The NVFP4 `ragged_dot` (nvfp4_jax/_src/training/ragged/ragged_dot.py, the grouped GEMM of a
dropless MoE): every group is its own dense layer, bit for bit the per-group `dot_general`
(the oracle of ragged_oracle.py), NaN kept in its group, the saved residuals, the error
against jax's ragged_dot, group-offset shards, the arguments, and what jax.lax.ragged_dot
returns for empty dimensions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits
from ragged_oracle import (
    NATIVE,
    VMAP_SIZES,
    assert_equals_group_loop,
    assert_same_up_to_summation_order,
    data,
    group_loop,
    one_sequence_vjp,
    ragged_vjp,
    recipe_of,
)

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe, ragged_dot

# --- bit for bit the per-group dot_general -------------------------------------------------

# name -> (M, group sizes): sizes not multiples of 16, an empty group, all in one, a sum
# below M (rows after the groups), every group a multiple of 16.
SIZES = {
    "ragged_5_0_37_22_of_80": (80, [5, 0, 37, 22]),
    "all_in_one_64_0_0_0": (64, [64, 0, 0, 0]),
    "aligned_16_32_0_8_of_56": (56, [16, 32, 0, 8]),
}
CASES = [
    ("ragged_5_0_37_22_of_80", "default", "reference", "key"),
    ("ragged_5_0_37_22_of_80", "default", NATIVE, "none"),
    ("all_in_one_64_0_0_0", "default", NATIVE, "key"),
    ("aligned_16_32_0_8_of_56", "no_rht", NATIVE, "key"),
    ("ragged_5_0_37_22_of_80", "all_off", NATIVE, "key"),
    ("ragged_5_0_37_22_of_80", "w1d", NATIVE, "none"),
]


@pytest.mark.parametrize(
    "sizes_name, recipe_name, implementation, key_kind",
    CASES,
    ids=["-".join(c) for c in CASES],
)
def test_equals_per_group_dot_general(sizes_name, recipe_name, implementation, key_kind):
    m, sizes = SIZES[sizes_name]
    x, w, dy = data(m, 64, 32, len(sizes), 1)
    key = jax.random.key(7) if key_kind == "key" else None
    # The native GEMM's order is fixed: bit for bit. The reference's GEMM is XLA's dot, whose
    # order is XLA's (docs/NUMERICS.md section 9): up to summation order, its operands exact.
    recipe, exact = recipe_of(recipe_name, implementation), implementation != "reference"
    assert_equals_group_loop(x, w, sizes, dy, key, recipe, exact=exact)


@pytest.mark.slow
def test_bf16_inputs_equal_per_group_dot_general():
    x, w, dy = data(48, 32, 48, 3, 2, jnp.bfloat16)
    recipe = NVFP4Recipe(implementation=NATIVE)
    y, dx, dw = assert_equals_group_loop(x, w, [7, 19, 17], dy, jax.random.key(1), recipe)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16


@pytest.mark.slow
def test_group_sizes_are_traced_one_compilation_serves_all():
    x, w, dy = data(64, 32, 32, 4, 3)
    key, recipe = jax.random.key(2), NVFP4Recipe(implementation=NATIVE)
    before = ragged_vjp._cache_size()
    for sizes in ([1, 2, 3, 4], [0, 0, 64, 0], [30, 0, 0, 17]):
        # [1, 2, 3, 4]: XLA's CPU GEMM sums dW[3] (at padded offset 48) in another order.
        assert_equals_group_loop(x, w, sizes, dy, key, recipe, exact=False)
    assert ragged_vjp._cache_size() - before <= 1


def test_grad_under_jit_equals_the_vjp():
    x, w, dy = data(80, 64, 32, 4, 4)
    sizes, key = jnp.array([5, 0, 37, 22], jnp.int32), jax.random.key(3)

    def loss(a, b, gs):
        return jnp.sum(ragged_dot(a, b, gs, key=key) * dy)

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, sizes)
    _, dx, dw = ragged_vjp(x, w, sizes, dy, key, NVFP4Recipe())
    assert_same_bits(gx, dx, "dx")
    assert_same_bits(gw, dw, "dW")


def test_group_sizes_summing_past_m_stop_at_row_m():
    # As in jax.lax.ragged_dot, the groups end at row M: [40, 40, 40] of 64 is [40, 24, 0].
    x, w, dy = data(64, 32, 32, 3, 5)
    key, recipe = jax.random.key(4), NVFP4Recipe(implementation=NATIVE)
    over = ragged_vjp(x, w, jnp.array([40, 40, 40], jnp.int32), dy, key, recipe)
    clipped = ragged_vjp(x, w, jnp.array([40, 24, 0], jnp.int32), dy, key, recipe)
    for a, b in zip(over, clipped, strict=True):
        assert_same_bits(a, b)


def test_all_groups_empty_gives_zeros_without_nan():
    x, w, dy = data(32, 32, 16, 3, 6)
    for key in (jax.random.key(0), None):
        y, dx, dw = ragged_vjp(x, w, jnp.zeros((3,), jnp.int32), dy, key, NVFP4Recipe())
        for name, a in (("y", y), ("dx", dx), ("dW", dw)):
            np.testing.assert_array_equal(np.asarray(a), 0.0, err_msg=name)


# --- each group its own tensor: NaN stays in its group --------------------------------------


def test_nan_in_one_group_poisons_only_that_group():
    m, sizes = 80, [5, 0, 37, 22]
    x, w, dy = data(m, 64, 32, 4, 7)
    gs, key, recipe = jnp.array(sizes, jnp.int32), jax.random.key(5), NVFP4Recipe()
    clean = ragged_vjp(x, w, gs, dy, key, recipe)
    bounds = [(0, 5), (5, 5), (5, 42), (42, 64)]

    # A NaN in group 2's rows of x: y of group 2 and dW[2] are NaN, the rest unchanged.
    y, dx, dw = ragged_vjp(x.at[10, 3].set(jnp.nan), w, gs, dy, key, recipe)
    assert np.all(np.isnan(np.asarray(y[5:42]))) and np.all(np.isnan(np.asarray(dw[2])))
    for g, (start, end) in enumerate(bounds):
        if g != 2:
            assert_same_bits(y[start:end], clean[0][start:end], f"y of group {g}")
            assert_same_bits(dw[g], clean[2][g], f"dW of group {g}")
    assert_same_bits(y[64:], clean[0][64:], "y after the groups")
    assert_same_bits(dx, clean[1], "dx (does not read x)")

    # A NaN in group 3's rows of dy: dx rows of group 3 and dW[3] are NaN, the rest unchanged;
    # also with key=None, where each group's key is derived from its own rows of dy only.
    for k in (key, None):
        clean_k = clean if k is key else ragged_vjp(x, w, gs, dy, None, recipe)
        _, dx, dw = ragged_vjp(x, w, gs, dy.at[50, 0].set(jnp.nan), k, recipe)
        assert np.all(np.isnan(np.asarray(dx[42:64]))) and np.all(np.isnan(np.asarray(dw[3])))
        assert_same_bits(dx[:42], clean_k[1][:42], "dx of groups 0-2")
        assert_same_bits(dx[64:], clean_k[1][64:], "dx after the groups")
        assert_same_bits(dw[:3], clean_k[2][:3], "dW of groups 0-2")

    # A NaN in the rows after the groups reaches nothing.
    y, dx, dw = ragged_vjp(x.at[70, 0].set(jnp.nan), w, gs, dy.at[75, 0].set(jnp.nan), key, recipe)
    for a, b, name in zip((y, dx, dw), clean, ("y", "dx", "dW"), strict=True):
        assert_same_bits(a, b, name)


def test_forward_saves_quantized_residuals_not_inputs():
    m, k, n, g = 64, 128, 32, 4
    x, w, _ = data(m, k, n, g, 8)
    gs = jnp.array([10, 20, 0, 30], jnp.int32)
    _, pullback = jax.vjp(lambda a, b: ragged_dot(a, b, gs, key=jax.random.key(0)), x, w)
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(pullback) if hasattr(leaf, "dtype")]
    arrays = [leaf for leaf in leaves if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)]
    big_float = [
        (a.dtype, a.shape)
        for a in arrays
        if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > 1 and a.size >= 256
    ]
    assert not big_float, f"high-precision residuals were saved: {big_float}"
    assert sum(a.nbytes for a in arrays) < (x.nbytes + w.nbytes) / 5


# --- against the unquantized ragged_dot ----------------------------------------------------


def test_within_nvfp4_error_of_jax_ragged_dot():
    m, k, n = 256, 128, 64
    x, w, dy = (
        jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(m, k), (4, k, n), (m, n)])
    )
    gs = jnp.array([100, 0, 90, 50], jnp.int32)  # 16 rows after the groups
    y, dx, dw = ragged_vjp(x, w, gs, dy, jax.random.key(6), NVFP4Recipe())
    y_ref, pullback = jax.vjp(
        lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=jax.lax.Precision.HIGHEST), x, w
    )
    dx_ref, dw_ref = pullback(dy)
    for what, actual, exact in (("y", y, y_ref), ("dx", dx, dx_ref), ("dW", dw, dw_ref)):
        a, e = np.asarray(actual, np.float64), np.asarray(exact, np.float64)
        if what != "dW":  # the 16 rows after the groups: zero in both
            assert not np.any(a[240:]) and not np.any(e[240:]), f"{what}: rows after the groups"
        for g in range(4) if what == "dW" else [None]:
            ag, eg = (a, e) if g is None else (a[g], e[g])
            if not np.any(eg):
                assert not np.any(ag), f"{what}[{g}] should be zero"
                continue
            rel = np.linalg.norm(ag - eg) / np.linalg.norm(eg)
            # The dense recipe's budget (tests/training/test_dot_general.py): about 0.15-0.18.
            assert rel < 0.23, f"{what}[{g}]: relative error {rel:.4f}"


@functools.partial(jax.jit, static_argnames=("recipe",))
def shard_vjp(x, w_local, group_sizes, offset, dy, key, recipe):
    """(y, dx, dW_local) of an expert-parallel shard's `ragged_dot(..., group_offset=)`."""

    def f(a, b):
        return ragged_dot(a, b, group_sizes, group_offset=offset, recipe=recipe, key=key)

    y, pullback = jax.vjp(f, x, w_local)
    return (y, *pullback(dy))


@pytest.mark.slow
@pytest.mark.parametrize("key_kind", ["key", "none"])
def test_group_offset_shards_give_the_unsharded_groups(key_kind):
    """A shard with experts o..o+G_local-1 computes their groups as the unsharded call does
    (group g with `fold_in(key, g)`), zeros elsewhere; one compilation for every offset."""
    m, sizes = 80, [5, 0, 37, 22, 30]  # the groups stop at row 80: the last has 16 rows
    x, w, dy = data(m, 64, 32, len(sizes), 11)
    key = jax.random.key(5) if key_kind == "key" else None
    recipe = NVFP4Recipe(implementation=NATIVE)
    loop = group_loop(x, w, sizes, dy, key, recipe, jit=NATIVE == "reference")
    before = shard_vjp._cache_size()
    for offset in (0, 2, 4):  # the shard at 4 holds expert 4 and a fifth past the last (empty)
        w_local = jnp.concatenate([w, jnp.zeros_like(w[:1])])[offset : offset + 2]
        y, dx, dw = shard_vjp(x, w_local, jnp.asarray(sizes), jnp.int32(offset), dy, key, recipe)
        assert y.shape == (m, 32) and dx.shape == x.shape and dw.shape == w_local.shape
        mine = np.zeros(m, bool)
        for j in range(2):
            if offset + j >= len(sizes):
                assert not np.any(np.asarray(dw[j])), f"dW of expert {offset + j} (no group)"
                continue
            start, end, y_g, dx_g, dw_g = loop[offset + j]
            mine[start:end] = True
            what = f"group {offset + j} of the shard at {offset}"
            if NATIVE == "reference":
                assert_same_up_to_summation_order(y[start:end], y_g, 64, f"y of {what}")
                assert_same_up_to_summation_order(dw[j], dw_g, 48, f"dW of {what}")
            else:
                assert_same_bits(y[start:end], y_g, f"y of {what}")
                assert_same_bits(dx[start:end], dx_g, f"dx of {what}")
                assert_same_bits(dw[j], dw_g, f"dW of {what}")
        assert not np.any(np.asarray(y)[~mine]), f"y outside the shard at {offset}"
        assert not np.any(np.asarray(dx)[~mine]), f"dx outside the shard at {offset}"
    assert shard_vjp._cache_size() - before == 1


def test_group_offset_bad_values_raise_clear_errors():
    lhs, rhs, gs = jnp.ones((32, 32)), jnp.ones((2, 32, 16)), jnp.array([8, 8, 16])
    with pytest.raises(TypeError, match="group_offset must be an integer array"):
        ragged_dot(lhs, rhs, gs, group_offset=1.0)
    with pytest.raises(TypeError, match="group_offset must be an integer array, got dtype"):
        ragged_dot(lhs, rhs, gs, group_offset=jnp.ones((1,)))
    with pytest.raises(ValueError, match=r"group_offset must be a scalar or have shape \(1,\)"):
        ragged_dot(lhs, rhs, gs, group_offset=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"G >= G_local = 2 .* got shape \(1,\)"):
        ragged_dot(lhs, rhs, jnp.array([32]), group_offset=0)
    # Without an offset, group_sizes must match rhs's experts, as in jax.lax.ragged_dot.
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(G,\) = \(2,\)"):
        ragged_dot(lhs, rhs, gs)


# --- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, gs, lhs_dtype, error, message",
    [
        ((2, 32, 64), (2, 64, 32), [1, 1], "float32", ValueError, r"lhs must be 2-D"),
        ((32, 64), (64, 32), [32], "float32", ValueError, r"rhs must be 3-D"),
        ((32, 64), (2, 64, 32), [16, 16, 0], "float32", ValueError, r"group_sizes must have shape"),
        ((32, 64), (2, 64, 32), [[16, 16]], "float32", ValueError, r"group_sizes must have shape"),
        ((32, 64), (2, 64, 32), [16.0, 16.0], "float32", TypeError, r"group_sizes must be an int"),
        ((32, 64), (2, 48, 32), [16, 16], "float32", ValueError, r"contracting sizes of lhs"),
        ((32, 40), (2, 40, 32), [16, 16], "float32", ValueError, r"contracting \(K\).* got 40"),
        ((32, 64), (2, 64, 40), [16, 16], "float32", ValueError, r"rhs free \(N\).* got 40"),
        ((32, 64), (2, 64, 32), [16, 16], "int32", TypeError, r"lhs must be bfloat16"),
    ],
    ids=[
        "lhs_3d",
        "rhs_2d",
        "group_sizes_length",
        "group_sizes_2d",
        "group_sizes_float",
        "k_mismatch",
        "k_not_16",
        "n_not_16",
        "int_lhs",
    ],
)
def test_bad_arguments_raise_clear_errors(lhs_shape, rhs_shape, gs, lhs_dtype, error, message):
    lhs = jnp.ones(lhs_shape, lhs_dtype)
    rhs = jnp.ones(rhs_shape, jnp.float32)
    with pytest.raises(error, match=message):
        ragged_dot(lhs, rhs, jnp.asarray(gs))


def test_bad_options_raise_clear_errors():
    lhs, rhs, gs = jnp.ones((32, 32)), jnp.ones((2, 32, 16)), jnp.array([16, 16])
    with pytest.raises(TypeError, match="rhs must be bfloat16"):
        ragged_dot(lhs, rhs.astype(jnp.int8), gs)
    with pytest.raises(TypeError, match="preferred_element_type must be a float"):
        ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.int32)
    with pytest.raises(TypeError, match="recipe must be an NVFP4Recipe"):
        ragged_dot(lhs, rhs, gs, recipe="default")
    with pytest.raises(TypeError, match="group_sizes must be an integer array"):
        ragged_dot(lhs, rhs, None)


def test_signature_and_dtypes_follow_jax_ragged_dot():
    assert nvfp4_jax.ragged_dot is ragged_dot
    lhs, rhs = jnp.ones((48, 32), jnp.bfloat16), jnp.ones((3, 32, 16), jnp.bfloat16)
    gs = jnp.array([8, 0, 24], jnp.int32)
    for preferred in (None, jnp.float32):
        y = ragged_dot(lhs, rhs, gs, None, preferred)
        assert y.dtype == jax.lax.ragged_dot(lhs, rhs, gs, None, preferred).dtype
        assert y.shape == (48, 16)
    # All-ones data is exact in NVFP4: the products are exact.
    np.testing.assert_array_equal(np.asarray(y[:32], np.float32), 32.0)
    np.testing.assert_array_equal(np.asarray(y[32:], np.float32), 0.0)
    # No groups at all: a zero result, as jax.lax.ragged_dot.
    empty = ragged_dot(jnp.ones((16, 32)), jnp.ones((0, 32, 16)), jnp.zeros((0,), jnp.int32))
    assert empty.shape == (16, 16) and not np.any(np.asarray(empty))
    assert math.prod(empty.shape) == 256


# --- empty dimensions: what jax.lax.ragged_dot returns -------------------------------------

# name -> (M, K, N, group sizes); `vmap_data`'s shapes where they can be (eagerly, the
# reference compiles each op once per shape).
EMPTY = {
    "k0": (48, 0, 32, VMAP_SIZES[0]),
    "n0": (48, 32, 0, VMAP_SIZES[0]),
    "k0_n0": (48, 0, 0, VMAP_SIZES[0]),
    "m0": (0, 32, 32, [0, 0, 0, 0]),
    "all_groups_empty": (48, 32, 32, [0, 0, 0, 0]),
}


# Every case under jit; eagerly (op by op, slow on the reference) the two empty contractions.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "mode"), [*((case, "jit") for case in EMPTY), ("k0", "eager"), ("k0_n0", "eager")]
)
def test_empty_dimensions_give_jax_ragged_dots_zeros(impl, case, mode):
    """K = 0 (every product an empty sum), N = 0, M = 0 and no rows in any group: the
    result and both gradients are `jax.lax.ragged_dot`'s (zeros or empty, of its shapes and
    dtypes), with a key and without, as `dot_general` gives for its empty dimensions."""
    m, k, n, sizes = EMPTY[case]
    x, w, dy = data(m, k, n, len(sizes), 14)
    sizes = jnp.array(sizes, jnp.int32)
    recipe = NVFP4Recipe(implementation=impl.implementation)

    def ours(x, w, sizes, dy, key):
        return one_sequence_vjp(x, w, sizes, dy, key, recipe)

    def theirs(x, w, sizes, dy):
        y, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
        return (y, *pullback(dy))

    if mode == "jit":
        ours = jax.jit(ours)
    want = theirs(x, w, sizes, dy)
    for key in (jax.random.key(3), None):
        for name, a, e in zip(("y", "dx", "dW"), ours(x, w, sizes, dy, key), want, strict=True):
            assert (a.shape, a.dtype) == (e.shape, e.dtype), f"{name}: {a.shape} {a.dtype}"
            np.testing.assert_array_equal(np.asarray(a, np.float32), 0.0, err_msg=name)
