"""The oracle of the NVFP4 `ragged_dot` tests (test_ragged_*.py, test_recipe_four_over_six.py):
every group is its own dense layer.

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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from helpers import DENSE, assert_same_bits

from nvfp4_jax import NVFP4Recipe, dot_general, kernels, ragged_dot

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


# The reference once (its loop jitted: eagerly, op by op, it takes a minute); the rest on the
# native kernels.
NATIVE = "ffi" if "ffi" in IMPLEMENTATIONS else "reference"


# --- vmap: a batch of token sets, each with its own group sizes (a per-sequence MoE) ---------

# (B, G) group sizes of B = 3 token sets of M = 48 rows: ragged with rows after the groups,
# 16-aligned, all in the last group.
VMAP_SIZES = [[5, 0, 30, 10], [16, 16, 0, 16], [0, 0, 0, 48]]


def one_sequence_vjp(x, w, group_sizes, dy, key, recipe):
    """(y, dx, dW) of one token set: the per-element call."""
    y, pullback = jax.vjp(lambda a, b: ragged_dot(a, b, group_sizes, recipe=recipe, key=key), x, w)
    return (y, *pullback(dy))
