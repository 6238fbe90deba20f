"""MS-EDEN's statistics on the reference (docs/NUMERICS.md section 14): its error, and that
the products it makes are unbiased. Each bound says where it comes from.

Relative MSE is `||x_hat - y||^2 / ||y||^2` (y: what was quantized: x, its RHT or its
rotation); effective bits are `-log2(relative MSE) / 2` (Quartet II's measure: one more
bit of precision quarters the squared error). The reference gives the native kernels'
bits (tests/core/test_ms_eden.py), so these are the numbers of every implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax
from nvfp4_jax import reference

REF = dict(implementation="reference", dtype=jnp.float32)
KEY, ROTATION = jax.random.key(31), jax.random.key(32)


def relative_mse(x_hat, y) -> float:
    y = jnp.asarray(y, jnp.float32)
    return float(jnp.sum((jnp.asarray(x_hat, jnp.float32) - y) ** 2) / jnp.sum(y**2))


def effective_bits(mse: float) -> float:
    return -np.log2(mse) / 2


@pytest.fixture(scope="module")
def gaussian():
    """N(0, 1) in bf16, (4096, 2048): Quartet II's acceptance tensor."""
    return jax.random.normal(jax.random.key(0), (4096, 2048), jnp.float32).astype(jnp.bfloat16)


@pytest.fixture(scope="module")
def errors(gaussian):
    """Relative MSE of each quantizer on the tensor (1x16 blocks along the last axis)."""
    x = gaussian
    words = reference.rotation_words(ROTATION)
    fq = jax.jit(nvfp4_jax.fake_quantize, static_argnames=tuple(REF) + (
        "stochastic_rounding", "four_over_six", "ms_eden"))  # fmt: skip
    return {
        "rtn": relative_mse(fq(x, **REF), x),
        "four_over_six": relative_mse(fq(x, four_over_six="mse", **REF), x),
        "sr": relative_mse(fq(x, stochastic_rounding=True, key=KEY, **REF), x),
        "ms_eden": relative_mse(
            fq(x, ms_eden=True, key=KEY, rotation_key=ROTATION, **REF),
            reference.apply_rotation(x, words),
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "scheme,bits",
    # Quartet II's acceptance figures (kernels/test/test_rounding.py::test_cvt_nvfp4):
    # relative MSE below 2^-6.76 = 0.0092 (round to nearest), 2^-7.04 = 0.0076 (4/6) and
    # 2^-6.64 = 0.0100 (MS-EDEN). Where they come from: round to nearest errs by a uniform
    # fraction of the E2M1 step, `step^2 / 12` per value, which for a Gaussian block
    # scaled to its amax is 0.0090 of the energy (docs/NUMERICS.md section 10); 4/6 keeps
    # the better of two candidate scales per block, 0.0076 (section 13's table); MS-EDEN
    # rounds the rotated values (still N(0, 1): a rotation of i.i.d. Gaussians) to nearest
    # with scales aimed at 6.07 instead of 6, then adds the variance of the scale's
    # stochastic rounding, `p (1 - p) (step / s)^2` with `E[p (1 - p)] = 1/6` and an E4M3
    # relative step of 1/16 to 1/8: at most 0.0014, of which the correction takes back half.
    [("rtn", 3.38), ("four_over_six", 3.52), ("ms_eden", 3.32)],
)
def test_effective_bits_on_gaussian_data(errors, scheme, bits):
    measured = effective_bits(errors[scheme])
    assert measured > bits, f"{scheme}: {measured:.4f} bits (relative MSE {errors[scheme]:.5f})"


@pytest.mark.slow
def test_ms_eden_errs_about_half_as_much_as_stochastic_rounding(errors):
    # Stochastic rounding errs by `(y - lo)(hi - y)` per value, `step^2 / 6` on average for a
    # uniform position in the step: twice round to nearest's `step^2 / 12`, 0.0181 (measured
    # 0.0189: the saturated block maxima, section 7). MS-EDEN is round to nearest plus at
    # most 0.0014 (above), so their ratio is at most (0.0090 + 0.0014) / 0.0181 = 0.58.
    # Measured here: 0.0097 against 0.0189, a ratio of 0.515. (Quartet II's "2.4x lower
    # than SR" compares with its SR baseline, which maps the block amax to 6 * 16/17 and
    # so errs (17/16)^2 = 1.13 times more: 0.0213 here, and MS-EDEN is below half of that.)
    ratio = errors["ms_eden"] / errors["sr"]
    assert ratio < 0.58, f"MS-EDEN {errors['ms_eden']:.5f} vs SR {errors['sr']:.5f}: {ratio:.3f}"
    assert errors["ms_eden"] < 0.5 * errors["sr"] * (17 / 16) ** 2
    assert errors["rtn"] < errors["ms_eden"] < 1.1 * errors["rtn"]


# --- unbiasedness: the mean of many draws of a GEMM ---------------------------------------------

DRAWS = (16, 1024)


def mean_errors(product, exact, keys) -> list[float]:
    """`||mean of the first d products - exact|| / ||exact||` for d in DRAWS."""
    draws = jax.jit(jax.vmap(product))(keys)
    norm = jnp.linalg.norm(exact)
    return [float(jnp.linalg.norm(jnp.mean(draws[:d], axis=0) - exact) / norm) for d in DRAWS]


def gemm_operands(shape_a, shape_b, seed=0, *, no_saturation=False):
    """Two bf16 operands contracted over their last axes, and their exact product."""
    a = jax.random.normal(jax.random.key(seed), shape_a, jnp.float32)
    b = jax.random.normal(jax.random.key(seed + 1), shape_b, jnp.float32)
    if no_saturation:
        # Every 16-block holds the tensor amax: each scale is 448 exactly, no value above 6.
        a, b = (v.at[..., ::16].set(8.0) for v in (a, b))
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return a, b, a.astype(jnp.float32) @ b.astype(jnp.float32).T


def ms_eden_product(a, b):
    def product(key):
        rotation, key_a, key_b = jax.random.split(key, 3)
        opts = dict(ms_eden=True, rotation_key=rotation, **REF)
        qa = nvfp4_jax.fake_quantize(a, key=key_a, **opts)
        qb = nvfp4_jax.fake_quantize(b, key=key_b, **opts)
        return qa @ qb.T  # the rotations cancel

    return product


def sr_product(a, b):
    def product(key):
        key_a, key_b = jax.random.split(key)
        qa = nvfp4_jax.fake_quantize(a, stochastic_rounding=True, key=key_a, **REF)
        qb = nvfp4_jax.fake_quantize(b, stochastic_rounding=True, key=key_b, **REF)
        return qa @ qb.T

    return product


def rotated_rtn_product(a, b):
    # The rotation alone, then round to nearest: random, but biased.
    def product(key):
        words = reference.rotation_words(key)
        qa = nvfp4_jax.fake_quantize(reference.apply_rotation(a, words), **REF)
        qb = nvfp4_jax.fake_quantize(reference.apply_rotation(b, words), **REF)
        return qa @ qb.T

    return product


# An unbiased estimator's mean over d draws errs by sigma / sqrt(d): 1024 draws, 64 times
# 16, err 8 times less. A biased one's error tends to its bias b instead,
# sqrt(sigma^2 / d + b^2): measured here, rotated round to nearest and saturating SR fall
# from about 0.035 to 0.010-0.017 (ratios 2-3.5), MS-EDEN from 0.035 to 0.0045 (ratio 7.7).
# The bounds leave room for the draws' own noise: above 5.5 is unbiased, below 4.5 not.
UNBIASED_RATIO, BIASED_RATIO = 5.5, 4.5
KEYS = jax.random.split(jax.random.key(5), DRAWS[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "gemm,shapes",
    # dgrad dx = dy W^T contracts over N; wgrad dW = x^T dy over the tokens M.
    [("dgrad", ((64, 256), (128, 256))), ("wgrad", ((128, 384), (64, 384)))],
)
def test_ms_eden_products_are_unbiased_and_rounding_to_nearest_is_not(gemm, shapes):
    a, b, exact = gemm_operands(*shapes, seed=len(gemm))
    eden = mean_errors(ms_eden_product(a, b), exact, KEYS)
    rtn = mean_errors(rotated_rtn_product(a, b), exact, KEYS)
    assert eden[0] / eden[1] > UNBIASED_RATIO, f"{gemm} MS-EDEN: {eden}"
    assert rtn[0] / rtn[1] < BIASED_RATIO, f"{gemm} rotated round to nearest: {rtn}"
    assert eden[1] < 0.5 * rtn[1]


@pytest.mark.slow
def test_stochastic_rounding_is_unbiased_where_no_block_saturates():
    # Section 7's rounding is unbiased to within 1/256 of a step, except for a block maximum
    # above 6 (the E4M3 scale rounded down), which saturates: on data where every scale is
    # exact its products converge like MS-EDEN's; on plain Gaussian data they stop at the
    # saturation's bias, about 1% of the product, which MS-EDEN's mean goes below.
    a, b, exact = gemm_operands((64, 256), (128, 256), seed=7, no_saturation=True)
    sr = mean_errors(sr_product(a, b), exact, KEYS)
    assert sr[0] / sr[1] > UNBIASED_RATIO, f"SR without saturation: {sr}"
    a, b, exact = gemm_operands((64, 256), (128, 256), seed=7)
    sr = mean_errors(sr_product(a, b), exact, KEYS)
    eden = mean_errors(ms_eden_product(a, b), exact, KEYS)
    assert sr[0] / sr[1] < BIASED_RATIO, f"SR with saturating blocks: {sr}"
    assert eden[1] < 0.5 * sr[1], f"MS-EDEN {eden} vs SR {sr}"
