"""The NVFP4 `ragged_dot` (grouped GEMM of a dropless MoE): every group is its own dense layer.

Shape letters: x (M, K) tokens sorted by group, W (G, K, N) experts, dy (M, N), group
sizes (G,).

The oracle is a Python loop over the groups calling the dense `nvfp4_jax.dot_general`
on group g's rows alone, x[start_g:end_g] @ W[g], with the key `jax.random.fold_in(key, g)`
(or key=None, which derives each group's key from its own rows of dy). `ragged_dot`, under
`jit` with traced group sizes, must give the same bits as the eager loop: the forward rows,
the dx rows and dW[g] of every group (docs/NUMERICS.md section 12). Rows after the last
group are zero in y and dx. Where XLA's dot sums (the reference GEMM), the loop is jitted and
the GEMMs compared up to f32 summation order, their operands bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DENSE, assert_same_bits, skip_eager_reference
from jax.extend.random import threefry_2x32

import nvfp4_jax
from nvfp4_jax import NVFP4Recipe, QuantSpec, dot_general, kernels, ragged_dot
from nvfp4_jax._src.core import backends, sr_keys
from nvfp4_jax._src.core.formats import decode_scale
from nvfp4_jax._src.training.ragged.blocks import block_values
from nvfp4_jax._src.training.ragged.groups import Groups, find_groups, padded_rows
from nvfp4_jax._src.training.ragged.operands import quantize_rows, quantize_tokens
from nvfp4_jax._src.training.ragged.sr import padded_random, row_random

IMPLEMENTATIONS = ["reference"] + (["ffi"] if kernels.is_available("cpu") else [])
RECIPES = {
    "default": NVFP4Recipe(),  # 16x16 weights, RHT, stochastic rounding
    "all_off": NVFP4Recipe(weight_2d=False, wgrad_rht=False, stochastic_rounding=False),
    "w1d": NVFP4Recipe(weight_2d=False),
    "no_rht": NVFP4Recipe(wgrad_rht=False),
}


def recipe_of(name: str, implementation: str) -> NVFP4Recipe:
    r = RECIPES[name]
    return NVFP4Recipe(
        weight_2d=r.weight_2d,
        wgrad_rht=r.wgrad_rht,
        stochastic_rounding=r.stochastic_rounding,
        implementation=implementation,
    )


def data(m, k, n, g, seed, dtype=jnp.float32):
    """Normal data; expert weights of different magnitudes (so their amaxes differ), and
    token rows of group-dependent magnitude (so the groups' amaxes differ)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * rng.lognormal(0.0, 1.0, (m, 1))
    w = rng.standard_normal((g, k, n)) * (10.0 ** np.arange(g))[:, None, None]
    dy = rng.standard_normal((m, n)) * rng.lognormal(0.0, 1.0, (m, 1))
    return tuple(jnp.asarray(a, jnp.float32).astype(dtype) for a in (x, w, dy))


@functools.partial(jax.jit, static_argnames=("recipe",))
def ragged_vjp(x, w, group_sizes, dy, key, recipe):
    """(y, dx, dW) of `ragged_dot`, group sizes traced."""
    y, pullback = jax.vjp(lambda a, b: ragged_dot(a, b, group_sizes, recipe=recipe, key=key), x, w)
    return (y, *pullback(dy))


def dense_vjp(x, w, dy, key, recipe):
    """(y, dx, dW) of the dense `dot_general`."""
    y, pullback = jax.vjp(lambda a, b: dot_general(a, b, DENSE, recipe=recipe, key=key), x, w)
    return (y, *pullback(dy))


def group_loop(x, w, sizes, dy, key, recipe, *, jit=False):
    """The oracle: per group, (start, end, y_g, dx_g, dW_g) of the dense `dot_general`, each
    op alone (eagerly), or each group's GEMMs as one jitted program (`jit`), where XLA may sum
    a GEMM fused with its operands' decode in another order than the grouped one."""
    run = jax.jit(dense_vjp, static_argnames="recipe") if jit else dense_vjp
    out, start = [], 0
    for g, size in enumerate(sizes):
        end = min(start + size, x.shape[0])
        key_g = None if key is None else jax.random.fold_in(key, g)
        out.append((start, end, *run(x[start:end], w[g], dy[start:end], key_g, recipe)))
        start = end
    return out


def assert_same_up_to_summation_order(actual, expected, k, what):
    """Equal but for the f32 summation order of a GEMM contracting k terms (the operands are
    bit for bit equal: `test_operands_are_bit_for_bit_the_dense_ones`)."""
    expected = np.asarray(expected, np.float32)
    atol = (k + 2) * 2.0**-24 * (np.abs(expected).max() if expected.size else 0.0)
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), expected, rtol=0, atol=atol, err_msg=what
    )


def assert_equals_group_loop(x, w, sizes, dy, key, recipe, *, exact=True):
    """`ragged_dot`'s (y, dx, dW) against the loop: bit for bit (the loop eager), or
    (exact=False) up to the GEMMs' f32 summation order, which XLA may choose differently for
    the grouped GEMM (the loop jitted: the eager op-by-op compilations of the reference cost
    a minute; its operands are bit for bit in `test_operands_are_bit_for_bit_the_dense_ones`)."""
    y, dx, dw = ragged_vjp(x, w, jnp.asarray(sizes, jnp.int32), dy, key, recipe)
    assert y.shape == (x.shape[0], w.shape[2]) and dx.shape == x.shape and dw.shape == w.shape
    end = 0
    loop = group_loop(x, w, sizes, dy, key, recipe, jit=not exact)
    for g, (start, end, y_g, dx_g, dw_g) in enumerate(loop):
        if exact:
            assert_same_bits(y[start:end], y_g, f"y of group {g}")
            assert_same_bits(dx[start:end], dx_g, f"dx of group {g}")
            assert_same_bits(dw[g], dw_g, f"dW of group {g}")
        else:
            k, n, tokens = x.shape[1], w.shape[2], -(-(end - start) // 16) * 16
            assert_same_up_to_summation_order(y[start:end], y_g, k, f"y of group {g}")
            assert_same_up_to_summation_order(dx[start:end], dx_g, n, f"dx of group {g}")
            assert_same_up_to_summation_order(dw[g], dw_g, tokens, f"dW of group {g}")
        if start == end:
            assert not np.any(np.asarray(dw[g], np.float32)), f"dW of empty group {g}"
    # Rows after the last group: zero output, zero gradient.
    assert not np.any(np.asarray(y[end:], np.float32)), "y after the groups"
    assert not np.any(np.asarray(dx[end:], np.float32)), "dx after the groups"
    return y, dx, dw


# --- bit for bit the per-group dot_general -------------------------------------------------

# name -> (M, group sizes): sizes not multiples of 16, an empty group, all in one, a sum
# below M (rows after the groups), every group a multiple of 16.
SIZES = {
    "ragged_5_0_37_22_of_80": (80, [5, 0, 37, 22]),
    "all_in_one_64_0_0_0": (64, [64, 0, 0, 0]),
    "aligned_16_32_0_8_of_56": (56, [16, 32, 0, 8]),
}
# The reference once (its loop jitted: eagerly, op by op, it takes a minute); the rest on the
# native kernels.
NATIVE = "ffi" if "ffi" in IMPLEMENTATIONS else "reference"
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


def test_the_written_out_threefry_is_jax_threefry_bit_for_bit():
    rng = np.random.default_rng(7)
    words = rng.integers(0, 2**32, (4, 4096), dtype=np.uint32)
    k0, k1, x0, x1 = (jnp.asarray(w) for w in words)
    ours = jax.jit(sr_keys.threefry2x32)(k0, k1, x0, x1)
    theirs = jax.vmap(lambda a, b, c, d: threefry_2x32((a, b), jnp.stack([c, d])))(k0, k1, x0, x1)
    np.testing.assert_array_equal(np.stack([np.asarray(o) for o in ours], -1), theirs)


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


# --- vmap: a batch of token sets, each with its own group sizes (a per-sequence MoE) ---------

# (B, G) group sizes of B = 3 token sets of M = 48 rows: ragged with rows after the groups,
# 16-aligned, all in the last group.
VMAP_SIZES = [[5, 0, 30, 10], [16, 16, 0, 16], [0, 0, 0, 48]]


def vmap_data():
    """x (B, M, K), the shared experts W (G, K, N), dy (B, M, N), group sizes (B, G); f32,
    one set of shapes for the tests below (eagerly, the reference compiles every op once per
    shape: a minute and a half)."""
    xs, _, dys = zip(*(data(48, 32, 32, 4, 20 + b) for b in range(3)), strict=True)
    w = data(48, 32, 32, 4, 30)[1]
    return jnp.stack(xs), w, jnp.stack(dys), jnp.array(VMAP_SIZES, jnp.int32)


def one_sequence_vjp(x, w, group_sizes, dy, key, recipe):
    """(y, dx, dW) of one token set: the per-element call."""
    y, pullback = jax.vjp(lambda a, b: ragged_dot(a, b, group_sizes, recipe=recipe, key=key), x, w)
    return (y, *pullback(dy))


# Under jit: eagerly the reference runs op by op (XLA compiles each op on its own, a minute
# per case); tests/core/test_ops_vmap.py's ragged_dot case runs vmap of ragged_dot eagerly too.
@pytest.mark.slow
@pytest.mark.parametrize(("key_kind", "mode"), [("key", "jit"), ("none", "jit")])
def test_vmap_over_token_sets_is_the_loop_bit_for_bit(impl, key_kind, mode):
    """vmap of the vjp (the weights shared, each token set its own sizes and key) against a
    Python loop of the per-element calls, eagerly and under jit: the same bits."""
    x, w, dy, sizes = vmap_data()
    keys = jax.random.split(jax.random.key(11), 3) if key_kind == "key" else None
    recipe = NVFP4Recipe(implementation=impl.implementation)
    one = functools.partial(one_sequence_vjp, recipe=recipe)
    batched = jax.vmap(one, in_axes=(0, None, 0, 0, None if keys is None else 0))
    if mode == "jit":
        one, batched = jax.jit(one), jax.jit(batched)
    got = batched(x, w, sizes, dy, keys)
    for b in range(3):
        want = one(x[b], w, sizes[b], dy[b], None if keys is None else keys[b])
        for name, a, e in zip(("y", "dx", "dW"), got, want, strict=True):
            assert_same_bits(a[b], e, f"{name} of token set {b}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_grad_of_vmap_and_vmap_of_grad_are_the_loop(impl, mode):
    """The per-sequence MoE's gradients both ways round: vmap of grad gives each token set's
    (dx, dW), grad of vmap each set's dx and the shared weight's dW summed over the sets."""
    skip_eager_reference(impl, mode)
    x, w, dy, sizes = vmap_data()
    keys = jax.random.split(jax.random.key(12), 3)
    recipe = NVFP4Recipe(implementation=impl.implementation)

    def loss(a, b, gs, cotangent, key):
        return jnp.sum(ragged_dot(a, b, gs, recipe=recipe, key=key) * cotangent)

    grad = jax.grad(loss, argnums=(0, 1))
    vmap_of_grad = jax.vmap(grad, in_axes=(0, None, 0, 0, 0))

    def batched_loss(a, b):
        return jnp.sum(jax.vmap(loss, in_axes=(0, None, 0, 0, 0))(a, b, sizes, dy, keys))

    grad_of_vmap = jax.grad(batched_loss, argnums=(0, 1))
    if mode == "jit":
        grad, vmap_of_grad, grad_of_vmap = map(jax.jit, (grad, vmap_of_grad, grad_of_vmap))
    loop = [grad(x[b], w, sizes[b], dy[b], keys[b]) for b in range(3)]
    dx, dw = vmap_of_grad(x, w, sizes, dy, keys)
    gx, gw = grad_of_vmap(x, w)
    for b, (dx_b, dw_b) in enumerate(loop):
        assert_same_bits(dx[b], dx_b, f"vmap of grad: dx of token set {b}")
        assert_same_bits(dw[b], dw_b, f"vmap of grad: dW of token set {b}")
        assert_same_bits(gx[b], dx_b, f"grad of vmap: dx of token set {b}")
    # The shared weight's gradient is the sum of the token sets' (JAX's transpose of the
    # broadcast), which XLA may fuse under jit with the last scaling of each (FMAs): equal
    # up to the rounding of the terms and of their f32 sum.
    per_set = np.stack([np.asarray(d) for _, d in loop])
    atol = 4 * 2.0**-24 * np.abs(per_set).sum(axis=0)
    assert np.all(np.abs(np.asarray(gw) - per_set.sum(axis=0)) <= atol), "grad of vmap: dW"


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["high_precision", "w1d_no_sr", "nested"])
def test_vmap_of_every_gemm_form_is_the_loop(impl, recipe_name):
    """Under jit: the GEMMs a recipe puts in high precision (`jax.lax.ragged_dot` and its
    autodiff, written out), the 1x16 weights' dgrad, and vmap of vmap (two batch dims, the
    weights shared by both): every token set's (y, dx, dW) is its own call's bits."""
    x, w, dy, sizes = vmap_data()
    recipe = {
        "high_precision": NVFP4Recipe(fprop=False, dgrad=False, wgrad=False),
        "w1d_no_sr": NVFP4Recipe(weight_2d=False, stochastic_rounding=False),
        "nested": NVFP4Recipe(),
    }[recipe_name]
    recipe = dataclasses.replace(recipe, implementation=impl.implementation)
    key = jax.random.key(13)
    one = functools.partial(one_sequence_vjp, key=key, recipe=recipe)
    batched = jax.vmap(one, in_axes=(0, None, 0, 0))
    if recipe_name == "nested":  # (2, 3) token sets: the same three, the second copy scaled
        x, dy, sizes = (jnp.stack([a, 2 * a]) for a in (x, dy, sizes))
        sizes = sizes.at[1].set(jnp.flip(sizes[1], axis=1) // 2)
        batched = jax.vmap(batched, in_axes=(0, None, 0, 0))
    got = jax.jit(batched)(x, w, sizes, dy)
    one = jax.jit(one)
    for index in np.ndindex(sizes.shape[:-1]):
        want = one(x[index], w, sizes[index], dy[index])
        for name, a, e in zip(("y", "dx", "dW"), got, want, strict=True):
            assert_same_bits(a[index], e, f"{name} of token set {index}")


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


# --- stochastic rounding's numbering: 64-bit counters, no size limit -------------------------

# A Mixtral-sized global batch: 2M tokens routed top-2 (M = 4M rows), K = 4096, N = 14336,
# G = 8; `N * 16 * ceil(M / 16)` is 6.0e10, past 2**35 (the counters past 2**32).
MIXTRAL = (2**22, 4096, 14336, 8)


LARGE_RECIPES = {
    "default": NVFP4Recipe(),
    "no_sr": NVFP4Recipe(stochastic_rounding=False),
    "high_precision": NVFP4Recipe(fprop=False, dgrad=False, wgrad=False),
}


@pytest.mark.parametrize("recipe_name", list(LARGE_RECIPES))
def test_mixtral_sized_batches_trace(impl, recipe_name):
    """The forward and both gradients trace at that size (abstract shapes, nothing allocated),
    with stochastic rounding and without."""
    m, k, n, g = MIXTRAL
    recipe = dataclasses.replace(LARGE_RECIPES[recipe_name], implementation=impl.implementation)
    shapes = [((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16), ((g,), jnp.int32)]
    x, w, sizes, dy = (jax.ShapeDtypeStruct(*s) for s in [*shapes, ((m, n), jnp.bfloat16)])
    for key in (jax.random.key(0), None):
        y, dx, dw = jax.eval_shape(
            functools.partial(one_sequence_vjp, key=key, recipe=recipe), x, w, sizes, dy
        )
        assert (y.shape, dx.shape, dw.shape) == ((m, n), (m, k), (g, k, n)), recipe_name


def fake_groups(row_local, pad_local, padded_size):
    """A `Groups` of one group with the given local indices (rows, and the padded layout's
    positions) and padded size: the SR numbering's inputs, without a tensor that large."""
    zeros = jnp.zeros_like
    row_local, pad_local = jnp.asarray(row_local, jnp.int32), jnp.asarray(pad_local, jnp.int32)
    return Groups(
        sizes=None,
        row_group=zeros(row_local),
        row_local=row_local,
        padded_sizes=jnp.array([padded_size], jnp.int32),
        pad_group=zeros(pad_local),
        pad_local=pad_local,
        pad_row=None,
    )


@pytest.mark.slow
def test_sr_numbering_past_2_to_the_32_counters_is_section_7():
    """Element n of a group's own tensor draws counter n // 8 as 64 bits (docs/NUMERICS.md
    section 7: the high word is its own, no wrap), past 2**35 elements as below: the bytes
    the dense reference gives those elements (`random_bytes` from the counter offset of the
    row, or of the padded layout's chunk)."""
    from nvfp4_jax._src.core.reference.stochastic import random_bytes  # noqa: PLC0415
    from nvfp4_jax._src.core.sr_seed import SRSeed  # noqa: PLC0415

    words = jnp.array([[0x12345678, 0x9ABCDEF0]], jnp.uint32)

    def section_7(n0, count):  # the bytes of elements n0 .. n0 + count - 1 (n0 % 16 == 0)
        j = n0 // 8
        seed = SRSeed(words[0], jnp.array([j & 0xFFFFFFFF, j >> 32], jnp.uint32))
        return np.asarray(random_bytes(seed, count))

    # dgrad's dy (rows of N): element (t, c) is n = t * N + c; rows past 2**32 counters.
    n = 14336
    rows = [0, 1, 2**21 + 3, 2**22 - 1, 2**31 - 1]
    got = np.asarray(row_random(words, fake_groups(rows, [0], 16), n))
    for i, t in enumerate(rows):
        np.testing.assert_array_equal(got[i], section_7(t * n, n), err_msg=f"row {t}")
    # wgrad's dy, stored (N, Mp): element (c, p) is n = c * L + p for the group's L tokens.
    length, positions = 2**28, np.arange(2**28 - 64, 2**28)  # counters past 2**32 from c = 128
    groups = fake_groups([0], positions, length)
    got = np.asarray(padded_random(words, groups, 256))
    for c in (0, 1, 127, 128, 255):
        want = section_7(c * length + int(positions[0]), 64)
        np.testing.assert_array_equal(got[c], want, err_msg=f"row {c} of the padded layout")
