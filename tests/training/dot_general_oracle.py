"""The oracle of the NVFP4 `dot_general` tests (test_dot_general.py, test_dot_general_sr_keys.py):
each GEMM built from the public quantizer (`implementation="reference"`) and float64
products, and the f32 summation-order budget it is compared within (test_dot_general.py's
docstring says how); the implementations and recipes the tests run on, and `vjp`, the
jitted (y, dx, dW) of `dot_general`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from helpers import DENSE

from nvfp4_jax import NVFP4Recipe, dot_general, kernels, quantize
from nvfp4_jax._src.core.formats import decode_scale as global_decode_scale
from nvfp4_jax._src.core.reference.quantize import block_values

F32_EPS = 2.0**-24
# Unit roundoff of a result cast to the output dtype (on top of the f32 budget).
CAST_EPS = {np.dtype(np.float32): 0.0, jnp.dtype(jnp.bfloat16): 2.0**-8}
IMPLEMENTATIONS = ["reference"] + (["ffi"] if kernels.is_available("cpu") else [])
ALL_OFF = NVFP4Recipe(weight_2d=False, wgrad_rht=False, stochastic_rounding=False)
RECIPES = {
    "default": NVFP4Recipe(),
    "all_off": ALL_OFF,
    "w1d": NVFP4Recipe(weight_2d=False),
    "no_rht": NVFP4Recipe(wgrad_rht=False),
}


def with_impl(recipe: NVFP4Recipe, implementation: str) -> NVFP4Recipe:
    return NVFP4Recipe(
        weight_2d=recipe.weight_2d,
        wgrad_rht=recipe.wgrad_rht,
        stochastic_rounding=recipe.stochastic_rounding,
        implementation=implementation,
    )


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def assert_same_up_to_summation_order(actual, expected, k):
    """Equal but for the GEMM's f32 summation order: a batched GEMM (vmap) or a fused one
    (jit) may use another CPU kernel than a single one; the quantized operands are equal."""
    atol = (k + 2) * F32_EPS * np.abs(np.asarray(expected)).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


# --- the oracle -----------------------------------------------------------------------------


def operand(x, **kw):
    """(per-block values as float64 in x's logical layout, D) of `quantize(x, **kw)`."""
    q = quantize(jnp.asarray(x), implementation="reference", **kw)
    values = np.moveaxis(f64(block_values(q, jnp.float32)), -1, q.axis)
    return values, global_decode_scale(q.amax)


def alpha_of(d_a, d_b) -> np.float64:
    """alpha = D_a * D_b, rounded to f32 as the GEMM computes it."""
    return np.float64(np.float32(d_a) * np.float32(d_b))


def assert_gemm_close(actual, a, b, alpha, what, *, contract=((1,), (0,))):
    """actual ~ alpha * tensordot(a, b), within the f32 summation-order budget."""
    k = math.prod(a.shape[d] for d in contract[0])
    expected = alpha * np.tensordot(a, b, contract)
    budget = (k + 2) * F32_EPS * alpha * np.tensordot(np.abs(a), np.abs(b), contract)
    budget += CAST_EPS[jnp.dtype(actual.dtype)] * np.abs(expected)
    err = np.abs(f64(actual) - expected)
    worst = np.max(err - budget)
    assert worst <= 0, f"{what}: error exceeds the f32 summation budget by {worst:.3g}"


def pad_tokens(a: np.ndarray) -> np.ndarray:
    return np.pad(a, ((0, -a.shape[0] % 16), (0, 0)))


def backward_oracle(x, w, dy, recipe, key):
    """(dx, dW) of the recipe's dgrad and wgrad GEMMs, from `quantize` and float64 products.

    x (M, K), w (K, N), dy (M, N). The key is split as `dot_general` splits it: the first
    half rounds dy for dgrad, the second dy for wgrad.
    """
    sr = recipe.stochastic_rounding
    dgrad_key, wgrad_key = jax.random.split(key) if sr else (None, None)
    dy_n, d_dy = operand(dy, axis=-1, stochastic_rounding=sr, key=dgrad_key)
    if recipe.weight_2d:
        w_k, d_w = operand(w, axis=0, block_2d=True)  # the forward's W, (K, N)
    else:
        w_k, d_w = operand(w, axis=1)  # 1x16 along N, (K, N)
    dx = (dy_n, w_k.T, alpha_of(d_dy, d_w))

    rht = recipe.wgrad_rht
    x_m, d_x = operand(pad_tokens(np.asarray(x)), axis=0, rht=rht)
    dy_m, d_dy_m = operand(
        pad_tokens(np.asarray(dy)), axis=0, rht=rht, stochastic_rounding=sr, key=wgrad_key
    )
    dw = (x_m.T, dy_m, alpha_of(d_x, d_dy_m))
    return dx, dw


jit_dot_general = jax.jit(
    dot_general, static_argnames=("dimension_numbers", "preferred_element_type", "recipe")
)


@functools.partial(jax.jit, static_argnames=("recipe", "dims"))
def vjp(x, w, dy, recipe, key, dims=DENSE):
    """(y, dx, dW) of `dot_general` (jitted: the eager reference is slow op by op)."""
    y, pullback = jax.vjp(lambda a, b: dot_general(a, b, dims, recipe=recipe, key=key), x, w)
    return (y, *pullback(dy))
