"""Property-based tests (Hypothesis): every implementation writes the same bits, and every
implementation rejects a bad argument with the same error.

Each property runs the public ops under `jax.jit` on the pure-jnp reference
(`implementation="reference"`) and on the native kernels (`"ffi"` on the CPU; the CUDA kernels
too where a GPU is present) and compares them with each other and with the independent NumPy
oracle `tests/numerics_oracle.py` (docs/NUMERICS.md):

* `test_quantize_agrees`: codes, scale bytes and amax of `quantize` (1x16 and 16x16 blocks,
  RHT, stochastic rounding with drawn keys and `SRSeed` offsets, caller amax: none, 0, -0,
  below the true amax so values saturate, above it, and traced invalid values, which give the
  NaN tensor of section 8), then `dequantize` of the result to a drawn dtype. Cases outside
  the bit-exact contract (section 8: f32 subnormal input, or a tensor amax below 2^-100) are
  checked against the round-to-nearest / stochastic-rounding error bound instead.
* `test_fake_quantize_agrees`: `fake_quantize` with and without `global_scale`, every output
  dtype.
* `test_dequantize_agrees`: `dequantize` of arbitrary codes, scale bytes and amax, to every
  dtype, with and without the inverse RHT.
* `test_tensor_amax_agrees` and `test_apply_rht_agrees` (forward and inverse).

The data hit special values on purpose: NaN, +-inf, +-0, f32 subnormals, values near the
dtype's maximum, tiny values, whole blocks of zeros, blocks far below the tensor amax (their
scale underflows), exact E2M1 ties (tensor amax 2688 * 2^k and block amax 6 * 2^(m+k) make
y = x * 2^-(m+k) exact) and mixtures. Shapes come from a small fixed set (`LAYOUTS`) and the
static flags from their small sets, because JAX compiles once per (shape, dtype, flags); the
randomness lives in the values, the positions of the special values, the keys and the amax.
The jitted functions are cached (`helpers.Impl.run`).

The data, the cases and the profiles (`ci`, the default: the same 260 examples on every run,
about 60 s on 2 cores, most of it compiling; `long`: thousands, random seeds) are in
`tests/strategies.py`, shared with `tests/core/test_bad_arguments.py` (the sixth property:
drawn invalid arguments rejected alike). A failure prints the falsifying example, the notes
of the case and a `@reproduce_failure` blob; with `long`, `--hypothesis-seed=S` replays a run.

Inputs docs/NUMERICS.md section 8 exempts from bit-exactness are checked differently: f32
subnormal inputs and tensor amaxes below 2^-100 against the error bound; inputs whose RHT
passes through f32 subnormals (tiny but normal values, below about 2^-122, which XLA on CPU
flushes) are left out of the bit-exact RHT properties (`exempt_rht_subnormals`): these
properties found the case, and section 8 now names it.
"""

from __future__ import annotations

import ml_dtypes
import numerics_oracle as oracle
import numpy as np
import pytest
from helpers import assert_same_bits, assert_same_q
from hypothesis import assume, event, given
from hypothesis import strategies as st
from strategies import (
    DTYPES,
    EDGES,
    F32,
    F64,
    LAYOUTS,
    M64,
    Case,
    budget,
    exempt_rht_subnormals,
    has_f32_subnormal,
    outside_contract,
    quantize_cases,
    quantized,
    stored,
    tensors,
)

# --- checks --------------------------------------------------------------------------------


def _spacing(abs_y: np.ndarray) -> np.ndarray:
    """The E2M1 grid spacing of the interval that holds |y| (<= 6)."""
    return np.where(abs_y < 2, 0.5, np.where(abs_y < 4, 1.0, 2.0))


def assert_error_bound(case: Case, o: oracle.OracleResult, deq: np.ndarray, what: str):
    """Section 8's promise where bits may differ: the dequantized error bound still holds.

    Round to nearest: half a grid spacing of y, times the decode factor s_b * D; stochastic
    rounding: a whole spacing; saturated values: their excess over 6 * s_b * D. The slack is
    f32 rounding plus 2^-110 absolute for flushed subnormals (all values here are tiny).
    """
    xs = stored(case.x, case.axis).astype(F64)
    got = stored(np.asarray(deq, F32), case.axis).astype(F64)
    if np.isnan(o.amax):
        assert np.all(np.isnan(got)), f"{what}: a NaN tensor must dequantize to NaN"
        return
    abs_y, dec = np.abs(o.y.astype(F64)), o.dec.astype(F64)
    half = _spacing(np.minimum(abs_y, 6)) * (1.0 if case.sr else 0.5)
    bound = np.maximum(np.abs(xs) - 6 * dec, half * dec) * (1 + 2**-16)
    bound += np.abs(xs) * 2**-20 + 2.0**-110
    err = np.abs(got - xs)
    bad = ~(err <= bound)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} errors above the bound; first at {i}: x={xs[i]!r} "
            f"got={got[i]!r} bound={bound[i]!r}"
        )


def assert_rht_close(got, want64: np.ndarray, inputs: np.ndarray, dtype, what: str):
    """An inverse RHT against the f64 matrix product: its f32 rounding order is not specified.

    `inputs` are the f32 values the inverse was applied to (stored layout, blocks of 16);
    blocks whose butterflies may overflow f32 are not compared.
    """
    got = np.asarray(got).astype(F64)
    block_max = np.max(np.abs(inputs.reshape(-1, 16)), axis=-1, initial=0).astype(F64)
    block_max = np.repeat(block_max, 16).reshape(want64.shape)
    finfo = ml_dtypes.finfo(dtype)
    with np.errstate(all="ignore"):
        tol = 2.0**-19 * block_max + float(finfo.eps) * np.abs(want64)
        tol += float(finfo.smallest_subnormal)
        comparable = np.isfinite(block_max) & (16 * block_max < float(np.finfo(F32).max))
        comparable &= np.abs(want64) + tol < float(finfo.max)  # the cast cannot overflow
        close = (np.abs(got - want64) <= tol) | (np.isnan(got) & np.isnan(want64))
    bad = comparable & ~close
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} differ; first at {i}: {got[i]!r} vs {want64[i]!r}"
        )


def inverse_rht64(values: np.ndarray) -> np.ndarray:
    """`values @ M.T` in blocks of 16 along the last axis, in f64."""
    with np.errstate(all="ignore"):
        return (values.reshape(-1, 16).astype(F64) @ M64.T).reshape(values.shape)


def assert_agree(results: list, what: str):
    """Every implementation's array has the bits of the first one's."""
    for impl, r in results[1:]:
        assert_same_bits(r, results[0][1], f"{what}: {impl.name} vs {results[0][0].name}")


# --- properties: agreement -----------------------------------------------------------------


def _check_dequantize(impls, case, o, qs, name):
    dtype = DTYPES[name]
    deqs = [
        (impl, np.asarray(impl.dequantize(q, dtype))) for impl, q in zip(impls, qs, strict=True)
    ]
    assert_agree(deqs, f"dequantize to {name}")
    if not case.rht:
        with np.errstate(over="ignore"):  # a cast to f16 may overflow to inf, as it should
            want = oracle.dequantize(o, axis=case.axis, dtype=dtype)
        assert_same_bits(deqs[0][1], want, f"dequantize to {name} vs oracle")
        return
    got = stored(deqs[0][1], case.axis)
    want = inverse_rht64(o.dequant_stored)
    assert_rht_close(got, want, o.dequant_stored, dtype, f"dequantize (rht) to {name} vs oracle")


def kind_of(case: Case, o, outside: bool) -> str:
    """What kind of case this is, for `--hypothesis-show-statistics`."""
    if np.isnan(o.amax):
        return "NaN tensor (section 8)"
    if outside:
        return "outside the bit-exact contract: error bound"
    scales = np.asarray(o.scales).astype(F32)
    if np.any((scales == 0) & np.any((o.codes & 7).reshape(*scales.shape, 16), axis=-1)):
        return "bit-exact, with an underflowed block"
    if np.isin(np.abs(o.y), EDGES.astype(F32)).any() and not case.sr:
        return "bit-exact, with exact E2M1 ties"
    if np.any(np.abs(o.y) > 6):
        return "bit-exact, with saturated values"
    return "bit-exact"


@pytest.mark.slow
@budget("quantize")
@given(case=quantize_cases(), out=st.sampled_from(sorted(DTYPES)))
def test_quantize_agrees(impls, case, out):
    o = case.oracle()
    outside = outside_contract(case.x, o.amax)
    assume(not (outside and case.rht))  # the bound below is written in the unrotated basis
    if case.rht:
        exempt_rht_subnormals(stored(case.x, case.axis))
        exempt_rht_subnormals(o.dequant_stored, inverse=True)
    event(kind_of(case, o, outside))
    qs = [impl.quantize(case.x, key=case.key, amax=case.amax, **case.static()) for impl in impls]
    if outside:
        for impl, q in zip(impls, qs, strict=True):
            assert_error_bound(case, o, impl.dequantize(q), f"{impl.name} (outside the contract)")
        return
    for impl, q in zip(impls, qs, strict=True):
        assert_same_q(q, o, f"{impl.name} vs oracle:")
        assert_same_q(q, qs[0], f"{impl.name} vs {impls[0].name}:")
    _check_dequantize(impls, case, o, qs, out)


def _expected_fake(case: Case, o, global_scale: bool, dtype) -> np.ndarray:
    if global_scale:
        values = o.dequant_stored
    else:
        scales = np.repeat(o.scales.astype(F32), 16, axis=-1)
        with np.errstate(invalid="ignore"):
            values = (oracle.e2m1_value(o.codes) * scales).astype(F32)
    with np.errstate(over="ignore"):
        return np.moveaxis(values, -1, case.axis).astype(dtype)


@pytest.mark.slow
@budget("fake_quantize")
@given(
    case=quantize_cases(),
    global_scale=st.booleans(),
    out=st.sampled_from([None, *sorted(DTYPES)]),
)
def test_fake_quantize_agrees(impls, case, global_scale, out):
    dtype = case.x.dtype if out is None else DTYPES[out]
    o = case.oracle()
    assume(not outside_contract(case.x, o.amax))  # test_quantize_agrees checks the bound
    if case.rht:
        exempt_rht_subnormals(stored(case.x, case.axis))
    static = dict(case.static(), global_scale=global_scale, dtype=None if out is None else dtype)
    results = [
        (impl, np.asarray(impl.fake_quantize(case.x, key=case.key, amax=case.amax, **static)))
        for impl in impls
    ]
    assert_agree(results, "fake_quantize")
    want = _expected_fake(case, o, global_scale, dtype)
    assert_same_bits(results[0][1], want, "fake_quantize vs oracle")


@pytest.mark.slow
@budget("dequantize")
@given(args=quantized())
def test_dequantize_agrees(impls, args):
    q, name = args
    dtype = DTYPES[name]
    results = [(impl, np.asarray(impl.dequantize(q, dtype))) for impl in impls]
    assert_agree(results, f"dequantize to {name}")
    # Section 3, from the oracle's pieces: value(code) * (f32(s_b) * (A * RCP2688)).
    values = oracle.e2m1_value(oracle.unpack_nibbles(np.asarray(q.codes)))
    with np.errstate(all="ignore"):
        factor = np.asarray(q.scales).astype(F32) * F32(F32(q.amax) * oracle.RCP2688)
        values = (values * np.repeat(factor, 16, axis=-1)).astype(F32)
    if q.rht:
        exempt_rht_subnormals(values, inverse=True)
        got = stored(results[0][1], q.axis)
        assert_rht_close(got, inverse_rht64(values), values, dtype, "dequantize (rht) vs oracle")
    else:
        with np.errstate(over="ignore"):
            want = np.moveaxis(values, -1, q.axis).astype(dtype)
        assert_same_bits(results[0][1], want, "dequantize vs oracle")


@pytest.mark.slow
@budget("tensor_amax")
@given(
    layout=st.sampled_from(LAYOUTS),
    name=st.sampled_from(sorted(DTYPES)),
    rht=st.booleans(),
    data=st.data(),
)
def test_tensor_amax_agrees(impls, layout, name, rht, data):
    x = data.draw(tensors(layout, name), label="x")
    axis = layout[1]
    with np.errstate(all="ignore"):
        want = oracle.quantize(x, axis=axis, rht=rht).amax
    assume(not outside_contract(x, want))
    if rht:
        exempt_rht_subnormals(stored(x, axis))
    results = [(impl, np.asarray(impl.tensor_amax(x, axis=axis, rht=rht))) for impl in impls]
    assert_agree(results, "tensor_amax")
    assert_same_bits(results[0][1], np.asarray(want, F32), "tensor_amax vs oracle")


@budget("apply_rht")
@given(
    layout=st.sampled_from(LAYOUTS),
    name=st.sampled_from(sorted(DTYPES)),
    inverse=st.booleans(),
    data=st.data(),
)
def test_apply_rht_agrees(impls, layout, name, inverse, data):
    x = stored(data.draw(tensors(layout, name), label="x"), layout[1])  # transformed: last axis
    assume(not has_f32_subnormal(x))
    exempt_rht_subnormals(x, inverse)
    results = [(impl, np.asarray(impl.apply_rht(x, inverse=inverse))) for impl in impls]
    assert_agree(results, f"apply_rht(inverse={inverse})")
    with np.errstate(all="ignore"):
        if not inverse:  # section 5's fixed order: bit-exact
            assert_same_bits(results[0][1], oracle.fwht_rht(x), "apply_rht vs oracle")
        else:
            xf = x.astype(F32)
            assert_rht_close(results[0][1], inverse_rht64(xf), xf, x.dtype, "inverse vs oracle")
