"""Batch dimensions in the NVFP4 `dot_general`: every batch element is its own GEMM.

Shape letters: E experts (the batch), C tokens per expert, K features, N outputs; the
"dropping" MoE multiplies dispatched tokens (E, C, K) with expert weights (E, K, N),
dimension numbers (((2,), (1,)), ((0,), (0,))).

The oracle is a Python loop over the batch calling the unbatched `dot_general` (eagerly:
each op alone, no fusion) with the same recipe and, for an explicit key, the key
`jax.random.fold_in(key, b)` of batch element b (the flat, row-major index over the batch
dims). The batched call must give the same bits, forward and both gradients, eagerly and
under `jit`: each element has its own tensor amax for every operand of every GEMM, its own
token padding and its own stochastic rounding.
"""

from __future__ import annotations

import functools
import math
import re
import sys

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, make_mesh, mesh_context
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax import NVFP4Recipe, dot_general, nvfp4_dot_general

dot_general_module = sys.modules["nvfp4_jax._src.training.dot_general"]

MOE = (((2,), (1,)), ((0,), (0,)))


def experts_data(lhs_shape, rhs_shape, out_shape, seed, *, lhs_batch=0, rhs_batch=0):
    """Normal data; batch element 0 of lhs all zero (an expert without tokens) and element
    -1 of rhs 100x larger (so the elements' amaxes differ)."""
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal(lhs_shape).astype(np.float32)
    rhs = rng.standard_normal(rhs_shape).astype(np.float32)
    dy = rng.standard_normal(out_shape).astype(np.float32)
    np.moveaxis(lhs, lhs_batch, 0)[0] = 0.0
    np.moveaxis(rhs, rhs_batch, 0)[-1] *= 100.0
    return jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(dy)


# name -> (lhs shape, rhs shape, dimension numbers)
CASES = {
    # C = 24 tokens: the wgrad pads each expert's tokens to 32.
    "experts_leading": ((3, 24, 64), (3, 64, 32), MOE),
    "batch_not_leading": ((24, 3, 64), (64, 3, 32), (((2,), (0,)), ((1,), (1,)))),
    # Two batch dims, in the other order on the rhs.
    "two_batch_dims": ((2, 3, 24, 64), (64, 3, 2, 32), (((3,), (0,)), ((0, 1), (2, 1)))),
}
# Every case has the same per-element GEMM, (24, 64) x (64, 32): the eager loop's op-by-op
# compilations are shared.


def case_data(name, seed=0):
    lhs_shape, rhs_shape, dims = CASES[name]
    out_shape = jax.eval_shape(
        functools.partial(jax.lax.dot_general, dimension_numbers=dims),
        jax.ShapeDtypeStruct(lhs_shape, jnp.float32),
        jax.ShapeDtypeStruct(rhs_shape, jnp.float32),
    ).shape
    (_, (lb, rb)) = dims
    return (
        *experts_data(lhs_shape, rhs_shape, out_shape, seed, lhs_batch=lb[0], rhs_batch=rb[0]),
        dims,
    )


def vjp(lhs, rhs, dy, dims, recipe, key):
    y, pullback = jax.vjp(lambda a, b: dot_general(a, b, dims, recipe=recipe, key=key), lhs, rhs)
    return (y, *pullback(dy))


jit_vjp = jax.jit(vjp, static_argnames=("dims", "recipe"))


def unbatched_dims(dims, lhs_ndim, rhs_ndim):
    """The dimension numbers of one batch element (batch dims removed, the rest renumbered)."""
    (lc, rc), (lb, rb) = dims

    def renumber(contract, batch, ndim):
        rest = [d for d in range(ndim) if d not in batch]
        return tuple(rest.index(d) for d in contract)

    return ((renumber(lc, lb, lhs_ndim), renumber(rc, rb, rhs_ndim)), ((), ()))


def loop_vjp(lhs, rhs, dy, dims, recipe, key):
    """(y, d_lhs, d_rhs) from the unbatched `dot_general`, one eager call per batch element."""
    (_, _), (lb, rb) = dims
    batch_shape = [lhs.shape[d] for d in lb]
    b = math.prod(batch_shape)

    def split(a, batch):  # batch dims first, flattened: (B, rest...)
        moved = jnp.moveaxis(a, batch, range(len(batch)))
        return moved.reshape(b, *moved.shape[len(batch) :]), moved.shape

    def join(parts, moved_shape, batch):
        moved = jnp.stack(parts).reshape(moved_shape)
        return jnp.moveaxis(moved, range(len(batch)), batch)

    xs, x_moved = split(lhs, lb)
    ws, w_moved = split(rhs, rb)
    dys = dy.reshape(b, *dy.shape[len(lb) :])
    one = unbatched_dims(dims, lhs.ndim, rhs.ndim)
    outs = [
        vjp(xs[i], ws[i], dys[i], one, recipe, None if key is None else jax.random.fold_in(key, i))
        for i in range(b)
    ]
    ys, dxs, dws = zip(*outs, strict=True)
    return (
        jnp.stack(ys).reshape(dy.shape),
        join(dxs, x_moved, lb),
        join(dws, w_moved, rb),
    )


def assert_all_same_bits(actual, expected, what):
    for name, a, e in zip(("y", "d_lhs", "d_rhs"), actual, expected, strict=True):
        assert a.shape == e.shape, f"{what} {name}: {a.shape} != {e.shape}"
        assert_same_bits(a, e)


# --- batched == loop of unbatched calls, bit for bit ----------------------------------------

# (case, key kind, the modes the batched call runs in); the oracle is computed once.
PARAMS = [
    ("experts_leading", "key", ("eager", "jit")),
    ("experts_leading", "none", ("eager", "jit")),
    ("batch_not_leading", "key", ("jit",)),
    ("batch_not_leading", "none", ("eager",)),
    ("two_batch_dims", "key", ("jit",)),
    ("two_batch_dims", "none", ("jit",)),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, key_kind, modes", PARAMS, ids=[f"{c}-{k}-{'+'.join(m)}" for c, k, m in PARAMS]
)
def test_batched_equals_loop_of_unbatched_calls(impl, case, key_kind, modes):
    lhs, rhs, dy, dims = case_data(case)
    recipe = NVFP4Recipe(implementation=impl.implementation)  # SR, RHT, 16x16 weights: on
    key = jax.random.key(7) if key_kind == "key" else None
    lhs, rhs, dy = (jax.device_put(a, impl.device) for a in (lhs, rhs, dy))

    expected = loop_vjp(lhs, rhs, dy, dims, recipe, key)

    assert expected[0].shape == jax.lax.dot_general(lhs, rhs, dims).shape
    if impl.implementation == "reference" and "jit" in modes:
        modes = ("jit",)  # eager dispatch: covered on the native kernels
    for mode in modes:
        run = jit_vjp if mode == "jit" else vjp
        assert_all_same_bits(run(lhs, rhs, dy, dims, recipe, key), expected, f"{case} {mode}")


def residual_arrays(pullback):
    leaves = jax.tree_util.tree_leaves(pullback)
    return [
        leaf
        for leaf in leaves
        if hasattr(leaf, "dtype") and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    ]


def test_each_element_saves_its_own_quantized_residuals():
    # The forward saves W and x (along the tokens, padded 24 -> 32 per expert) packed, with
    # one amax per expert: the token-less expert's is 0, the 100x expert's 100x larger.
    lhs, rhs, _, dims = case_data("experts_leading", seed=1)
    recipe = NVFP4Recipe(implementation="reference")
    _, pullback = jax.vjp(lambda a, b: dot_general(a, b, dims, recipe=recipe), lhs, rhs)
    arrays = residual_arrays(pullback)
    shapes = {(jnp.dtype(a.dtype).name, a.shape) for a in arrays}
    assert ("uint8", (3, 32, 32)) in shapes and ("uint8", (3, 64, 16)) in shapes, shapes
    amaxes = [np.asarray(a) for a in arrays if a.shape == (3,) and a.dtype == jnp.float32]
    w_amax = np.abs(np.asarray(rhs)).max(axis=(1, 2))
    assert any(np.array_equal(a, w_amax) for a in amaxes), (amaxes, w_amax)
    x_amax = [a for a in amaxes if not np.array_equal(a, w_amax)]
    assert len(x_amax) == 1 and x_amax[0][0] == 0 and np.all(x_amax[0][1:] > 0), x_amax


# --- stochastic rounding keys ----------------------------------------------------------------


def test_experts_do_not_share_sr_noise_with_an_explicit_key():
    # Three identical experts: with one key, fold_in(key, b) gives each its own rounding;
    # with key=None each key comes from its own dy, here identical, so the rounding too.
    rng = np.random.default_rng(2)
    x, w, d = (rng.standard_normal(s).astype(np.float32) for s in ((32, 64), (64, 32), (32, 32)))
    lhs, rhs, dy = (jnp.asarray(np.stack([a] * 3)) for a in (x, w, d))
    recipe = NVFP4Recipe(implementation="reference")

    _, dx_key, dw_key = jit_vjp(lhs, rhs, dy, MOE, recipe, jax.random.key(3))
    _, dx_none, dw_none = jit_vjp(lhs, rhs, dy, MOE, recipe, None)

    for g in (dx_key, dw_key):
        assert not np.array_equal(np.asarray(g[0]), np.asarray(g[1]))
        assert not np.array_equal(np.asarray(g[1]), np.asarray(g[2]))
    for g in (dx_none, dw_none):
        assert_same_bits(g[0], g[1])
        assert_same_bits(g[1], g[2])


# --- non-finite input --------------------------------------------------------------------------


def test_nan_in_one_expert_poisons_only_that_expert(impl):
    lhs, rhs, dy, dims = case_data("experts_leading", seed=3)
    recipe = NVFP4Recipe(implementation=impl.implementation)
    key = jax.random.key(4)
    clean = jit_vjp(lhs, rhs, dy, dims, recipe, key)
    poisoned = jit_vjp(lhs.at[1, 5, 7].set(jnp.nan), rhs, dy, dims, recipe, key)
    y, d_lhs, d_rhs = (np.asarray(a) for a in poisoned)
    # Expert 1's x is NaN, so its fprop and its wgrad (x^T dy) are NaN everywhere; its dgrad
    # (dy W^T) does not read x.
    assert np.all(np.isnan(y[1])) and np.all(np.isnan(d_rhs[1]))
    assert_same_bits(d_lhs[1], clean[1][1])
    for e in (0, 2):
        for name, got, want in zip(("y", "d_lhs", "d_rhs"), poisoned, clean, strict=True):
            assert np.all(np.isfinite(np.asarray(got[e]))), f"{name}[{e}]"
            assert_same_bits(got[e], want[e])


# --- Flax -----------------------------------------------------------------------------------


def test_nnx_einsum_passes_batch_dims_to_nvfp4_dot_general():
    # nnx.Einsum takes an einsum_op, not a dot_general: jnp.einsum's `_dot_general` hook
    # hands the expert axis to nvfp4_dot_general() as a batch dimension.
    e, k, n = 3, 64, 32
    recipe, key = NVFP4Recipe(implementation="reference"), jax.random.key(5)
    einsum_op = functools.partial(jnp.einsum, _dot_general=nvfp4_dot_general(recipe, key))
    layer = nnx.Einsum("eck,ekn->ecn", (e, k, n), einsum_op=einsum_op, rngs=nnx.Rngs(0))
    x, _, dy, _ = case_data("experts_leading", seed=4)
    seen = []

    def spy(lhs, rhs, dims, *args, **kwargs):
        seen.append(dims)
        return jax.lax.dot_general(lhs, rhs, dims, *args, **kwargs)

    jnp.einsum("eck,ekn->ecn", x, layer.kernel[...], _dot_general=spy)
    assert seen == [MOE], seen

    @nnx.jit
    def run(layer, x, dy):
        def loss(layer, x):
            return jnp.sum(layer(x) * dy)

        return layer(x), nnx.grad(loss, argnums=(0, 1))(layer, x)

    y, (g_layer, g_x) = run(layer, x, dy)
    ref_y, ref_dx, ref_dw = jit_vjp(x, layer.kernel[...], dy, MOE, recipe, key)
    assert_same_bits(y, ref_y)
    assert_same_bits(g_x, ref_dx)
    assert_same_bits(g_layer.kernel[...], ref_dw)


# --- expert parallelism ----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("recipe",))
def vjp_and_residuals(lhs, rhs, dy, recipe, key):
    y, pullback = jax.vjp(lambda a, b: dot_general(a, b, MOE, recipe=recipe, key=key), lhs, rhs)
    return (y, *pullback(dy)), residual_arrays(pullback)


@pytest.mark.skipif(jax.device_count("cpu") < 8, reason="needs 8 CPU devices")
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_expert_axis_sharded_over_8_devices_equals_one_device(impl, mode):
    # One expert per device. Everything the recipe decides (every operand's amax, scales,
    # codes, stochastic rounding) is the same bits; the GEMMs' f32 sums may run in another
    # order (XLA picks another CPU kernel for a GEMM of batch 1 than of batch 8), so the
    # results are compared within the f32 summation budget, K or M terms.
    lhs, rhs, dy = experts_data((8, 24, 32), (8, 32, 16), (8, 24, 16), seed=6)
    recipe = NVFP4Recipe(implementation=impl.implementation)
    key = jax.random.key(8)
    cpu = jax.devices("cpu")
    one, one_res = vjp_and_residuals(
        *(jax.device_put(a, cpu[0]) for a in (lhs, rhs, dy)), recipe, key
    )

    mesh = make_mesh((8,), ("expert",), mode)
    experts = NamedSharding(mesh, P("expert", None, None))
    with mesh_context(mesh, mode):
        sharded, sharded_res = vjp_and_residuals(
            *(jax.device_put(a, experts) for a in (lhs, rhs, dy)), recipe, key
        )

    assert len(one_res) == len(sharded_res) >= 6
    for got, want in zip(sharded_res, one_res, strict=True):
        assert_same_bits(got, want)
    for got, want, terms in zip(sharded, one, (32, 16, 32), strict=True):
        want = np.asarray(want)
        atol = (terms + 2) * 2.0**-24 * np.abs(want).max(axis=(1, 2), keepdims=True)
        assert np.all(np.abs(np.asarray(got) - want) <= atol)
    if impl.name == "reference":  # the native kernels run their vmapped calls one by one
        assert sharded[0].sharding.is_equivalent_to(experts, 3), sharded[0].sharding


# --- the scaled_matmul backend -------------------------------------------------------------


def test_scaled_matmul_backend_traces_one_batched_gemm_per_gemm():
    # jax.nn.scaled_matmul runs only on Blackwell; its batching rule turns the vmapped
    # (1, M, K) operands into one (B, M, K) cuDNN GEMM each for fprop, dgrad and wgrad.
    recipe = NVFP4Recipe(gemm_backend="scaled_matmul")
    x, w, dy = jnp.ones((3, 24, 64)), jnp.ones((3, 64, 32)), jnp.ones((3, 24, 32))

    def f(x, w, dy):
        matmul = functools.partial(
            dot_general_module.batched_matmul,
            key=jax.random.key(0),
            recipe=recipe,
            out_dtype=jnp.float32,
        )
        y, pullback = jax.vjp(matmul, x, w)
        return (y, *pullback(dy))

    text = str(jax.make_jaxpr(f)(x, w, dy))
    shapes = [
        tuple(int(d) for d in dims.split(","))
        for dims in re.findall(r":f32\[([\d,]+)\] = scaled_matmul_wrapper", text)
    ]
    assert sorted(shapes) == sorted([(3, 24, 32), (3, 24, 64), (3, 64, 32)]), shapes
    assert [a.shape for a in jax.eval_shape(f, x, w, dy)] == [(3, 24, 32), x.shape, w.shape]


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, dims, error, message",
    [
        ((3, 32, 64), (4, 64, 32), MOE, TypeError, r"batch dimensions .* equal sizes"),
        ((3, 32, 64), (3, 64, 32), (((2,), (1,)), ((0,), ())), TypeError, "as many"),
        ((3, 32, 64), (3, 64, 32), (((2,), (1,)), ((2,), (0,))), TypeError, "disjoint"),
        ((3, 32, 64), (3, 64, 32), (((2,), (1,)), ((0, 0), (0, 0))), TypeError, "distinct"),
        ((3, 32, 64), (3, 64, 32), (((2,), (1,)), ((3,), (0,))), TypeError, "batch .* below"),
        ((3, 32, 64), (3, 64, 32), (((2,), (1,)), ((0.0,), (0,))), TypeError, "ints"),
        ((3, 32, 64), (3, 64, 32), (((2,), (1,)), ((True,), (0,))), TypeError, "ints"),
        ((16, 32, 40), (16, 40, 32), MOE, ValueError, r"\(K\) size .* 40 .*\(16, 32, 40\)"),
        ((16, 32, 64), (16, 64, 24), MOE, ValueError, r"\(N\) size .* 24 .*\(16, 64, 24\)"),
    ],
    ids=[
        "batch_sizes_differ",
        "batch_counts_differ",
        "batch_is_contracting",
        "batch_repeated",
        "batch_out_of_range",
        "batch_float",
        "batch_bool",
        "k_not_16_per_element",
        "n_not_16_per_element",
    ],
)
def test_bad_batch_calls_raise_clear_errors(lhs_shape, rhs_shape, dims, error, message):
    with pytest.raises(error, match=message):
        dot_general(jnp.ones(lhs_shape), jnp.ones(rhs_shape), dims)
