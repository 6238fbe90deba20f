"""What every kind of bad input gets, the same on every implementation (docs/guides/quantize.md).

Each test runs on every implementation (`impl`): a clear error naming the argument at fault,
or the defined result of docs/NUMERICS.md section 8 (NaN amax, NaN scales 0x7F, zero codes;
empty results with amax 0 for zero-size tensors), never a silent wrong number.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numerics_oracle as oracle
import numpy as np
import pytest
from flax import nnx
from helpers import DENSE, assert_same_bits, assert_same_q, heavy_tailed

import nvfp4_jax
from nvfp4_jax._src.core import ops as core_ops

NAN_BYTE = 0x7F


def assert_nan_tensor(q):
    """Section 8: amax NaN, every scale byte 0x7F, every code 0."""
    assert np.isnan(float(q.amax))
    assert np.all(np.asarray(q.scales).view(np.uint8) == NAN_BYTE)
    assert not np.asarray(q.codes).any()


# --- non-finite input, at every size ----------------------------------------------------------


@pytest.mark.parametrize("shape", [(32, 64), (64, 128), (256, 512)], ids=["2k", "8k", "131k"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_input_gives_a_nan_tensor_at_every_size(impl, shape, bad):
    # XLA's CPU max reduction drops NaN from 4096 elements on: the amax must not.
    x = heavy_tailed(shape, "f32", seed=1)
    x[shape[0] - 3, shape[1] - 5] = bad
    q = impl.quantize(x)
    assert_nan_tensor(q)
    assert np.isnan(float(impl.tensor_amax(x)))
    assert np.all(np.isnan(np.asarray(impl.dequantize(q))))
    assert np.all(np.isnan(np.asarray(impl.fake_quantize(x))))
    assert np.all(np.isnan(np.asarray(impl.fake_quantize(x, global_scale=False))))


@pytest.mark.parametrize("amax", [1.0, 1e30], ids=["small", "huge"])
def test_non_finite_input_with_a_caller_amax_is_still_nan(impl, amax):
    x = heavy_tailed((32, 64), "bf16", seed=2)
    x[5, 7] = np.inf
    q = impl.quantize(x, amax=jnp.float32(amax), block_2d=True)
    assert_nan_tensor(q)
    assert_same_q(q, oracle.quantize(x, block_2d=True, amax=amax))


@pytest.mark.parametrize("dims", ["x", "w"])
def test_dot_general_with_a_nan_operand_is_nan(impl, dims):
    x, w = heavy_tailed((64, 128), "f32", seed=3), heavy_tailed((128, 64), "f32", seed=4)
    (x if dims == "x" else w)[10, 20] = np.nan  # 8192 elements: above the NaN-dropping size
    recipe = nvfp4_jax.NVFP4Recipe(implementation=impl.implementation)
    y = jax.jit(lambda a, b: nvfp4_jax.dot_general(a, b, DENSE, recipe=recipe))(x, w)
    assert np.all(np.isnan(np.asarray(y)))


# --- the caller's amax ---------------------------------------------------------------------------


@pytest.mark.parametrize("amax", [-1.0, np.nan, np.inf, -np.inf], ids=["neg", "nan", "inf", "-inf"])
def test_a_concrete_invalid_amax_is_an_error(impl, amax):
    x = heavy_tailed((16, 32), "f32", seed=5)
    for op in (nvfp4_jax.quantize, nvfp4_jax.fake_quantize):
        with pytest.raises(ValueError, match="amax must be a finite, non-negative number"):
            op(x, amax=amax, implementation=impl.implementation)


# The negative subnormal: the reference once read it as -0 (a valid amax) where XLA's CPU
# code flushed it in the comparison (the tests' XLA flags), and stored it as its amax.
TRACED_INVALID = [-1.0, -(2.0**-149), np.nan, np.inf]


@pytest.mark.parametrize("ms_eden", [False, True], ids=["nvfp4", "ms_eden"])
@pytest.mark.parametrize("amax", TRACED_INVALID, ids=["neg", "neg-subnormal", "nan", "inf"])
def test_a_traced_invalid_amax_gives_a_nan_tensor(impl, amax, ms_eden):
    x = heavy_tailed((16, 128), "f32", seed=6)
    # MS-EDEN draws its scales' rounding and its rotation's signs from keys.
    keys = {"key": jax.random.key(0), "rotation_key": jax.random.key(1)} if ms_eden else {}

    def traced(op):  # jitted: the amax is traced
        fn = functools.partial(op, implementation=impl.implementation, ms_eden=ms_eden, **keys)
        return jax.jit(lambda x, a: fn(x, amax=a))(x, jnp.float32(amax))

    assert_nan_tensor(traced(nvfp4_jax.quantize))
    assert np.all(np.isnan(np.asarray(traced(nvfp4_jax.fake_quantize))))


def test_a_traced_subnormal_or_negative_zero_amax_is_valid(impl):
    x = np.zeros((16, 32), np.float32)
    for amax in (-0.0, 2.0**-149):
        q = impl.quantize(x, amax=jnp.float32(amax))
        assert not np.isnan(np.asarray(q.amax)), amax
        assert np.all(np.asarray(q.scales).view(np.uint8) != 0x7F), amax


def test_amax_must_be_a_float_scalar(impl):
    x = jnp.ones((16, 32))
    with pytest.raises(ValueError, match=r"amax must be a scalar, got shape \(2,\)"):
        nvfp4_jax.quantize(x, amax=jnp.ones(2), implementation=impl.implementation)
    with pytest.raises(TypeError, match="amax must be a float scalar"):
        nvfp4_jax.quantize(x, amax=True, implementation=impl.implementation)


# --- zero-size tensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape,axis", [((0, 64), -1), ((16, 0), -1), ((0,), -1), ((0, 32), 0)])
def test_zero_size_tensors_give_empty_results_with_amax_zero(impl, shape, axis):
    x = np.zeros(shape, np.float32)
    q = impl.quantize(x, axis=axis)
    stored = nvfp4_jax.layout.packed_shape(shape, axis)
    assert q.codes.shape == stored and q.shape == shape
    assert float(q.amax) == 0.0
    assert_same_q(q, oracle.quantize(x, axis=axis))
    assert impl.dequantize(q).shape == shape
    assert impl.fake_quantize(x, axis=axis).shape == shape
    assert float(impl.tensor_amax(x, axis=axis)) == 0.0
    if shape[-1] % 16 == 0:
        assert impl.apply_rht(x).shape == shape


def test_zero_size_stochastic_rounding(impl):
    q = impl.quantize(
        np.zeros((0, 32), np.float32), stochastic_rounding=True, key=jax.random.key(0)
    )
    assert q.codes.shape == (0, 16) and float(q.amax) == 0.0


# --- arguments ----------------------------------------------------------------------------------

QUANTIZE_ERRORS = [
    ("axis_bool", dict(axis=True), TypeError, "axis must be an int, got True"),
    ("axis_float", dict(axis=1.0), TypeError, "axis must be an int"),
    ("axis_range", dict(axis=2), ValueError, r"axis=2 is out of range for shape \(16, 32\)"),
    ("block_2d_str", dict(block_2d="yes"), TypeError, "block_2d must be a bool"),
    ("rht_int", dict(rht=1), TypeError, "rht must be a bool"),
    ("sr_no_key", dict(stochastic_rounding=True), ValueError, "needs a PRNG key, got key=None"),
    ("sr_bad_key", dict(stochastic_rounding=True, key="k"), TypeError, "key must be a JAX PRNG"),
    ("implementation", dict(implementation="cuda"), ValueError, "implementation must be one of"),
]


@pytest.mark.parametrize(
    "kw,error,message", [c[1:] for c in QUANTIZE_ERRORS], ids=[c[0] for c in QUANTIZE_ERRORS]
)
def test_bad_quantize_arguments_name_the_argument(impl, kw, error, message):
    kw = {"implementation": impl.implementation, **kw}
    for op in (nvfp4_jax.quantize, nvfp4_jax.fake_quantize):
        with pytest.raises(error, match=message):
            op(jnp.ones((16, 32)), **kw)


def test_dequantize_arguments(impl):
    q = nvfp4_jax.quantize(jnp.ones((16, 32)), implementation="reference")
    for bad, pattern in ((None, "got None"), (jnp.int8, "int8"), ("float64", "float64")):
        with pytest.raises(TypeError, match=f"dequantize: dtype must be bfloat16.*{pattern}"):
            nvfp4_jax.dequantize(q, bad, implementation=impl.implementation)
    with pytest.raises(TypeError, match="q must be an NVFP4Array, got ndarray"):
        nvfp4_jax.dequantize(np.ones(3), implementation=impl.implementation)


def test_fake_quantize_output_dtype(impl):
    with pytest.raises(TypeError, match="fake_quantize: dtype must be .* got int32"):
        nvfp4_jax.fake_quantize(
            jnp.ones((16, 32)), dtype=jnp.int32, implementation=impl.implementation
        )


def test_rank_zero_is_an_error(impl):
    for op in (nvfp4_jax.quantize, nvfp4_jax.tensor_amax, nvfp4_jax.apply_rht):
        with pytest.raises(ValueError, match=re.escape("shape ()")):
            op(jnp.float32(1), implementation=impl.implementation)


# --- GEMMs --------------------------------------------------------------------------------------


def test_scaled_matmul_rejects_mixed_rht_and_bad_dtypes():
    a = nvfp4_jax.quantize(jnp.ones((32, 64)))
    b = nvfp4_jax.quantize(jnp.ones((16, 64)), rht=True)
    with pytest.raises(ValueError, match="both or neither be quantized with the RHT"):
        nvfp4_jax.scaled_matmul(a, b, backend="emulated")
    with pytest.raises(TypeError, match="gemm_dtype must be .* got int8"):
        nvfp4_jax.scaled_matmul(a, a, backend="emulated", gemm_dtype=jnp.int8)
    with pytest.raises(TypeError, match="gemm_dtype must be .* got float8_e4m3fn"):
        nvfp4_jax.scaled_matmul(a, a, backend="emulated", gemm_dtype=jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="preferred_element_type must be a float dtype, got int32"):
        nvfp4_jax.scaled_matmul(a, a, backend="emulated", preferred_element_type=jnp.int32)
    assert nvfp4_jax.scaled_matmul(a, a, backend="emulated").shape == (32, 32)


def test_dot_general_rejects_integer_results_and_non_recipes():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    with pytest.raises(TypeError, match="preferred_element_type must be a float dtype, got int32"):
        nvfp4_jax.dot_general(x, w, DENSE, preferred_element_type=jnp.int32)
    with pytest.raises(TypeError, match="recipe must be an NVFP4Recipe"):
        nvfp4_jax.dot_general(x, w, DENSE, recipe={"weight_2d": True})


def test_recipe_rejects_bad_gemm_dtype():
    with pytest.raises(TypeError, match="gemm_dtype must be .* got int8"):
        nvfp4_jax.NVFP4Recipe(gemm_dtype=jnp.int8)
    with pytest.raises(TypeError, match="got None"):
        nvfp4_jax.NVFP4Recipe(gemm_dtype=None)


def test_the_same_error_on_every_implementation(impl):
    """The checks run before the implementation is chosen: one message for all of them."""
    messages = {}
    for implementation in ("reference", impl.implementation):
        with pytest.raises(ValueError) as info:
            nvfp4_jax.quantize(jnp.ones((8, 40)), implementation=implementation)
        messages[implementation] = str(info.value)
    assert len(set(messages.values())) == 1, messages


@pytest.mark.slow
def test_the_rht_of_tiny_values_dequantizes_alike(impl):
    """docs/NUMERICS.md section 8: where the RHT's butterflies meet f32 subnormals (flushed by
    XLA on CPU), codes of that block may differ, but its scale is 0, so it decodes to 0."""
    x = np.zeros((2, 32), np.float32)
    x[0, :3] = [1.5 * 2**-126, 2**-126, 2**-122]  # a block of tiny values
    x[1, 0] = 1.0
    q = impl.quantize(x, rht=True)
    assert np.all(np.asarray(q.scales).view(np.uint8)[0] == 0)
    reference = nvfp4_jax.reference.dequantize(nvfp4_jax.reference.quantize(x, rht=True))
    assert_same_bits(impl.dequantize(q), reference)
    np.testing.assert_array_equal(np.asarray(impl.dequantize(q))[0], 0)


# --- non-finite data eagerly and under jit: the same NaN, never an error ---------------------
# The GEMM computes each operand's tensor amax and quantizes with it: that amax is data, so
# a NaN/inf operand must give the same NaN result run eagerly as under `jax.jit` (where
# the amax is traced), not the ValueError a user's concrete invalid `amax=` gets.

LAYER_APIS = ["dot_general", "drop_in_nnx_linear", "nnx_linear", "linen_dense"]


def _layer_fn(api: str, implementation: str):
    """`f(x (16, 32), w (32, 16)) -> y` through one of the four NVFP4 GEMM entry points."""
    recipe = nvfp4_jax.NVFP4Recipe(implementation=implementation)
    if api == "dot_general":
        return lambda x, w: nvfp4_jax.dot_general(x, w, DENSE, recipe=recipe)
    if api == "linen_dense":
        layer = nvfp4_jax.linen.Dense(16, recipe=recipe)
        return lambda x, w: layer.apply({"params": {"kernel": w, "bias": jnp.zeros(16)}}, x)
    if api == "nnx_linear":
        module = nvfp4_jax.nnx.Linear(32, 16, recipe=recipe, rngs=nnx.Rngs(0, quantize=1))
    else:
        dot = nvfp4_jax.nvfp4_dot_general(recipe)
        module = nnx.Linear(32, 16, dot_general=dot, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def apply(x, w):
        params_w = nnx.State(dict(params))
        params_w["kernel"] = params["kernel"].replace(w)
        # A fresh copy of the same state (the same SR key) on every call.
        return nnx.merge(graphdef, params_w, rest, copy=True)(x)

    return apply


def _value_and_grads(f, x, w, dy):
    y, pullback = jax.vjp(f, x, w)
    return (y, *pullback(dy))


@pytest.mark.slow
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["x", "w", "dy"])
@pytest.mark.parametrize("api", LAYER_APIS)
def test_non_finite_gemm_data_gives_the_same_nan_eagerly_and_under_jit(impl, api, where, bad):
    x, w = heavy_tailed((16, 32), "f32", seed=7), heavy_tailed((32, 16), "f32", seed=8)
    dy = heavy_tailed((16, 16), "f32", seed=9)
    {"x": x, "w": w, "dy": dy}[where][3, 5] = bad
    f = _layer_fn(api, impl.implementation)
    with jax.default_device(impl.device):
        eager = _value_and_grads(f, x, w, dy)
        jitted = jax.jit(lambda a, b, c: _value_and_grads(f, a, b, c))(x, w, dy)
    # docs/guides/quantize.md: NaN or inf anywhere in an operand -> the GEMM it enters is all NaN.
    nan_in = {"y": where in ("x", "w"), "dx": where in ("w", "dy"), "dw": where in ("x", "dy")}
    for name, a, b in zip(("y", "dx", "dw"), eager, jitted, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if nan_in[name]:
            assert np.all(np.isnan(a)), f"{name}: eager not all NaN"
            assert_same_bits(a, b, f"{name}: eager vs jit")
        else:
            # A finite GEMM of the same operands; jit may pick another CPU kernel, so equal up
            # to the f32 summation order of its contraction (K = 32 at most here).
            assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), name
            np.testing.assert_allclose(a, b, rtol=0, atol=(32 + 2) * 2.0**-24 * np.abs(a).max())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0], ids=["nan", "inf", "neg"])
def test_an_amax_the_library_computed_is_data_eagerly_as_under_jit(impl, bad):
    x = heavy_tailed((16, 32), "f32", seed=10)
    amax = jnp.float32(bad)
    for op in (core_ops.quantize_with_data_amax, core_ops.fake_quantize_with_data_amax):
        with jax.default_device(impl.device):
            eager = op(x, amax, implementation=impl.implementation)
            jitted = jax.jit(lambda a, m, op=op: op(a, m, implementation=impl.implementation))(
                x, amax
            )
        if op is core_ops.quantize_with_data_amax:
            assert_nan_tensor(eager)
            assert_same_q(eager, jitted, "quantize eager vs jit")
        else:
            assert np.all(np.isnan(np.asarray(eager)))
            assert_same_bits(eager, jitted, "fake_quantize eager vs jit")
    # A user's concrete invalid amax is still an error, on the public ops and the reference.
    for op in (
        nvfp4_jax.quantize,
        nvfp4_jax.fake_quantize,
        nvfp4_jax.reference.quantize,
        nvfp4_jax.reference.fake_quantize,
    ):
        with pytest.raises(ValueError, match="amax must be a finite, non-negative number"):
            op(x, amax=bad)
