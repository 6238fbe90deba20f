"""Per-GEMM precision switches of `NVFP4Recipe` (`fprop`, `dgrad`, `wgrad`): a precision schedule.

A GEMM switched off runs in high precision: `jax.lax.dot_general` (`jax.lax.ragged_dot` for
the grouped op) on the unquantized operands with f32 accumulation, its backward GEMMs as JAX's
autodiff computes them. The GEMMs left on are today's NVFP4 ones, bit for bit, for the same
output gradient and key. Shape letters: x (M, K), W (K, N), dy (M, N).
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nvfp4_jax
import nvfp4_jax.nnx as nvfp4_nnx
from nvfp4_jax import NVFP4Recipe, dot_general, ragged_dot
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.model.convert.rules import Rule, recipe_from_dict, recipe_to_dict

DIMS = (((1,), (0,)), ((), ()))
# `nvfp4_jax.dot_general` is the function; its module holds the custom_vjp.
dot_general_module = importlib.import_module("nvfp4_jax._src.training.dot_general")
GEMMS = ("fprop", "dgrad", "wgrad")
ALL_HIGH = NVFP4Recipe(fprop=False, dgrad=False, wgrad=False)
KEY = jax.random.key(7)
GROUP_SIZES = jnp.array([8, 0, 21, 3])  # an empty group, sizes not multiples of 16


def _data(dtype, m=40, k=64, n=32, groups=None):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w_shape = (k, n) if groups is None else (groups, k, n)
    w = (jax.random.normal(kw, w_shape, jnp.float32) / 8).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    return x, w, dy


def _nvfp4(recipe, out_dtype=None):
    return lambda x, w: dot_general(
        x, w, DIMS, preferred_element_type=out_dtype, recipe=recipe, key=KEY
    )


def _lax(out_dtype):
    return lambda x, w: jax.lax.dot_general(x, w, DIMS, preferred_element_type=jnp.float32).astype(
        out_dtype
    )


def _ragged(recipe):
    return lambda x, w: ragged_dot(x, w, GROUP_SIZES, recipe=recipe, key=KEY)


def _lax_ragged(out_dtype):
    return lambda x, w: jax.lax.ragged_dot(
        x, w, GROUP_SIZES, preferred_element_type=jnp.float32
    ).astype(out_dtype)


def _vjp(fn, x, w, dy):
    """(y, dx, dW) of `fn` for the output gradient dy, jitted as training runs it."""

    @jax.jit
    def run(x, w, dy):
        y, pullback = jax.vjp(fn, x, w)
        return (y, *pullback(dy.astype(y.dtype)))

    return run(x, w, dy)


def _assert_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=what
    )


# --- the recipe --------------------------------------------------------------------------------


def test_switches_default_on_and_round_trip_through_the_dict_form():
    recipe = NVFP4Recipe()
    assert (recipe.fprop, recipe.dgrad, recipe.wgrad) == (True, True, True)
    for switched in (NVFP4Recipe(fprop=False), NVFP4Recipe(dgrad=False, wgrad=False), ALL_HIGH):
        fields = recipe_to_dict(switched)
        assert {fields[g] for g in GEMMS} <= {True, False}
        assert recipe_from_dict(fields) == switched
        assert Rule.from_dict(Rule("x", switched).to_dict()) == Rule("x", switched)
        assert hash(switched) != hash(recipe) and switched != recipe  # a distinct jit key
    # A dict written before the switches existed loads with every GEMM in NVFP4.
    old = {k: v for k, v in recipe_to_dict(NVFP4Recipe(weight_2d=False)).items() if k not in GEMMS}
    assert recipe_from_dict(old) == NVFP4Recipe(weight_2d=False)


@pytest.mark.parametrize("name", GEMMS)
@pytest.mark.parametrize("value", [1, 0, "no", None, 1.0, jnp.array(True)])
def test_bad_switch_values_raise_naming_the_switch(name, value):
    with pytest.raises(TypeError, match=f"NVFP4Recipe: {name} must be a bool"):
        NVFP4Recipe(**{name: value})


def test_numpy_bools_are_accepted():
    assert NVFP4Recipe(fprop=np.bool_(False)) == NVFP4Recipe(fprop=False)


# --- dot_general -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, out_dtype",
    [(jnp.bfloat16, None), (jnp.float32, None), (jnp.bfloat16, jnp.float32)],
)
def test_all_high_precision_is_lax_dot_general(dtype, out_dtype):
    x, w, dy = _data(dtype)
    want = _vjp(_lax(jnp.dtype(out_dtype or dtype)), x, w, dy)
    got = _vjp(_nvfp4(ALL_HIGH, out_dtype), x, w, dy)
    for name, g, r in zip(("y", "dx", "dW"), got, want, strict=True):
        _assert_equal(g, r, name)


@pytest.mark.slow
@pytest.mark.parametrize("weight_2d", [True, False])
@pytest.mark.parametrize("off", GEMMS)
def test_one_gemm_in_high_precision_others_unchanged(off, weight_2d):
    """Each single switch off: that GEMM equals the high-precision one exactly, the other two
    equal today's NVFP4 ones computed from the same dy (and key)."""
    x, w, dy = _data(jnp.bfloat16)
    base = NVFP4Recipe(weight_2d=weight_2d)
    nvfp4 = _vjp(_nvfp4(base), x, w, dy)
    high = _vjp(_lax(jnp.bfloat16), x, w, dy)
    got = _vjp(_nvfp4(dataclasses.replace(base, **{off: False})), x, w, dy)
    for name, gemm, g, q, h in zip(("y", "dx", "dW"), GEMMS, got, nvfp4, high, strict=True):
        _assert_equal(g, h if gemm == off else q, f"{name} with {off} off")
    assert not np.array_equal(np.asarray(nvfp4[0], np.float32), np.asarray(high[0], np.float32))


def test_two_gemms_in_high_precision():
    x, w, dy = _data(jnp.bfloat16)
    nvfp4 = _vjp(_nvfp4(NVFP4Recipe()), x, w, dy)
    high = _vjp(_lax(jnp.bfloat16), x, w, dy)
    got = _vjp(_nvfp4(NVFP4Recipe(fprop=False, dgrad=False)), x, w, dy)
    _assert_equal(got[0], high[0], "y")
    _assert_equal(got[1], high[1], "dx")
    _assert_equal(got[2], nvfp4[2], "dW")


def test_the_forward_saves_only_what_the_backward_needs():
    x, w, _ = _data(jnp.bfloat16)
    recipe = NVFP4Recipe(gemm_backend="emulated")

    def residuals(**switches):
        r = dataclasses.replace(recipe, **switches)
        fwd = dot_general_module._nvfp4_matmul_fwd
        _, (w_res, x_res, *_) = fwd(x, w, KEY, None, r, jnp.bfloat16)
        return w_res, x_res

    w_res, x_res = residuals()
    assert isinstance(w_res, NVFP4Array) and isinstance(x_res, NVFP4Array)
    w_res, x_res = residuals(fprop=False)  # the backward is NVFP4: packed residuals only
    assert isinstance(w_res, NVFP4Array) and isinstance(x_res, NVFP4Array)
    w_res, x_res = residuals(dgrad=False)
    assert w_res is w and isinstance(x_res, NVFP4Array)
    w_res, x_res = residuals(wgrad=False)
    assert isinstance(w_res, NVFP4Array) and x_res is x
    w_res, x_res = residuals(dgrad=False, wgrad=False)
    assert w_res is w and x_res is x


@pytest.mark.slow
@pytest.mark.parametrize("off", [("fprop",), ("dgrad",), ("wgrad",), GEMMS])
def test_batched_dot_general_honors_the_switches(off):
    """Batch element b is the unbatched call on it with `fold_in(key, b)`."""
    b, m, k, n = 3, 24, 32, 16
    kx, kw, kd = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (b, m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (b, k, n), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (b, m, n), jnp.float32).astype(jnp.bfloat16)
    recipe = NVFP4Recipe(**{g: False for g in off})
    dims = (((2,), (1,)), ((0,), (0,)))
    got = _vjp(lambda x, w: dot_general(x, w, dims, recipe=recipe, key=KEY), x, w, dy)
    for i in range(b):
        key = jax.random.fold_in(KEY, i)
        one = _vjp(
            lambda x, w, key=key: dot_general(x, w, DIMS, recipe=recipe, key=key), x[i], w[i], dy[i]
        )
        for name, g, o in zip(("y", "dx", "dW"), got, one, strict=True):
            # The f32 sums of a batched GEMM may run in another order: compare within it.
            np.testing.assert_allclose(
                np.asarray(g[i], np.float32),
                np.asarray(o, np.float32),
                rtol=2**-7,
                atol=1e-3,
                err_msg=f"{name} of element {i}",
            )


def test_nnx_layer_with_all_gemms_in_high_precision_is_the_plain_layer():
    x = jax.random.normal(jax.random.key(2), (8, 32), jnp.float32).astype(jnp.bfloat16)
    plain = nnx.Linear(32, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer = nvfp4_nnx.Linear(32, 16, dtype=jnp.bfloat16, recipe=ALL_HIGH, rngs=nnx.Rngs(0))
    want = jax.lax.dot_general(
        x, plain.kernel[...].astype(jnp.bfloat16), DIMS, preferred_element_type=jnp.float32
    ).astype(jnp.bfloat16) + plain.bias[...].astype(jnp.bfloat16)
    _assert_equal(layer(x), want, "y")


# --- ragged_dot --------------------------------------------------------------------------------


def test_ragged_all_high_precision_is_lax_ragged_dot():
    x, w, dy = _data(jnp.bfloat16, groups=4)
    want = _vjp(_lax_ragged(jnp.bfloat16), x, w, dy)
    got = _vjp(_ragged(ALL_HIGH), x, w, dy)
    for name, g, r in zip(("y", "dx", "dW"), got, want, strict=True):
        _assert_equal(g, r, name)
    assert not np.any(np.asarray(got[0][32:], np.float32))  # the rows in no group


@pytest.mark.slow
@pytest.mark.parametrize("off", GEMMS)
def test_ragged_one_gemm_in_high_precision_others_unchanged(off):
    x, w, dy = _data(jnp.bfloat16, groups=4)
    nvfp4 = _vjp(_ragged(NVFP4Recipe()), x, w, dy)
    high = _vjp(_lax_ragged(jnp.bfloat16), x, w, dy)
    got = _vjp(_ragged(NVFP4Recipe(**{off: False})), x, w, dy)
    for name, gemm, g, q, h in zip(("y", "dx", "dW"), GEMMS, got, nvfp4, high, strict=True):
        _assert_equal(g, h if gemm == off else q, f"{name} with {off} off")


def test_ragged_weight_1d_with_a_high_precision_forward():
    x, w, dy = _data(jnp.bfloat16, groups=4)
    base = NVFP4Recipe(weight_2d=False)
    nvfp4 = _vjp(_ragged(base), x, w, dy)
    got = _vjp(_ragged(dataclasses.replace(base, fprop=False)), x, w, dy)
    _assert_equal(got[1], nvfp4[1], "dx")
    _assert_equal(got[2], nvfp4[2], "dW")


# --- the forward's precision at run time (`high_precision_forward`) ----------------------------

BATCH_DIMS = (((2,), (1,)), ((0,), (0,)))


def _flagged(fn):
    """(y, dx, dW) of `fn` for dy under `high_precision_forward(flag)`, `flag` traced: one
    compiled program for both values."""

    @jax.jit
    def run(x, w, dy, flag):
        with nvfp4_jax.high_precision_forward(flag):
            y, pullback = jax.vjp(fn, x, w)
        return (y, *pullback(dy.astype(y.dtype)))

    return run


def _batched(recipe, key=KEY):
    return lambda x, w: dot_general(x, w, BATCH_DIMS, recipe=recipe, key=key)


@pytest.mark.slow
@pytest.mark.parametrize(
    "weight_2d, implementation", [(True, None), (False, None), (True, "reference")]
)
@pytest.mark.parametrize("op", ["dot_general", "batched", "ragged_dot", "no_key"])
def test_the_runtime_flag_gives_the_fprop_switchs_bits(op, weight_2d, implementation):
    base = NVFP4Recipe(weight_2d=weight_2d, implementation=implementation)
    x, w, dy = _data(jnp.bfloat16, groups=4 if op == "ragged_dot" else None)
    if op == "batched":
        x, w, dy = (jnp.stack([a, a[::-1] * 2]) for a in (x, w, dy))
    make = {
        "dot_general": _nvfp4,
        "batched": _batched,
        "ragged_dot": _ragged,
        "no_key": lambda r: lambda x, w: dot_general(x, w, DIMS, recipe=r),
    }[op]
    run = _flagged(make(base))
    for flag, recipe in ((False, base), (True, dataclasses.replace(base, fprop=False))):
        want = _vjp(make(recipe), x, w, dy)
        got = run(x, w, dy, jnp.bool_(flag))
        for name, g, r in zip(("y", "dx", "dW"), got, want, strict=True):
            _assert_equal(g, r, f"{name} of {op} with the flag {flag}")
    assert run._cache_size() == 1  # the switch compiled nothing


def test_the_flag_concerns_only_nvfp4_forwards():
    x, w, dy = _data(jnp.bfloat16)
    # A recipe with its forward already in high precision, and code outside the block.
    for recipe in (NVFP4Recipe(fprop=False), ALL_HIGH):
        want = _vjp(_nvfp4(recipe), x, w, dy)
        for flag in (False, True):
            got = _flagged(_nvfp4(recipe))(x, w, dy, jnp.bool_(flag))
            for name, g, r in zip(("y", "dx", "dW"), got, want, strict=True):
                _assert_equal(g, r, f"{name} of {recipe} with the flag {flag}")
    with nvfp4_jax.high_precision_forward(True):
        pass
    _assert_equal(_nvfp4(NVFP4Recipe())(x, w), _vjp(_nvfp4(NVFP4Recipe()), x, w, dy)[0], "after")


def test_the_flag_reaches_the_layers_and_eager_calls():
    x = jax.random.normal(jax.random.key(1), (8, 64), jnp.float32)
    layer = nvfp4_nnx.Linear(
        64, 32, recipe=NVFP4Recipe(stochastic_rounding=False), rngs=nnx.Rngs(0)
    )
    switched = nvfp4_nnx.Linear(
        64, 32, recipe=NVFP4Recipe(stochastic_rounding=False, fprop=False), rngs=nnx.Rngs(0)
    )
    # The two recipes differ on these inputs, so the flag's effect shows.
    assert not np.array_equal(np.asarray(layer(x)), np.asarray(switched(x)))
    for flag in (True, np.bool_(True), jnp.array(True)):  # eagerly
        with nvfp4_jax.high_precision_forward(flag):
            _assert_equal(layer(x), switched(x), "y")
    _assert_equal(layer(x), nvfp4_nnx.Linear(64, 32, rngs=nnx.Rngs(0), recipe=layer.recipe)(x), "y")


@pytest.mark.parametrize(
    "flag, message",
    [
        (1, "int"),
        (np.ones((2,), bool), "bool[2]"),
        (jnp.float32(1), "float32[]"),
        ("yes", "str"),
    ],
)
def test_a_bad_flag_is_named(flag, message):
    with pytest.raises(
        TypeError, match=r"high_precision_forward: flag must be a bool.*" + re.escape(message)
    ):
        with nvfp4_jax.high_precision_forward(flag):
            pass
