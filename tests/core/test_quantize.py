"""Every implementation against independent facts: the NumPy oracle, ml_dtypes, first principles.

Each test that quantizes runs on every implementation (the `impl` fixture: the pure-jnp
reference, the C++ kernels, the CUDA kernels where a GPU is present). Every expected value
comes from `numerics_oracle` (written from docs/NUMERICS.md) or from a scalar fact derived by
hand; nothing is copied from an implementation's output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numerics_oracle as oracle
import numpy as np
import pytest
from helpers import (
    assert_same_bits,
    assert_same_q,
    heavy_tailed,
    np_dtype,
    with_underflow_block,
)

import nvfp4_jax

F32 = np.float32


def assert_matches_oracle(q, o: oracle.OracleResult, what=""):
    assert_same_q(q, o, what)


# ----------------------------------------------------------------------------- scalar facts


def test_e2m1_magnitudes_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    # Every grid value round-trips through ml_dtypes' E2M1 unchanged.
    np.testing.assert_array_equal(grid.astype(ml_dtypes.float4_e2m1fn).astype(np.float32), grid)
    np.testing.assert_array_equal(oracle.e2m1_value(codes[:8]), grid)
    np.testing.assert_array_equal(oracle.e2m1_value(codes[8:]), -grid)


def test_e2m1_edge_rounding_matches_ml_dtypes_rne():
    rng = np.random.default_rng(0)
    edges = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    near = np.concatenate(
        [edges, np.nextafter(edges, 0), np.nextafter(edges, 10), edges * 0, [6.0, 5.5, 0.1]]
    )
    y = np.concatenate([near, rng.uniform(0, 6, 20000).astype(np.float32)]).astype(np.float32)
    y = np.concatenate([y, -y])
    want = y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = oracle.e2m1_value(oracle.e2m1_code_rn(y))
    np.testing.assert_array_equal(got, want)
    # Ties to even, from first principles.
    np.testing.assert_array_equal(
        oracle.e2m1_value(oracle.e2m1_code_rn(edges)), [0, 1, 1, 2, 2, 4, 4]
    )


def test_e4m3_rounding_by_hand_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    e4m3_all = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.unique(np.abs(e4m3_all[np.isfinite(e4m3_all)]))
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    v = np.concatenate(
        [finite, mids, np.nextafter(mids, 0), np.nextafter(mids, 1000), rng.uniform(0, 448, 5000)]
    ).astype(np.float32)
    v = v[v <= 448]
    want = v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(oracle.e4m3_rne_by_hand(v), want)


def test_reference_scales_round_like_ml_dtypes_e4m3(impl):
    # Tensor amax 448 gives S_enc = 2688 / 448 = 6 exactly, and 6 * RCP6 rounds to 1 in f32,
    # so a_b * (S_enc * RCP6) = a_b exactly: blocks whose amax is an exact E4M3 midpoint (or
    # one f32 ulp off it) test the scale's round-half-to-even.
    assert oracle.F32(6) * oracle.RCP6 == 1
    e4m3_all = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.unique(np.abs(e4m3_all[np.isfinite(e4m3_all)]))
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    targets = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1000), finite[1:]])
    x = np.zeros((len(targets) + 1, 16), np.float32)
    x[:-1, 3] = targets
    x[:-1, 5] = -targets / 2
    x[-1, 0] = 448
    q = impl.quantize(x)
    want = targets.astype(ml_dtypes.float8_e4m3fn)
    assert_same_bits(np.asarray(q.scales)[:-1, 0], want, "scales")
    np.testing.assert_array_equal(want.astype(np.float32), oracle.e4m3_rne_by_hand(targets))
    # Ties really go to even: the midpoint between 1 and 1.125 rounds to 1, 1.125..1.25 to 1.25.
    tie = np.float32([1.0625, 1.1875]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(tie, [1.0, 1.25])
    assert_matches_oracle(q, oracle.quantize(x))


def test_rcp6_bits():
    assert np.float32(1 / 6).view(np.uint32) == 0x3E2AAAAB
    assert oracle.RCP6.view(np.uint32) == 0x3E2AAAAB
    assert float(nvfp4_jax.FP4_MAX) == 6 and float(nvfp4_jax.E4M3_MAX) == 448


def test_nibble_packing_order(impl):
    # y values chosen so element 2i -> code 2i mod 8 etc.; scale 1 (tensor amax 2688 -> S_enc 1).
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    row = np.concatenate([grid, -grid[::-1]])  # codes 0..7, then 0xF..0x8
    row[15] = -0.25  # a small negative value rounds to -0: code 0x8
    x = np.stack([row, np.full(16, 6.0, np.float32), np.full(16, 2688.0, np.float32)])
    x[1, 0] = 0.5
    q = impl.quantize(x)
    codes = np.concatenate([np.arange(8), 8 + np.arange(8)[::-1]]).astype(np.uint8)
    want_row0 = codes[0::2] | (codes[1::2] << 4)
    np.testing.assert_array_equal(np.asarray(q.codes)[0], want_row0)
    # Row 1: element 0 is 0.5 (code 1, low nibble of byte 0), element 1 is 6 (code 7, high).
    assert np.asarray(q.codes)[1, 0] == 0x71


# ----------------------------------------------------------------------------- vs oracle

CASES = []


def _case(dtype, shape, axis=-1, block_2d=False, rht=False):
    name = f"{dtype}_{'2d' if block_2d else '1d'}{'_rht' if rht else ''}_ax{axis}_"
    name += "x".join(str(s) for s in shape)
    CASES.append(pytest.param(dtype, shape, axis, block_2d, rht, id=name))


# Every dtype with and without the RHT on the plain layout; each other layout in two
# (dtype, rht) combinations, rotating, to keep the matrix (and the runtime) small.
for _dt in ("f32", "bf16", "f16"):
    for _rht in (False, True):
        _case(_dt, (64, 256), -1, False, _rht)
_LAYOUTS = [
    ((256,), -1, False),
    ((256, 40), 0, False),
    ((96, 128), -1, True),
    ((128, 48), 0, True),
    ((3, 24, 64), -1, False),
    ((2, 64, 24), 1, False),
    ((64, 3, 16), 0, False),
    ((2, 32, 64), -1, True),
]
_COMBOS = [(d, r) for r in (False, True) for d in ("f32", "bf16", "f16")]
for _i, (_shape, _axis, _2d) in enumerate(_LAYOUTS):
    for _j in (0, 3):
        _dt, _rht = _COMBOS[(_i + _j + (_i % 2) * 2) % 6]
        _case(_dt, _shape, _axis, _2d, _rht)


def _dequant_check(impl, q, o, x_shape, axis, rht):
    got = np.asarray(impl.dequantize(q))
    assert got.shape == tuple(x_shape)
    want = oracle.dequantize(o, axis=axis, rht=rht)
    if not rht:
        assert_same_bits(got, want, "dequantized f32")
        got_bf16 = np.asarray(impl.dequantize(q, jnp.bfloat16))
        assert_same_bits(got_bf16, want.astype(ml_dtypes.bfloat16), "dequantized bf16")
        got_f16 = np.asarray(q.dequantize(jnp.float16, implementation=impl.implementation))
        assert_same_bits(got_f16, want.astype(np.float16), "dequantized f16 (method)")
    else:
        # The inverse RHT's rounding order is not part of the contract: allow f32 rounding.
        tol = 1e-6 * float(np.max(np.abs(want))) + 0.0
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype,shape,axis,block_2d,rht", CASES)
def test_matches_oracle_heavy_tailed(impl, dtype, shape, axis, block_2d, rht):
    x = heavy_tailed(shape, dtype, seed=len(shape) * 7 + shape[0], row_axis=axis)
    q = impl.quantize(x, axis=axis, block_2d=block_2d, rht=rht)
    o = oracle.quantize(x, axis=axis, block_2d=block_2d, rht=rht)
    assert q.shape == tuple(shape)
    assert_matches_oracle(q, o)
    _dequant_check(impl, q, o, shape, axis, rht)


def test_2d_tiles_have_distinct_maxima(impl):
    # Sanity of the 2D case data: 16x16 tiles differ, and one scale repeats over 16 rows.
    x = heavy_tailed((96, 128), "f32", seed=5)
    q = impl.quantize(x, block_2d=True)
    s = np.asarray(q.scales).astype(np.float32)
    assert s.shape == (96, 8)
    np.testing.assert_array_equal(s, np.repeat(s[::16], 16, axis=0))
    assert len(np.unique(s)) > 20
    assert_matches_oracle(q, oracle.quantize(x, block_2d=True))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_2d_transpose_gives_same_codes(impl, dtype):
    x = heavy_tailed((64, 96), dtype, seed=11)
    q = impl.quantize(x, block_2d=True)
    qt = impl.quantize(x, axis=0, block_2d=True)
    vals = oracle.e2m1_value(oracle.unpack_nibbles(np.asarray(q.codes)))
    vals_t = oracle.e2m1_value(oracle.unpack_nibbles(np.asarray(qt.codes)))
    np.testing.assert_array_equal(vals, vals_t.T)
    np.testing.assert_array_equal(np.asarray(impl.dequantize(q)), np.asarray(impl.dequantize(qt)))


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_underflowing_block(impl, dtype):
    x = heavy_tailed((32, 64), dtype, seed=3, outliers=False)
    x[5] *= 0  # make room: row 5 gets one tiny block, rest zero
    x = with_underflow_block(x, row=5, block=2, scale=1e-7)  # f16 data has amax 3e4: normal
    q = impl.quantize(x)
    o = oracle.quantize(x)
    assert_matches_oracle(q, o)
    scales = np.asarray(q.scales).astype(np.float32)
    codes = oracle.unpack_nibbles(np.asarray(q.codes))
    assert scales[5, 2] == 0, "the tiny block's scale must underflow to 0"
    assert np.all(codes[5, 32:48] & 7), "codes of an underflowed block are nonzero (enc=FLT_MAX)"
    deq = np.asarray(impl.dequantize(q))
    np.testing.assert_array_equal(deq[5, 32:48], 0)
    assert_same_bits(deq, oracle.dequantize(o), "dequantized")


# (k, m): tensor amax 2688 * 2^k makes S_enc = 2^-k; block amax 6 * 2^(m+k) makes s_b = 2^m,
# so enc_b = 2^-(m+k) and y = x * enc_b is exact: x = edge * 2^(m+k) lands y on the edge.
TIE_SCALES = {"f32": [(0, 0), (-8, -2), (5, 6), (20, -5)], "bf16": [(0, 0), (-8, -2), (5, 6)]}
TIE_SCALES["f16"] = [(0, 0), (-6, -2), (3, 4)]
TIE_CASES = [
    pytest.param(dt, k, m, id=f"{dt}_k{k}_m{m}") for dt, km in TIE_SCALES.items() for k, m in km
]


@pytest.mark.parametrize("dtype,k,m", TIE_CASES)
def test_exact_ties_at_every_edge(impl, dtype, k, m):
    edges = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float64)
    block = np.concatenate([edges, -edges, [6.0, -6.0]])  # 16 values, amax 6
    x = np.zeros((3, 16), np.float64)
    x[0] = block * 2.0 ** (m + k)
    x[1] = block[::-1] * 2.0 ** (m + k)
    x[2, 7] = 2688 * 2.0**k
    x = x.astype(np_dtype(dtype))
    np.testing.assert_array_equal(x.astype(np.float64), np.asarray(x, np.float64))
    q = impl.quantize(x)
    o = oracle.quantize(x)
    assert_matches_oracle(q, o)
    # First principles: y equals the edge exactly and rounds half to even.
    np.testing.assert_array_equal(o.y[0], block.astype(np.float32))
    tie_even = np.array([0, 1, 1, 2, 2, 4, 4], np.float32)
    want_vals = np.concatenate([tie_even, -tie_even, [6, -6]]).astype(np.float32)
    got_vals = oracle.e2m1_value(oracle.unpack_nibbles(np.asarray(q.codes)))
    np.testing.assert_array_equal(got_vals[0], want_vals)
    np.testing.assert_array_equal(got_vals[1], want_vals[::-1])
    # ml_dtypes agrees on the same y.
    np.testing.assert_array_equal(
        got_vals[0], block.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    )
    assert np.asarray(q.scales).astype(np.float32)[0, 0] == 2.0**m
    # The tie at 0.25 gives +0 and -0 codes: the sign is kept (0x8 for -0.25).
    assert oracle.unpack_nibbles(np.asarray(q.codes))[0, 7] == 0x8


def _ulp_steps(v: np.float32, k: int) -> np.float32:
    for _ in range(abs(k)):
        v = np.nextafter(v, F32(np.inf) if k > 0 else F32(0))
    return v


def _scale_alternatives(a, s_enc):
    """E4M3 scale of block amax `a` in the specified order and two wrong orders."""
    spec = F32(a * F32(s_enc * oracle.RCP6))
    wrong_order = F32(F32(a * s_enc) * oracle.RCP6)
    true_div = F32(F32(a * s_enc) / F32(6))
    return [
        oracle.e4m3_rne(np.minimum(v, F32(448))).astype(np.float32)
        for v in (spec, wrong_order, true_div)
    ]


def _near_edge_elements(a, s_enc, s_dec, n=15):
    """x values of a block with amax `a` whose y = x * enc_b sits on or 1-2 ulp off an edge."""
    sb = _scale_alternatives(a, s_enc)[0]
    enc = np.minimum(F32(1) / (sb * s_dec), oracle.FLT_MAX)
    enc_alt = F32(s_enc / sb)  # a plausible wrong formula for enc_b
    picks, others = [], []
    for edge in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        x0 = F32(F32(edge) / enc)
        for k in (-2, -1, 0, 1, 2):
            x = _ulp_steps(x0, k)
            if abs(x) > a:
                continue
            differs = oracle.e2m1_code_rn(x * enc) != oracle.e2m1_code_rn(x * enc_alt)
            (picks if differs or F32(x * enc) == F32(edge) else others).append(x)
    vals = (picks + others)[:n]
    return [v if i % 2 else -v for i, v in enumerate(vals)]


def adversarial_tensor(a_tensor=1234.567):
    """Blocks whose E4M3 scale and E2M1 codes depend on the exact order of f32 operations.

    Row 0 holds the tensor amax; every other row is one block whose scaled amax is within a
    few ulps of an E4M3 midpoint where the specified order rounds differently from
    `(a * S_enc) * RCP6` or `(a * S_enc) / 6`; its other elements sit on E2M1 edges.
    """
    a_tensor = F32(a_tensor)
    s_enc, s_dec = oracle.global_scales(a_tensor)
    e4m3_all = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.unique(np.abs(e4m3_all[np.isfinite(e4m3_all)]))
    mids = (finite[1:].astype(np.float64) + finite[:-1]) / 2
    rows = [np.r_[a_tensor, np.zeros(15, np.float32)]]
    for m in mids[(mids > 2.0**-8) & (mids < 440)]:
        for k in range(-3, 4):
            a = _ulp_steps(F32(m / F32(s_enc * oracle.RCP6)), k)
            spec, *wrong = _scale_alternatives(a, s_enc)
            if any(w != spec for w in wrong):
                elems = _near_edge_elements(a, s_enc, s_dec)
                rows.append(np.r_[a, elems, np.zeros(15 - len(elems))].astype(np.float32))
    return np.stack(rows).astype(np.float32)


def test_operation_order_matters_and_is_followed(impl):
    x = adversarial_tensor()
    assert x.shape[0] > 50
    q = impl.quantize(x)
    o = oracle.quantize(x)
    assert_matches_oracle(q, o)
    assert_same_bits(np.asarray(impl.dequantize(q)), oracle.dequantize(o), "dequantized")
    # The data has teeth: a reordered scale formula would change scales here.
    s_enc, _ = oracle.global_scales(F32(np.max(np.abs(x))))
    wrong = np.array([_scale_alternatives(a, s_enc)[1] for a in x[1:, 0]])
    assert np.sum(wrong != o.scales[1:, 0].astype(np.float32)) > 20
    # ... and so would enc_b = S_enc / s_b instead of 1 / (s_b * S_dec), in the codes.
    sb = o.scales.astype(np.float32)
    with np.errstate(divide="ignore"):
        enc_alt = np.minimum(s_enc / sb, oracle.FLT_MAX)
    codes_alt = oracle.e2m1_code_rn(x * np.repeat(enc_alt, 16, axis=1))
    assert np.sum(codes_alt != o.codes) > 100
    # ... and y lands exactly on E2M1 edges in many places (ties exercised).
    edges = np.isin(np.abs(o.y), np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))
    assert edges.sum() > 100


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_all_zero_tensor(impl, dtype):
    x = np.zeros((32, 64), np_dtype(dtype))
    q = impl.quantize(x)
    o = oracle.quantize(x)
    assert o.s_enc == 1
    assert_matches_oracle(q, o)
    assert float(q.amax) == 0
    assert not np.asarray(q.codes).any()
    assert not np.asarray(q.scales).astype(np.float32).any()
    deq = np.asarray(impl.dequantize(q))
    assert np.all(deq == 0) and not np.isnan(deq).any()


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("ratio", [0.25, 1.0, 4.0], ids=["amax_quarter", "amax_equal", "amax_4x"])
def test_caller_amax(impl, dtype, ratio):
    x = heavy_tailed((48, 128), dtype, seed=21, outliers=False)
    true_amax = float(np.max(np.abs(x.astype(np.float32))))
    amax = np.float32(true_amax * ratio)
    q = impl.quantize(x, amax=jnp.float32(amax))
    o = oracle.quantize(x, amax=amax)
    assert_matches_oracle(q, o)
    assert float(q.amax) == float(amax)
    assert_same_bits(np.asarray(impl.dequantize(q)), oracle.dequantize(o), "dequantized")
    codes = oracle.unpack_nibbles(np.asarray(q.codes))
    above = np.abs(x.astype(np.float32)) > amax * (1 + 1e-6)
    assert (ratio < 1) == above.any()
    # Values above the caller's amax saturate at +-6 with their own sign.
    np.testing.assert_array_equal(codes[above] & 7, 7)
    np.testing.assert_array_equal(codes[above] >> 3, np.signbit(x.astype(np.float32)[above]))


def test_caller_amax_zero(impl):
    # A == 0 gives S_enc = 1 (docs/NUMERICS.md section 2) and D = 0: the data still gets codes,
    # all decode to 0.
    x = heavy_tailed((16, 64), "f32", seed=22, outliers=False)
    q = impl.quantize(x, amax=jnp.float32(0))
    o = oracle.quantize(x, amax=0.0)
    assert o.s_enc == 1
    assert_matches_oracle(q, o)
    deq = np.asarray(impl.dequantize(q))
    assert np.all(deq == 0) and not np.isnan(deq).any()


@pytest.mark.parametrize("magnitude", [1e30, 1e-25, 3e38], ids=["1e30", "1e-25", "near_flt_max"])
def test_extreme_magnitudes_f32(impl, magnitude):
    x = heavy_tailed((32, 64), "f32", seed=23, outliers=False)
    x = (x / np.max(np.abs(x)) * magnitude).astype(np.float32)
    assert np.all(np.isfinite(x))
    q = impl.quantize(x)
    o = oracle.quantize(x)
    assert_matches_oracle(q, o)
    assert_same_bits(np.asarray(impl.dequantize(q)), oracle.dequantize(o), "dequantized")


def test_saturation_in_dequantized_values(impl):
    x = heavy_tailed((16, 64), "f32", seed=2, outliers=False)
    amax = np.float32(np.max(np.abs(x)) / 8)
    deq = np.asarray(impl.dequantize(impl.quantize(x, amax=jnp.float32(amax))))
    # The largest representable magnitude is 6 * 448 * amax / 2688 = amax (up to f32 rounding).
    assert np.max(np.abs(deq)) <= amax * (1 + 2**-20)
    assert np.max(np.abs(deq)) >= amax * (1 - 2**-20)


def test_sr_with_fixed_key_matches_oracle(impl):
    x = heavy_tailed((32, 256), "bf16", seed=8)
    key = jax.random.key(42)
    q = impl.quantize(x, stochastic_rounding=True, key=key)
    k0, k1 = oracle.sr_key_words(key)
    o = oracle.quantize(x, sr_bytes=oracle.sr_random_bytes(k0, k1, x.size))
    assert_matches_oracle(q, o)
    assert_same_bits(np.asarray(impl.dequantize(q)), oracle.dequantize(o), "dequantized")


# ----------------------------------------------------------------------------- error bounds


def _half_spacing(abs_y: np.ndarray) -> np.ndarray:
    """Half the E2M1 grid spacing of the interval holding |y| (|y| <= 6)."""
    return np.where(abs_y < 2, 0.25, np.where(abs_y < 4, 0.5, 1.0)).astype(np.float64)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
def test_round_to_nearest_error_bound(impl, dtype, block_2d):
    x = heavy_tailed((128, 256), dtype, seed=17)
    q = impl.quantize(x, block_2d=block_2d)
    o = oracle.quantize(x, block_2d=block_2d)
    xf = x.astype(np.float64)
    deq = np.asarray(impl.dequantize(q)).astype(np.float64)
    err = np.abs(deq - xf)
    abs_y = np.abs(o.y.astype(np.float64))
    dec = o.dec.astype(np.float64)  # s_b * D per element
    saturated = abs_y > 6
    # Unsaturated: half a grid step in y-units, times the decode factor, plus f32 slack.
    bound = _half_spacing(abs_y) * dec * (1 + 2**-18) + np.abs(xf) * 2**-20
    assert np.all(err[~saturated] <= bound[~saturated])
    # Saturated: dequantizes to exactly +-6 * s_b * D; the error is the excess above it.
    np.testing.assert_array_equal(np.abs(deq[saturated]), (6 * o.dec[saturated]).astype(np.float32))
    sat_err = np.abs(xf[saturated]) - 6 * dec[saturated]
    assert np.all(np.abs(err[saturated] - sat_err) <= np.abs(xf[saturated]) * 2**-20)
    # With a normal E4M3 scale, rounding down loses at most 2^-4: y <= 6 * (1 + 2^-4).
    normal = o.dec[saturated] >= 2.0**-6 * float(F32(q.amax) * oracle.RCP2688)
    assert np.all(sat_err[normal] <= 0.375 * dec[saturated][normal] * (1 + 2**-18))


def _rounded_down_block(v_over_s_b: float, s_b: float):
    """Tensor amax 2688 (S_enc = 1); block 1 has amax 6 * v with v = a_b * RCP6 = s_b * ratio."""
    x = np.zeros((2, 16), np.float32)
    x[0, 0] = 2688
    x[1] = np.linspace(-6 * s_b * v_over_s_b, 6 * s_b * v_over_s_b, 16).astype(np.float32)
    return x


@pytest.mark.parametrize(
    "ratio,s_b",
    [(9.4 / 9, 9.0), (1.45, 2.0**-9)],
    ids=["normal_scale_9p4_to_9", "subnormal_scale_1p45_to_1"],
)
def test_error_bound_where_scale_rounds_down_and_saturates(impl, ratio, s_b):
    # 9.4 rounds down to the E4M3 value 9 (spacing 1 in [8, 16)): y_max = 6 * 9.4 / 9 = 6.27.
    # 1.45 * 2^-9 rounds down to the smallest subnormal 2^-9: y_max = 6 * 1.45 = 8.7, where the
    # saturation error (2.7 steps of y) exceeds round-to-nearest's half spacing (1 at 6).
    x = _rounded_down_block(ratio, s_b)
    q = impl.quantize(x)
    o = oracle.quantize(x)
    assert_matches_oracle(q, o)
    assert float(np.asarray(q.scales).astype(np.float32)[1, 0]) == s_b
    assert np.all(np.abs(o.y[1, [0, 15]]) > 6)
    deq = np.asarray(impl.dequantize(q))
    dec = F32(F32(s_b) * F32(F32(2688) * oracle.RCP2688))  # s_b * D, in f32 as specified
    ends = [0, 15]
    np.testing.assert_array_equal(np.abs(deq[1, ends]), F32(6) * dec)
    err = np.abs(deq[1].astype(np.float64) - x[1])
    sat_err = np.abs(x[1, ends].astype(np.float64)) - 6 * np.float64(dec)
    np.testing.assert_allclose(err[ends], sat_err, rtol=1e-6)
    if ratio > 1.375:
        assert np.all(err[ends] > 1.0 * dec), "saturation error should exceed the RN bound"
    # Unsaturated elements of the same block keep the RN bound.
    y = np.abs(o.y[1]).astype(np.float64)
    inner = y <= 6
    bound = _half_spacing(y) * dec * (1 + 2**-18) + np.abs(x[1]) * 2**-20
    assert inner.sum() >= 10 and np.all(err[inner] <= bound[inner])


# ----------------------------------------------------------------------------- relative MSE


def _rel_mse(x, deq):
    return float(np.sum((deq.astype(np.float64) - x) ** 2) / np.sum(x.astype(np.float64) ** 2))


@pytest.mark.parametrize(
    "scheme,expected",
    [("1x16_rn", 0.0090), ("16x16", 0.0124), ("1x16_sr", 0.0188)],
    ids=["1x16_rn", "16x16", "1x16_sr"],
)
def test_relative_mse_table(impl, scheme, expected):
    x = np.random.default_rng(99).standard_normal((1024, 2048)).astype(np.float32)
    kw = {"16x16": dict(block_2d=True), "1x16_sr": dict(stochastic_rounding=True)}.get(scheme, {})
    if scheme == "1x16_sr":
        kw["key"] = jax.random.key(7)
    deq = np.asarray(impl.dequantize(impl.quantize(x, **kw)))
    mse = _rel_mse(x, deq)
    assert abs(mse - expected) <= 0.03 * expected, f"{scheme}: relative MSE {mse:.5f}"


# ----------------------------------------------------------------------------- NaN / inf


@pytest.mark.slow
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "neginf"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_nonfinite_input_gives_nan(impl, bad, dtype, rht):
    # Section 8: NaN amax, every scale byte 0x7F, every code 0; dequantizes to NaN.
    x = heavy_tailed((32, 64), dtype, seed=4)
    x[7, 9] = bad
    q = impl.quantize(x, rht=rht)
    assert_matches_oracle(q, oracle.quantize(x, rht=rht))
    assert np.all(np.asarray(q.scales).view(np.uint8) == 0x7F) and not np.asarray(q.codes).any()
    assert np.all(np.isnan(np.asarray(impl.dequantize(q))))
    assert np.all(np.isnan(np.asarray(impl.dequantize(q, jnp.bfloat16), np.float32)))
    assert np.all(np.isnan(np.asarray(impl.fake_quantize(x, rht=rht), np.float32)))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "shape,kw,exc,pattern",
    [
        ((8, 40), dict(), ValueError, r"axis.*\(8, 40\)|\(8, 40\).*axis"),
        ((40, 32), dict(axis=0), ValueError, r"axis.*\(40, 32\)|\(40, 32\).*axis"),
        ((24, 32), dict(block_2d=True), ValueError, r"block_2d.*\(24, 32\)"),
        ((32, 24), dict(axis=1, block_2d=True), ValueError, r"axis.*\(32, 24\)"),
        ((32, 32), dict(stochastic_rounding=True), ValueError, r"key"),
        ((32, 32), dict(axis=2), ValueError, r"axis.*2.*\(32, 32\)"),
        ((32, 32), dict(axis=-3), ValueError, r"axis.*-3.*\(32, 32\)"),
        ((256,), dict(block_2d=True), ValueError, r"block_2d.*\(256,\)"),
    ],
    ids=[
        "k40",
        "axis0_m40",
        "2d_rows24",
        "2d_axis1_k24",
        "sr_no_key",
        "axis2",
        "axis_neg3",
        "2d_1d_input",
    ],
)
def test_bad_arguments_raise(impl, shape, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        impl.quantize(np.ones(shape, np.float32), **kw)


def test_2d_rows_not_multiple_of_16_raise_even_when_cols_ok(impl):
    # block_2d with axis=0: stored rows are x.shape[1].
    with pytest.raises(ValueError, match=r"\(32, 24\)"):
        impl.quantize(np.ones((32, 24), np.float32), axis=0, block_2d=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jnp.ones((16, 32), jnp.int32),
        lambda: np.ones((16, 32), np.int32),
        lambda: np.ones((16, 32), np.float64),
        lambda: jnp.ones((16, 32), jnp.float8_e4m3fn),
    ],
    ids=["jnp_int32", "np_int32", "np_float64", "jnp_e4m3"],
)
def test_unsupported_dtype_raises(impl, make):
    x = make()
    name = np.dtype(x.dtype).name
    with pytest.raises(TypeError, match=name):
        nvfp4_jax.quantize(x, implementation=impl.implementation)
