"""Hypothesis strategies and profiles shared by the property tests (`tests/core/test_properties.py`,
`tests/core/test_bad_arguments.py`): the data (`tensors`: blocks of special values, exact
E2M1 ties, tiny and huge blocks; `quantize_cases`, `quantized`), the keys and caller amaxes,
and the profiles that set how many examples each property draws.

Profiles (`NVFP4_HYPOTHESIS_PROFILE`):

* `ci` (the default): `derandomize=True` (the same examples on every run), `deadline=None`,
  no example database; `EXAMPLES[test][0]` examples per test: 60 quantize (each also
  dequantizes), 40 fake_quantize, 40 dequantize, 60 tensor_amax, 60 apply_rht, 150 bad
  arguments (410 in all).
* `long`: random seeds, `EXAMPLES[test][1]` examples per test (thousands; the jitted
  functions are cached, so after the first few hundred examples most cost milliseconds):

      NVFP4_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest -q -p no:cacheprovider \\
          tests/core/test_properties.py tests/core/test_bad_arguments.py \\
          --hypothesis-show-statistics

`NVFP4_HYPOTHESIS_EXAMPLES=N` overrides the count of every test in either profile.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import ml_dtypes
import numerics_oracle as oracle
import numpy as np
from hypothesis import HealthCheck, assume, note, settings
from hypothesis import strategies as st

import nvfp4_jax
from nvfp4_jax._src.core.array import NVFP4Array

F32, F64 = np.float32, np.float64

# --- profiles ------------------------------------------------------------------------------

PROFILE = os.environ.get("NVFP4_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"NVFP4_HYPOTHESIS_PROFILE must be 'ci' or 'long', got {PROFILE!r}")
_COMMON = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("nvfp4-ci", derandomize=True, **_COMMON)
settings.register_profile("nvfp4-long", derandomize=False, **_COMMON)

# (ci, long) examples per test.
EXAMPLES = {
    "quantize": (60, 3000),
    "fake_quantize": (40, 2000),
    "dequantize": (40, 3000),
    "tensor_amax": (60, 3000),
    "apply_rht": (60, 3000),
    "bad_arguments": (150, 5000),
}


def budget(test: str) -> settings:
    """The settings of one property under the selected profile."""
    n = EXAMPLES[test][PROFILE == "long"]
    n = int(os.environ.get("NVFP4_HYPOTHESIS_EXAMPLES", n))
    return settings(settings.get_profile(f"nvfp4-{PROFILE}"), max_examples=n)


# --- constants and small helpers -----------------------------------------------------------

DTYPES = {"f32": np.dtype(F32), "bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16)}
# (logical shape, quantized axis): ranks 1-3, the axis first, last, in the middle, negative;
# 4096 elements (where XLA's CPU max starts dropping NaN); a quantized axis of length 0.
LAYOUTS = (
    ((32,), 0),
    ((16, 32), -1),
    ((32, 16), 0),
    ((4, 48), 1),
    ((2, 16, 48), -2),
    ((3, 16, 32), 2),
    ((64, 2, 32), 0),
    ((2, 0, 16), 1),
)
EDGES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # E2M1 ties (section 2, step 5)
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MIN_NORMAL_F32 = 2.0**-126
TINY_AMAX = 2.0**-100  # section 8: below it implementations may differ in a few codes
M64 = oracle.rht_matrix().astype(F64)


def stored(a: np.ndarray, axis: int) -> np.ndarray:
    """The stored layout: the quantized axis moved last."""
    return np.moveaxis(a, axis, -1)


def tiles_fit(layout) -> bool:
    """Whether 16x16 blocks fit: the stored rows (second-to-last axis) a multiple of 16."""
    shape, axis = layout
    rows = stored(np.empty(shape, np.int8), axis).shape[:-1]
    return len(rows) >= 1 and rows[-1] % 16 == 0


def has_f32_subnormal(x: np.ndarray) -> bool:
    a = np.abs(np.asarray(x, F32))
    return bool(np.any((a > 0) & (a < MIN_NORMAL_F32)))


def rht_meets_subnormal(values: np.ndarray, inverse: bool = False) -> bool:
    """Whether the butterflies of the RHT (or of its inverse) of `values` pass a subnormal."""
    v = np.asarray(values, F32).reshape(-1, 16)
    v = v if inverse else v * oracle.SIGN_VECTOR
    seen = [v]
    with np.errstate(all="ignore"):
        for h in (1, 2, 4, 8):
            v = v.reshape(-1, 16 // (2 * h), 2, h)
            v = np.stack([v[:, :, 0] + v[:, :, 1], v[:, :, 0] - v[:, :, 1]], axis=2)
            seen.append(v.reshape(-1, 16))
        seen.append(seen[-1] * F32(0.25))
    return any(has_f32_subnormal(s[np.isfinite(s)]) for s in seen)


def exempt_rht_subnormals(values: np.ndarray, inverse: bool = False) -> None:
    """Section 8: an RHT whose butterflies pass through f32 subnormals is not bit-exact."""
    assume(not rht_meets_subnormal(values, inverse))


def outside_contract(x: np.ndarray, stored_amax) -> bool:
    """Section 8's exemption from bit-exactness: f32 subnormal input or 0 < amax < 2^-100."""
    a = F32(stored_amax)
    if np.isnan(a):
        return False  # the NaN tensor is exact whatever the data
    return has_f32_subnormal(x) or bool(0 < abs(a) < TINY_AMAX)


def sr_bytes(words: tuple[int, int], n: int, offset: int) -> np.ndarray:
    """The oracle's random bytes of elements offset..offset+n-1 (section 7, shards note)."""
    if offset == 0:
        return oracle.sr_random_bytes(*words, n)
    e = np.arange(n, dtype=np.uint64)
    j = np.uint64(offset // 8) + e // np.uint64(8)  # wraps modulo 2^64, as 64-bit counters do
    hi = (j >> np.uint64(32)).astype(np.uint32)
    lo = (j & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    w0, w1 = oracle.threefry2x32(words[0], words[1], hi, lo)
    word = w0.astype(np.uint64) | (w1.astype(np.uint64) << np.uint64(32))
    return ((word >> ((e % np.uint64(8)) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint8)


def summary(a) -> str:
    return np.array2string(np.asarray(a, F32), threshold=64, edgeitems=4, precision=9)


# --- data ----------------------------------------------------------------------------------

BLOCK_KINDS = (
    "normal",
    "zeros",
    "underflow",
    "ties",
    "near_ties",
    "grid",
    "huge",
    "tiny",
    "constant",
)
# Finite special values; a non-finite one is drawn separately, less often, so that the NaN
# tensor of section 8 does not swamp the other cases.
NON_FINITE = ("nan", "inf", "-inf")
SPECIALS = (
    "zero",
    "-zero",
    "max",
    "-max",
    "min_normal",
    "subnormal",
    "-subnormal",
    "T",
    "-T",
)
# The tensor scale k: T = 2688 * 2^k is the amax the data are built around (S_enc = 2^-k).
# The ranges keep edges * 2^(m+k) (m in [-9, 8]) exact and T finite in the dtype; f32 and
# bf16 also reach the extremes, down to a tensor amax just above 2^-100.
K_RANGES = {
    "f32": ((-8, 8), (-111, -85), (100, 116)),
    "bf16": ((-8, 8), (-111, -85), (100, 116)),
    "f16": ((-12, 4),),
}


def _grid_block(rng, table, signs, k) -> np.ndarray:
    """A block on E2M1 edges (ties) or grid values times 2^(m+k), block amax 6 * 2^(m+k)."""
    m = int(rng.integers(-9, 9))
    v = rng.choice(table, 16) * signs
    v[int(rng.integers(16))] = 6.0 * signs[0]
    return v * 2.0 ** (m + k)


def _block(kind: str, rng, name: str, k: int) -> np.ndarray:
    """16 float64 values of one block kind, around the tensor amax T = 2688 * 2^k."""
    t = 2688.0 * 2.0**k
    signs = rng.choice([-1.0, 1.0], 16)
    if kind == "normal":
        return np.clip(rng.standard_normal(16) * t * 2.0 ** -int(rng.integers(0, 12)) / 4, -t, t)
    if kind == "zeros":
        return signs * 0.0
    if kind == "underflow":  # block amax far below T: the E4M3 scale rounds to 0
        return rng.standard_normal(16) * t * 2.0 ** -int(rng.integers(22, 40))
    if kind in ("ties", "near_ties"):
        return _grid_block(rng, EDGES, signs, k)
    if kind == "grid":
        return _grid_block(rng, GRID, signs, k)
    if kind == "huge":
        return signs * rng.uniform(0.25, 1.0, 16) * float(ml_dtypes.finfo(DTYPES[name]).max)
    if kind == "tiny":  # normal in f32, far below everything else
        lo, hi = (-24, -14) if name == "f16" else (-126, -100)
        return signs * 2.0 ** rng.uniform(lo, hi, 16)
    return np.full(16, signs[0] * t * 2.0 ** -int(rng.integers(0, 30)))  # constant


def _nudge(a: np.ndarray, rng) -> np.ndarray:
    """Moves random nonzero finite elements one ulp up or down in their own dtype."""
    bits = a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).copy()
    ok = np.isfinite(a.astype(F32)) & (a.astype(F32) != 0)
    step = rng.choice([-1, 0, 1], a.shape).astype(bits.dtype)
    step = np.where(ok, step, 0).astype(bits.dtype)
    return (bits + step).astype(bits.dtype).view(a.dtype)


def _special(what: str, rng, name: str, t: float) -> float:
    dtype = DTYPES[name]
    values = {
        "nan": np.nan,
        "inf": np.inf,
        "-inf": -np.inf,
        "zero": 0.0,
        "-zero": -0.0,
        "max": float(ml_dtypes.finfo(dtype).max),
        "-max": -float(ml_dtypes.finfo(dtype).max),
        "min_normal": float(ml_dtypes.finfo(dtype).smallest_normal),
        "T": t,
        "-T": -t,
    }
    if what in values:
        return values[what]
    # An f32 subnormal (for f16 a subnormal of f16, which f32 holds as a normal number).
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    value = tiny * int(rng.integers(1, 2**10 if name == "f16" else 2**23))
    return value if what == "subnormal" else -value


@st.composite
def tensors(draw, layout, name: str) -> np.ndarray:
    """A tensor of `layout` in dtype `name`, built block by block, with special values."""
    shape, axis = layout
    stored_shape = stored(np.empty(shape, np.int8), axis).shape
    n_blocks = math.prod(stored_shape) // 16
    k = draw(st.one_of(*[st.integers(lo, hi) for lo, hi in K_RANGES[name]]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kinds = [draw(st.sampled_from(BLOCK_KINDS))] * n_blocks
    if n_blocks:
        for b, kind in draw(
            st.lists(
                st.tuples(st.integers(0, n_blocks - 1), st.sampled_from(BLOCK_KINDS)), max_size=6
            )
        ):
            kinds[b] = kind
    v = np.concatenate([_block(kind, rng, name, k) for kind in kinds] or [np.zeros(0)])
    if name != "f16":  # no accidental f32 subnormals: only the "subnormal" specials make them
        v = np.where(np.abs(v) < MIN_NORMAL_F32, v * 0.0, v)
    x = v.astype(F32).astype(DTYPES[name])
    near = np.repeat([kind == "near_ties" for kind in kinds], 16) if n_blocks else np.zeros(0, bool)
    x = np.where(near, _nudge(x, rng), x)
    if x.size:
        t = 2688.0 * 2.0**k
        if draw(st.booleans()):  # the tensor amax is exactly T: S_enc = 2^-k
            x[draw(st.integers(0, x.size - 1))] = rng.choice([-t, t])
        for i, what in draw(
            st.lists(st.tuples(st.integers(0, x.size - 1), st.sampled_from(SPECIALS)), max_size=4)
        ):
            x[i] = _special(what, rng, name, t)
        if (
            draw(st.integers(0, 11)) == 5
        ):  # about one tensor in 12 (not an end: Hypothesis favours those)
            x[draw(st.integers(0, x.size - 1))] = _special(
                draw(st.sampled_from(NON_FINITE)), rng, name, t
            )
    return np.moveaxis(x.reshape(stored_shape), -1, axis)


# --- quantize cases ------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One call of quantize / fake_quantize, and what the oracle needs to redo it."""

    x: np.ndarray
    axis: int
    block_2d: bool
    rht: bool
    sr: bool
    key: object = None
    words: tuple[int, int] | None = None
    offset: int = 0
    amax: np.float32 | None = None

    def static(self) -> dict:
        return dict(
            axis=self.axis, block_2d=self.block_2d, rht=self.rht, stochastic_rounding=self.sr
        )

    def oracle(self) -> oracle.OracleResult:
        r = sr_bytes(self.words, self.x.size, self.offset) if self.sr else None
        amax = None if self.amax is None else self.amax
        with np.errstate(all="ignore"):
            return oracle.quantize(
                self.x, axis=self.axis, block_2d=self.block_2d, rht=self.rht, sr_bytes=r, amax=amax
            )

    def describe(self) -> str:
        return (
            f"dtype={self.x.dtype} shape={self.x.shape} axis={self.axis} "
            f"block_2d={self.block_2d} rht={self.rht} sr={self.sr} key_words={self.words} "
            f"offset={self.offset} amax={self.amax!r}\nx={summary(self.x)}"
        )


# A counter offset (element offset / 8) near 2^32 carries into the high word; one near 2^64
# wraps around.
OFFSETS = st.one_of(
    st.just(0),
    st.integers(1, 2**12).map(lambda i: 16 * i),
    st.integers(2**31 - 2**8, 2**31 + 2**8).map(lambda i: 16 * i),
    st.integers(2**63 - 2**8, 2**63 - 1).map(lambda i: 16 * i),
)


@st.composite
def sr_keys(draw):
    """(key passed to the op, its key words, element offset): typed, raw or an SRSeed."""
    kind = draw(st.sampled_from(["typed", "raw", "seed"]))
    seed = draw(st.integers(0, 2**32 - 1))
    key = jax.random.key(seed) if kind != "raw" else jax.random.PRNGKey(seed)
    words = oracle.sr_key_words(key)
    if kind != "seed":
        return key, words, 0
    offset = draw(OFFSETS)
    return nvfp4_jax.SRSeed.from_key(key, element_offset=offset), words, offset


AMAX_KINDS = (
    "none",
    "none",
    "none",
    "true",
    "zero",
    "-zero",
    "below",
    "above",
    "random",
    "invalid",
)


def true_amax(x: np.ndarray, axis: int, rht: bool) -> float:
    xs = stored(x, axis)
    if rht:
        with np.errstate(all="ignore"):
            xs = oracle.fwht_rht(xs)
    return float(np.max(np.abs(xs.astype(F32)), initial=0))


@st.composite
def caller_amax(draw, x, axis, rht):
    """None, or a caller amax (traced under jit, so invalid values give the NaN tensor)."""
    kind = draw(st.sampled_from(AMAX_KINDS))
    true = true_amax(x, axis, rht)
    factor = draw(st.floats(2.0**-30, 1.0))
    values = {
        "none": None,
        "true": true,
        "zero": 0.0,
        "-zero": -0.0,
        "below": true * factor,  # the largest elements saturate
        "above": true / factor,
        "random": draw(st.floats(TINY_AMAX, 3e38)),
        "invalid": draw(
            st.sampled_from([np.nan, np.inf, -np.inf, -1.0, -(2.0**-149), -3e38])
        ),  # traced: the NaN tensor
    }
    value = values[kind]
    with np.errstate(over="ignore"):
        return None if value is None else F32(value)


@st.composite
def quantize_cases(draw) -> Case:
    layout = draw(st.sampled_from(LAYOUTS))
    name = draw(st.sampled_from(sorted(DTYPES)))
    x = draw(tensors(layout, name))
    axis = layout[1]
    block_2d = draw(st.booleans()) if tiles_fit(layout) else False
    rht, sr = draw(st.booleans()), draw(st.booleans())
    case = Case(x, axis, block_2d, rht, sr, amax=draw(caller_amax(x, axis, rht)))
    if sr:
        case.key, case.words, case.offset = draw(sr_keys())
    note(case.describe())
    return case


SCALE_BYTES = st.one_of(
    st.integers(0, 0x7E),  # every finite non-negative E4M3 value
    st.sampled_from([0x00, 0x01, 0x08, 0x38, 0x7E, 0x7F]),  # 0, 2^-9, 2^-6, 1, 448, NaN
)


@st.composite
def quantized(draw):
    """(NVFP4Array of arbitrary codes, scales and amax, the same as numpy, out dtype name)."""
    shape, axis = draw(st.sampled_from(LAYOUTS))
    stored_shape = stored(np.empty(shape, np.int8), axis).shape
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    codes = rng.integers(0, 256, (*stored_shape[:-1], stored_shape[-1] // 2), dtype=np.uint8)
    pool = np.array(draw(st.lists(SCALE_BYTES, min_size=1, max_size=8)), np.uint8)
    scales = rng.choice(pool, (*stored_shape[:-1], stored_shape[-1] // 16)).astype(np.uint8)
    scales = scales.view(ml_dtypes.float8_e4m3fn)
    amax = F32(
        draw(
            st.one_of(
                st.just(0.0),
                st.just(np.nan),
                st.floats(TINY_AMAX, float(np.finfo(F32).max), width=32),
                st.sampled_from([2688.0, 448.0, 1.0, float(np.finfo(F32).max)]),
            )
        )
    )
    neg_axis = axis - len(shape) if axis >= 0 else axis
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    rht = draw(st.booleans())
    q = NVFP4Array(codes, scales, amax, dtype=dtype, axis=neg_axis, block_2d=False, rht=rht)
    note(f"shape={shape} axis={axis} rht={rht} amax={amax!r} scale bytes={pool.tolist()}")
    return q, draw(st.sampled_from(sorted(DTYPES)))
