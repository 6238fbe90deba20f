"""The NVFP4 `dot_general` (custom_vjp): forward, dgrad and wgrad against hand-built GEMMs.

Shape letters: x (M, K) activations, W (K, N) weight, dy (M, N) output gradient.

The oracle for every GEMM (dot_general_oracle.py) is built from the public quantizer (always
`implementation="reference"`), independently of `dot_general`'s internals: each operand is
quantized with `quantize`, turned into its per-block values with `block_values` (exact, no
tensor factor), multiplied in float64 by NumPy and scaled by `alpha = D_a * D_b`
(`global_decode_scale` of each operand's amax). `dot_general` sums in f32 in an order of its
own, so it may differ from the float64 oracle by the f32 summation-order budget

    |y - y_ref| <= (K + 2) * 2**-24 * alpha * (|a| @ |b|)     (+ 2**-8 |y_ref| for a bf16 result)

(K roundings of a recursive f32 sum, one for the product by alpha, one for alpha itself).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dot_general_oracle import (
    ALL_OFF,
    IMPLEMENTATIONS,
    RECIPES,
    alpha_of,
    assert_gemm_close,
    assert_same_up_to_summation_order,
    backward_oracle,
    f64,
    jit_dot_general,
    operand,
    vjp,
    with_impl,
)
from helpers import DENSE, assert_same_bits, normal

from nvfp4_jax import NVFP4Recipe, dequantize, dot_general, nvfp4_dot_general, quantize
from nvfp4_jax._src.flax.einsum import NVFP4Einsum

# --- forward ---------------------------------------------------------------------------------

# name -> (lhs shape, rhs shape, dimension numbers)
FORWARD_CASES = {
    "dense_2d": ((32, 64), (64, 48), DENSE),
    "dense_3d": ((2, 24, 64), (64, 32), (((2,), (0,)), ((), ()))),
    "dense_general_2_axes": ((2, 16, 4, 8), (4, 8, 48), (((2, 3), (0, 1)), ((), ()))),
    "dense_general_reversed_pairs": ((16, 4, 8), (8, 4, 32), (((2, 1), (0, 1)), ((), ()))),
    "rhs_contract_last": ((32, 64), (48, 64), (((1,), (1,)), ((), ()))),
    "rhs_2_free": ((32, 64), (64, 4, 16), DENSE),
    "lhs_contract_first": ((64, 32), (64, 48), (((0,), (0,)), ((), ()))),
}


def flatten_operands(lhs, rhs, dims):
    """(x (M, K), w (K, N), unflatten_x, unflatten_w): K flattened in lhs's axis order,
    however the dims list the pairs (the contract: einsum and NVFP4Einsum block alike)."""
    (lc, rc), _ = dims
    lc, rc = zip(*sorted(zip(lc, rc, strict=True)), strict=True)
    lf = [d for d in range(lhs.ndim) if d not in lc]
    rf = [d for d in range(rhs.ndim) if d not in rc]
    lperm, rperm = lf + list(lc), list(rc) + rf
    xt, wt = np.transpose(lhs, lperm), np.transpose(rhs, rperm)
    k = math.prod(lhs.shape[d] for d in lc)

    def unflatten(a, transposed_shape, perm):
        return np.transpose(a.reshape(transposed_shape), np.argsort(perm))

    return (
        xt.reshape(-1, k),
        wt.reshape(k, -1),
        lambda a: unflatten(a, xt.shape, lperm),
        lambda a: unflatten(a, wt.shape, rperm),
    )


FORWARD_PARAMS = (
    [(case, "f32", "reference") for case in FORWARD_CASES]
    + [("dense_2d", "bf16", "reference"), ("dense_general_2_axes", "bf16", "reference")]
    + [(c, d, "ffi") for c, d in (("dense_2d", "f32"), ("dense_2d", "bf16"), ("dense_3d", "f32"))]
)


def param_ids(params):
    return ["-".join(p) for p in params]


@pytest.mark.parametrize(
    "case, dtype, implementation",
    [p for p in FORWARD_PARAMS if p[2] in IMPLEMENTATIONS],
    ids=param_ids([p for p in FORWARD_PARAMS if p[2] in IMPLEMENTATIONS]),
)
def test_forward_equals_scaled_gemm_of_block_values(case, dtype, implementation):
    lhs_shape, rhs_shape, dims = FORWARD_CASES[case]
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    lhs, rhs = normal(lhs_shape, 1, dt), normal(rhs_shape, 2, dt)
    recipe = NVFP4Recipe(implementation=implementation)

    y = jit_dot_general(lhs, rhs, dims, recipe=recipe)

    expected = jax.lax.dot_general(lhs, rhs, dims)
    assert y.shape == expected.shape and y.dtype == expected.dtype
    x2d, w2d, unflatten_x, unflatten_w = flatten_operands(np.asarray(lhs), np.asarray(rhs), dims)
    x_vals, d_x = operand(x2d, axis=-1)
    w_vals, d_w = operand(w2d, axis=0, block_2d=True)
    # Contract in the caller's layout: checks the output order as well as the values.
    assert_gemm_close(
        y,
        unflatten_x(x_vals),
        unflatten_w(w_vals),
        alpha_of(d_x, d_w),
        f"{case} {dtype} {implementation}",
        contract=dims[0],
    )


@pytest.mark.parametrize(
    "lhs_dtype, rhs_dtype, preferred",
    [
        ("bfloat16", "bfloat16", None),
        ("bfloat16", "bfloat16", "float32"),
        ("float32", "float32", "bfloat16"),
        ("bfloat16", "float32", None),
        ("float16", "float16", None),
    ],
    ids=lambda v: str(v),
)
def test_preferred_element_type_behaves_like_lax(lhs_dtype, rhs_dtype, preferred):
    lhs, rhs = normal((32, 64), 3, lhs_dtype), normal((64, 32), 4, rhs_dtype)
    y = jit_dot_general(lhs, rhs, DENSE, preferred_element_type=preferred)
    assert y.dtype == jax.lax.dot_general(lhs, rhs, DENSE, preferred_element_type=preferred).dtype
    # The GEMM accumulates in f32 whatever the output dtype: a narrower result is its cast.
    y_f32 = jit_dot_general(lhs, rhs, DENSE, preferred_element_type=jnp.float32)
    assert_same_bits(y, y_f32.astype(y.dtype))


# --- backward ---------------------------------------------------------------------------------

BACKWARD_SHAPES = {"m32_k64_n48": (32, 64, 48), "m40_k32_n32_padded": (40, 32, 32)}


BACKWARD_PARAMS = (
    [("m32_k64_n48", "f32", recipe, "reference") for recipe in RECIPES]
    + [("m32_k64_n48", "bf16", "default", "reference")]
    + [("m40_k32_n32_padded", "f32", "default", "reference")]
    + [("m32_k64_n48", "f32", recipe, "ffi") for recipe in ("default", "all_off")]
    + [("m40_k32_n32_padded", "bf16", "default", "ffi")]
)


@pytest.mark.parametrize(
    "shape, dtype, recipe_name, implementation",
    [p for p in BACKWARD_PARAMS if p[3] in IMPLEMENTATIONS],
    ids=param_ids([p for p in BACKWARD_PARAMS if p[3] in IMPLEMENTATIONS]),
)
def test_backward_equals_hand_built_gemms(shape, dtype, recipe_name, implementation):
    m, k, n = BACKWARD_SHAPES[shape]
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    x, w, dy = normal((m, k), 5, dt), normal((k, n), 6, dt), normal((m, n), 7, dt)
    recipe, key = with_impl(RECIPES[recipe_name], implementation), jax.random.key(42)

    _, dx, dw = vjp(x, w, dy, recipe, key)

    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert dx.shape == x.shape and dw.shape == w.shape
    (dy_v, wt_v, alpha_dx), (xt_v, dym_v, alpha_dw) = backward_oracle(x, w, dy, recipe, key)
    assert_gemm_close(dx, dy_v, wt_v, alpha_dx, "dgrad")
    assert_gemm_close(dw, xt_v, dym_v, alpha_dw, "wgrad")


def test_backward_of_3d_input_is_the_flattened_one():
    x, w, dy = normal((2, 16, 32), 8), normal((32, 48), 9), normal((2, 16, 48), 10)
    key = jax.random.key(1)
    _, dx, dw = vjp(x, w, dy, NVFP4Recipe(), key, dims=(((2,), (0,)), ((), ())))
    _, dx2, dw2 = vjp(x.reshape(32, 32), w, dy.reshape(32, 48), NVFP4Recipe(), key)
    assert_same_bits(dx, dx2.reshape(dx.shape))
    assert_same_bits(dw, dw2)


def test_contraction_order_does_not_change_the_blocks():
    """K is blocked in lhs's dimension order however the pairs are listed: `jnp.einsum`
    (which lists "btnh,nhd->btd" as ((3, 2), (1, 0))), the drop-in, `NVFP4Einsum` and the
    sorted dimension numbers give the same bits, forward and backward."""
    x, w = normal((2, 16, 4, 8), 11), normal((4, 8, 32), 12)  # (b, t, n, h), (n, h, d)
    key = jax.random.key(3)
    recipe = NVFP4Recipe()
    drop_in = nvfp4_dot_general(recipe, key)
    spec = "btnh,nhd->btd"
    fns = {
        "einsum": lambda x, w: jnp.einsum(spec, x, w, _dot_general=drop_in),
        "NVFP4Einsum": lambda x, w: NVFP4Einsum(recipe, key)(spec, x, w),
        "sorted": lambda x, w: dot_general(x, w, (((2, 3), (0, 1)), ((), ())), key=key),
        "reversed": lambda x, w: dot_general(x, w, (((3, 2), (1, 0)), ((), ())), key=key),
    }
    results = {}
    for name, fn in fns.items():
        y, pullback = jax.vjp(jax.jit(fn), x, w)
        results[name] = (y, *pullback(jnp.cos(y)))
    for name, got in results.items():
        for a, b in zip(got, results["sorted"], strict=True):
            assert_same_bits(a, b, name)
    flat = dot_general(x.reshape(32, 32), w.reshape(32, 32), (((1,), (0,)), ((), ())), key=key)
    assert_same_bits(results["reversed"][0], flat.reshape(2, 16, 32))


# --- lossless operands: every switch off gives the exact gradients -----------------------------

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def nvfp4_exact(shape, seed, top_exp, spread=4):
    """A 2-D tensor NVFP4 represents exactly along both axes, in 1x16 and 16x16 blocks.

    Every 16x16 tile is E2M1 grid values times one power of two 2**t (t in
    [top_exp - spread, top_exp], t = top_exp somewhere), and every row and every column of
    a tile holds a +-6 (on a permuted diagonal). So the tensor amax is A = 6 * 2**top_exp,
    S_enc = 448 * 2**-top_exp, every block amax is 6 * 2**t, its scale 448 * 2**(t - top_exp)
    is exact in E4M3 (t - top_exp >= -4 keeps it normal), and every element maps to its own
    grid value: quantization along rows, along columns or in tiles is lossless. Values have
    at most 3 significant bits (exact in bf16), and products of two such tensors sum exactly
    in f32 (a span of less than 2**24).
    """
    rng = np.random.default_rng(seed)
    rows, cols = shape
    g = rng.choice(E2M1_GRID, shape) * rng.choice([-1.0, 1.0], shape)
    diag = rng.permutation(16)
    r = np.arange(rows)
    for tile_col in range(cols // 16):
        g[r, tile_col * 16 + diag[r % 16]] = 6.0 * rng.choice([-1.0, 1.0], rows)
    exps = rng.integers(top_exp - spread, top_exp + 1, (rows // 16, cols // 16))
    exps.flat[rng.integers(exps.size)] = top_exp
    return (g * np.exp2(np.kron(exps, np.ones((16, 16))))).astype(np.float32)


LOSSLESS_RECIPES = {
    "all_off": ALL_OFF,
    "w2d_sr": NVFP4Recipe(wgrad_rht=False),  # SR of a value on the grid is deterministic
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("recipe_name", LOSSLESS_RECIPES)
def test_lossless_operands_give_exact_gradients(recipe_name, implementation):
    m, k, n = 48, 64, 32
    x, w, dy = nvfp4_exact((m, k), 11, 0), nvfp4_exact((k, n), 12, -2), nvfp4_exact((m, n), 13, 3)
    # Losslessness first, along every axis and block shape the recipes quantize.
    for name, t in (("x", x), ("w", w), ("dy", dy)):
        for kw in ({"axis": 0}, {"axis": 1}, {"axis": 0, "block_2d": True}):
            t_hat = dequantize(quantize(jnp.asarray(t), implementation="reference", **kw))
            np.testing.assert_array_equal(np.asarray(t_hat), t, err_msg=f"{name} {kw}")
    recipe = with_impl(LOSSLESS_RECIPES[recipe_name], implementation)

    y, dx, dw = vjp(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), recipe, jax.random.key(0))

    # The quantized GEMMs sum exactly; only alpha = D_a * D_b and the product by it round
    # (D = 6 * 2**t * f32(1/2688) is not a power of two): 2**-21 relative, elementwise.
    x, w, dy = (t.astype(np.float64) for t in (x, w, dy))
    for what, actual, exact in (("y", y, x @ w), ("dx", dx, dy @ w.T), ("dw", dw, x.T @ dy)):
        err = np.abs(np.asarray(actual, np.float64) - exact)
        assert np.all(err <= 2.0**-21 * np.abs(exact)), f"{what}: max error {err.max():.3g}"


# --- the full recipe against the unquantized GEMMs ------------------------------------------

# Relative Frobenius error of a GEMM of two independently quantized Gaussian operands is about
# sqrt(rMSE_a + rMSE_b) (docs/NUMERICS.md section 10: 1x16 RN 0.0090, 16x16 0.0124, 1x16 SR 0.0188):
# fprop 0.146, dgrad 0.177, wgrad 0.167. The bound allows 30% above the largest on 256x128.
REL_ERROR_BOUND = 0.23


def test_full_recipe_is_within_quantization_error_of_exact_gradients():
    m, k, n = 256, 128, 128
    x, w, dy = normal((m, k), 14), normal((k, n), 15), normal((m, n), 16)
    y, dx, dw = vjp(x, w, dy, NVFP4Recipe(), jax.random.key(3))
    xe, we, dye = f64(x), f64(w), f64(dy)
    for what, actual, exact in (("y", y, xe @ we), ("dx", dx, dye @ we.T), ("dw", dw, xe.T @ dye)):
        a = f64(actual).ravel()
        e = exact.ravel()
        cosine = a @ e / (np.linalg.norm(a) * np.linalg.norm(e))
        rel = np.linalg.norm(a - e) / np.linalg.norm(e)
        assert cosine > 0.97, f"{what}: cosine {cosine:.4f}"
        assert rel < REL_ERROR_BOUND, f"{what}: relative error {rel:.4f}"


# --- transformations -------------------------------------------------------------------------


def loss(x, w, dy, key):
    return jnp.sum(dot_general(x, w, DENSE, key=key) * dy)


def test_jit_and_grad_equal_eager_vjp():
    x, w, dy = normal((32, 64), 23), normal((64, 32), 24), normal((32, 32), 25)
    key = jax.random.key(6)
    y, pullback = jax.vjp(lambda a, b: dot_general(a, b, DENSE, key=key), x, w)
    dx, dw = pullback(dy)
    assert_same_bits(jax.jit(lambda a, b: dot_general(a, b, DENSE, key=key))(x, w), y)
    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, dy, key)
    assert_same_up_to_summation_order(gx, dx, 32)
    assert_same_up_to_summation_order(gw, dw, 32)


def test_remat_gives_the_same_gradients():
    x, w, dy = normal((32, 64), 26), normal((64, 32), 27), normal((32, 32), 28)
    key = jax.random.key(7)
    plain = jax.grad(loss, argnums=(0, 1))(x, w, dy, key)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, w, dy, key)
    for a, b in zip(plain, remat, strict=True):
        assert_same_bits(a, b)


def stack_loss(ws, h, key, use_scan):
    def layer(h, w_i):
        w, i = w_i
        return jnp.tanh(dot_general(h, w, DENSE, key=jax.random.fold_in(key, i))), None

    layers = (ws, jnp.arange(ws.shape[0]))
    if use_scan:
        h, _ = jax.lax.scan(layer, h, layers)
    else:
        for i in range(ws.shape[0]):
            h, _ = layer(h, (ws[i], layers[1][i]))
    return jnp.sum(h**2)


def test_scan_over_stacked_layers_equals_unrolled_loop():
    ws, h = normal((3, 32, 32), 29) * 0.3, normal((32, 32), 30)
    key = jax.random.key(8)
    scan = jax.jit(jax.value_and_grad(stack_loss, argnums=(0, 1)), static_argnums=3)
    loss_s, grads_s = scan(ws, h, key, True)
    loss_u, grads_u = scan(ws, h, key, False)
    assert_same_bits(loss_s, loss_u)
    for a, b in zip(grads_s, grads_u, strict=True):
        assert_same_bits(a, b)


def test_vmap_of_forward_is_per_example():
    # Under vmap every example is its own tensor (its own amax): equal to a loop of calls.
    xs, ws = normal((3, 32, 64), 31), normal((3, 64, 32), 32)
    ys = jax.jit(jax.vmap(lambda a, b: dot_general(a, b, DENSE)))(xs, ws)
    for i in range(3):
        assert_same_up_to_summation_order(ys[i], jit_dot_general(xs[i], ws[i], DENSE), 64)


def test_vmap_of_grad_is_per_example():
    xs, w, dys = normal((3, 32, 64), 33), normal((64, 32), 34), normal((3, 32, 32), 35)
    key = jax.random.key(9)
    grad = jax.grad(loss, argnums=(0, 1))
    g = jax.jit(jax.vmap(grad, in_axes=(0, None, 0, None)))(xs, w, dys, key)
    for i in range(3):
        gx, gw = jax.jit(grad)(xs[i], w, dys[i], key)
        assert_same_up_to_summation_order(g[0][i], gx, 32)
        assert_same_up_to_summation_order(g[1][i], gw, 32)


# --- residuals -----------------------------------------------------------------------------


def test_forward_saves_quantized_residuals_not_inputs():
    m, k, n = 64, 128, 48
    x, w = normal((m, k), 36), normal((k, n), 37)
    _, pullback = jax.vjp(lambda a, b: dot_general(a, b, DENSE, key=jax.random.key(0)), x, w)
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(pullback) if hasattr(leaf, "dtype")]
    arrays = [leaf for leaf in leaves if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)]
    shapes = {(jnp.dtype(a.dtype).name, a.shape) for a in arrays}
    # Packed codes of W (stored (N, K)) and of x along the tokens (stored (K, M)), and scales.
    assert ("uint8", (n, k // 2)) in shapes and ("uint8", (k, m // 2)) in shapes, shapes
    assert ("float8_e4m3fn", (n, k // 16)) in shapes and ("float8_e4m3fn", (k, m // 16)) in shapes
    big_float = [
        s for d, s in shapes if d in ("float32", "bfloat16", "float16") and math.prod(s) >= 16 * 16
    ]
    assert not big_float, f"high-precision residuals were saved: {big_float}"
    saved = sum(a.nbytes for a in arrays)
    assert saved < (x.nbytes + w.nbytes) / 6, f"{saved} residual bytes"


# --- errors and the recipe -------------------------------------------------------------------


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, dims, dtype, error, message",
    [
        (
            (2, 32, 64),
            (3, 64, 32),
            (((2,), (1,)), ((0,), (0,))),
            "float32",
            TypeError,
            r"batch dimensions \(0,\) of lhs \(2, 32, 64\) .* equal sizes",
        ),
        ((32, 40), (40, 32), DENSE, "float32", ValueError, r"contracting \(K\) size .* got 40"),
        ((32, 64), (64, 40), DENSE, "float32", ValueError, r"rhs free \(N\) size .* got 40"),
        (
            (32, 64),
            (64, 32),
            DENSE,
            "int32",
            TypeError,
            r"lhs must be bfloat16.*int32 \(shape \(32, 64\)\)",
        ),
        ((32, 64), (48, 32), DENSE, "float32", TypeError, "of equal sizes"),
        ((32, 64), (64, 32), ((1,), (0,)), "float32", TypeError, "dimension_numbers must be"),
        ((32, 64), (64, 32), (((2,), (0,)), ((), ())), "float32", TypeError, r"below the rank"),
        ((32, 64), (64, 32), (((-1,), (0,)), ((), ())), "float32", TypeError, r"non-negative"),
        ((32, 64), (64, 32), (((1, 1), (0, 0)), ((), ())), "float32", TypeError, "distinct"),
    ],
    ids=[
        "batch_sizes_differ",
        "k_not_16",
        "n_not_16",
        "int_dtype",
        "k_mismatch",
        "malformed_dims",
        "dim_out_of_range",
        "negative_dim",
        "repeated_dim",
    ],
)
def test_unsupported_calls_raise_clear_errors(lhs_shape, rhs_shape, dims, dtype, error, message):
    lhs = jnp.ones(lhs_shape, dtype)
    rhs = jnp.ones(rhs_shape, jnp.float32)
    with pytest.raises(error, match=message):
        dot_general(lhs, rhs, dims)


def test_recipe_is_frozen_keyword_only_hashable_and_validated():
    import dataclasses  # noqa: PLC0415

    assert hash(NVFP4Recipe()) == hash(NVFP4Recipe())
    assert NVFP4Recipe() != NVFP4Recipe(wgrad_rht=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NVFP4Recipe().weight_2d = False
    with pytest.raises(TypeError):
        NVFP4Recipe(True)
    with pytest.raises(TypeError, match="weight_2d must be a bool"):
        NVFP4Recipe(weight_2d=1)
    with pytest.raises(TypeError, match="gemm_dtype"):
        NVFP4Recipe(gemm_dtype=jnp.int8)
    with pytest.raises(ValueError, match="implementation"):
        NVFP4Recipe(implementation="cuda")
    # Usable as a static argument of jit.
    f = jax.jit(lambda x, w, recipe: dot_general(x, w, DENSE, recipe=recipe), static_argnums=2)
    assert f(jnp.ones((16, 16)), jnp.ones((16, 16)), ALL_OFF).shape == (16, 16)
