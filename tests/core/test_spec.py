"""QuantSpec, the one carrier of the quantize options below the public ops.

The public `quantize`/`fake_quantize` are the only functions that spell the options as
keywords; the reference, the kernel bindings, the GEMM operands and the diagnostics take a
`QuantSpec` whole (their old keyword forms still work, with a DeprecationWarning where they
were not the specification's own).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, assert_same_q, heavy_tailed

import nvfp4_jax
from nvfp4_jax import QuantSpec, kernels, reference
from nvfp4_jax._src.core.sr_seed import SRSeed

KEY = jax.random.key(3)


def test_from_keywords_takes_the_public_names():
    spec = QuantSpec.from_keywords(
        "quantize", axis=0, four_over_six="mse", four_over_six_e4m3_max=448
    )
    assert spec == QuantSpec(axis=0, four_over_six="mse", e4m3_max=448)
    # The public default M = 256 applies under Four Over Six only.
    assert QuantSpec.from_keywords("quantize", four_over_six="mae").e4m3_max == 256
    assert QuantSpec.from_keywords("quantize").e4m3_max == 448


@pytest.mark.parametrize(
    "keywords,match",
    [
        (dict(rounding="nearest"), "unexpected keyword argument 'rounding'"),
        (dict(e4m3_max=256, four_over_six_e4m3_max=256), "unexpected keyword argument"),
        (dict(op="x"), "unexpected keyword argument 'op'"),
    ],
    ids=["unknown", "both_names", "op"],
)
def test_from_keywords_rejects_what_is_not_an_option(keywords, match):
    with pytest.raises(TypeError, match=match):
        QuantSpec.from_keywords("quantize", **keywords)


@pytest.mark.parametrize("op", ["quantize", "fake_quantize"])
def test_reference_takes_a_spec_or_the_keywords_with_the_same_bits(op):
    x = heavy_tailed((32, 64), "bf16", seed=2)
    options = dict(axis=0, rht=True, stochastic_rounding=True, four_over_six="mse")
    fn = getattr(reference, op)
    by_keywords = fn(x, key=KEY, **options)
    by_spec = fn(x, QuantSpec.from_keywords(op, **options), key=KEY)
    public = getattr(nvfp4_jax, op)(x, key=KEY, implementation="reference", **options)
    if op == "quantize":
        assert_same_q(by_spec, by_keywords, "spec vs keywords")
        assert_same_q(by_spec, public, "reference vs the public op")
    else:
        assert_same_bits(by_spec, by_keywords, "spec vs keywords")
        assert_same_bits(by_spec, public, "reference vs the public op")
    with pytest.raises(TypeError, match="not both"):
        fn(x, QuantSpec(), axis=0)
    with pytest.raises(TypeError, match="spec must be a QuantSpec"):
        fn(x, {"axis": 0})


def test_errors_name_the_reference_op_whatever_the_spec_says():
    with pytest.raises(ValueError, match="^fake_quantize: .* multiple of 16"):
        reference.fake_quantize(jnp.ones((4, 20)), QuantSpec(op="quantize"))


def test_kernel_keywords_are_deprecated_and_give_the_spec_bits():
    if not kernels.is_available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    x = jnp.asarray(heavy_tailed((32, 64), "f32", seed=4))
    amax = nvfp4_jax.tensor_amax(x, implementation="ffi")
    seed = SRSeed.from_key(KEY)
    spec = QuantSpec(block_2d=True, four_over_six="mae", e4m3_max=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = kernels.quantize(x, amax, seed, spec)
    with pytest.warns(DeprecationWarning, match="pass a QuantSpec"):
        got = kernels.quantize(x, amax, seed, block_2d=True, four_over_six="mae", e4m3_max=256)
    for a, b in zip(got, want, strict=True):
        assert_same_bits(a, b, "kernels.quantize")
    with pytest.warns(DeprecationWarning):
        values = kernels.fake_quantize(
            x, amax, None, block_2d=False, rht=True, global_scale=True, dtype=jnp.float32
        )
    want = kernels.fake_quantize(x, amax, None, QuantSpec(rht=True, dtype=jnp.float32))
    assert_same_bits(values, want, "kernels.fake_quantize")


def test_gemm_operand_and_operand_stats_take_the_spec():
    x = jnp.asarray(heavy_tailed((32, 64), "f32", seed=5))
    spec = QuantSpec(axis=0, rht=True, stochastic_rounding=True)
    op = dict(backend="emulated", implementation="reference", key=KEY)
    want = nvfp4_jax.gemm.quantize_operand(x, spec, **op)
    with pytest.warns(DeprecationWarning, match="quantize_operand"):
        got = nvfp4_jax.gemm.quantize_operand(x, axis=0, rht=True, stochastic_rounding=True, **op)
    assert_same_bits(got.data, want.data, "operand values")
    assert_same_bits(got.decode, want.decode, "operand decode")
    stats = nvfp4_jax.diagnostics.operand_stats(x, spec, key=KEY, implementation="reference")
    with pytest.warns(DeprecationWarning, match="operand_stats"):
        old = nvfp4_jax.diagnostics.operand_stats(
            x, axis=0, rht=True, stochastic_rounding=True, key=KEY, implementation="reference"
        )
    assert {k: float(v) for k, v in stats.items()} == {k: float(v) for k, v in old.items()}
    assert np.isfinite(float(stats["rel_error"]))
