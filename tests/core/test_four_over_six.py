"""Four Over Six (docs/NUMERICS.md section 13) on every implementation, against the oracle.

The NumPy oracle (`numerics_oracle.four_over_six_scales`) is written from the section; the
reference, the CPU kernels (every ISA build) and the CUDA kernels' arithmetic (run on the
host by `four_over_six_check.cc`) must give its bits: codes, scale bytes, amax and the
fake-quantized values. Random data rarely lands near a tie between the two candidates, so
`near_ties` constructs blocks (and 16x16 tiles) whose two errors are equal in exact
arithmetic, moved by a few ulps: there the f32 operation order of the section decides, and
the test first shows that other orders (a reciprocal for the division, `S_dec` for `A / 6M`,
pairwise sums) decide differently.
"""

from __future__ import annotations

import itertools
import subprocess

import jax
import jax.numpy as jnp
import numerics_oracle as oracle
import numpy as np
import pytest
from helpers import (
    MESH_MODES,
    assert_same_bits,
    assert_same_q,
    build_host_check,
    heavy_tailed,
    make_impl,
    make_mesh,
    mesh_context,
    with_underflow_block,
)
from jax.sharding import NamedSharding, PartitionSpec

import nvfp4_jax
from nvfp4_jax import reference
from nvfp4_jax._src.core.array import validate_nvfp4_array

F32 = np.float32
KEY = jax.random.key(11)
MODES = ("mae", "mse")
MAXES = (256, 448)


def flags(mode, m, block_2d=False, rht=False, sr=False):
    return dict(
        block_2d=block_2d,
        rht=rht,
        stochastic_rounding=sr,
        four_over_six=mode,
        four_over_six_e4m3_max=m,
    )


def expected(x, mode, m, *, block_2d=False, rht=False, sr=False, amax=None, key=KEY):
    sr_bytes = oracle.sr_random_bytes(*oracle.sr_key_words(key), x.size) if sr else None
    return oracle.quantize(
        x,
        block_2d=block_2d,
        rht=rht,
        sr_bytes=sr_bytes,
        amax=amax,
        four_over_six=mode,
        e4m3_max=m,
    )


def check(impl, x, mode, m, *, block_2d=False, rht=False, sr=False, amax=None, what=""):
    """impl's quantize and fake_quantize (jitted) give the oracle's bits."""
    o = expected(x, mode, m, block_2d=block_2d, rht=rht, sr=sr, amax=amax)
    kw = flags(mode, m, block_2d, rht, sr)
    amax = None if amax is None else F32(amax)
    q = impl.quantize(x, key=KEY, amax=amax, **kw)
    assert_same_q(q, o, f"{impl.name} {what}")
    assert (q.four_over_six, q.e4m3_max) == (mode, m)
    fake = impl.fake_quantize(x, key=KEY, amax=amax, dtype=jnp.float32, **kw)
    assert_same_bits(fake, o.dequant_stored.reshape(fake.shape), f"{impl.name} {what} fake")
    return o


def sample(shape, dtype, seed):
    """Heavy-tailed data with a block far below the tensor amax (its scales underflow) and a
    block of zeros."""
    x = with_underflow_block(heavy_tailed(shape, dtype, seed=seed), row=1, block=1)
    x[2, :16] = 0
    return x


# --- the flag matrix --------------------------------------------------------------------------

MATRIX = list(itertools.product(MODES, MAXES, (False, True), (False, True), (False, True)))
# Every pair of flag values at least once (a 2^(5-2) design: rht = mode ^ M, sr = mode ^ 2d),
# for the slower reference.
COVERING = [
    (MODES[a], MAXES[b], bool(c), bool(a ^ b), bool(a ^ c))
    for a, b, c in itertools.product((0, 1), repeat=3)
]


def matrix_id(case):
    mode, m, block_2d, rht, sr = case
    blocks = "2d" if block_2d else "1d"
    return f"{mode}_{m}_{blocks}_{'rht' if rht else 'plain'}_{'sr' if sr else 'rn'}"


def matrix_data(i, block_2d):
    dtype = ("f32", "bf16", "f16")[i % 3]
    shape = ((32, 256) if i % 2 else (48, 80)) if block_2d else ((33, 64) if i % 2 else (4, 48))
    return sample(shape, dtype, seed=i)


@pytest.mark.parametrize("case", MATRIX, ids=matrix_id)
def test_cpu_matches_oracle(case):
    mode, m, block_2d, rht, sr = case
    x = matrix_data(MATRIX.index(case), block_2d)
    check(make_impl("cpu"), x, mode, m, block_2d=block_2d, rht=rht, sr=sr, what=matrix_id(case))


@pytest.mark.parametrize("case", COVERING, ids=matrix_id)
def test_reference_matches_oracle(case):
    mode, m, block_2d, rht, sr = case
    x = matrix_data(MATRIX.index(case), block_2d)
    check(
        make_impl("reference"), x, mode, m, block_2d=block_2d, rht=rht, sr=sr, what=matrix_id(case)
    )


@pytest.mark.parametrize("implementation", ["reference", "ffi"])
def test_eager_equals_oracle(implementation):
    """Outside `jit` (each op dispatched on its own) the bits are the same."""
    if implementation == "ffi":
        make_impl("cpu")
    x = sample((32, 64), "bf16", seed=3)
    for mode, block_2d, sr in (("mae", False, True), ("mse", True, False)):
        kw = flags(mode, 256, block_2d, True, sr)
        o = expected(x, mode, 256, block_2d=block_2d, rht=True, sr=sr)
        q = nvfp4_jax.quantize(x, key=KEY, implementation=implementation, **kw)
        assert_same_q(q, o, f"eager {implementation}")
        fake = nvfp4_jax.fake_quantize(
            x, key=KEY, dtype=jnp.float32, implementation=implementation, **kw
        )
        assert_same_bits(fake, o.dequant_stored, f"eager {implementation} fake")


# --- near ties: where the operation order decides ------------------------------------------------


def candidates(units, a, m):
    """Per unit (rows of `units`, U values sharing one scale): (enc, codes, val) of map-to-4
    and map-to-6, the oracle's arithmetic of section 13."""
    s_enc, s_dec = oracle.global_scales(a, m)
    base = (np.max(np.abs(units), axis=1) / F32(6)) * s_enc
    out = {}
    for name, s in (
        ("4", oracle.e4m3_rne(np.minimum(base * F32(1.5), F32(448)))),
        ("6", oracle.e4m3_rne(np.minimum(base, F32(448)))),
    ):
        enc = oracle._encode_factors(s, s_dec)[:, None]
        codes = oracle.e2m1_code_rn(units * enc)
        val = ((oracle.e2m1_value(codes) * s.astype(F32)[:, None]) * a) / F32(6 * m)
        out[name] = (enc, codes, val, s, s_dec)
    return out


def near_ties(units, mode, m, a, offsets=(-2, -1, 0, 1, 2)):
    """Units (N, U) whose first element is the unit's amax, each with one other element moved
    so that the candidates' errors are equal in exact arithmetic, then by `offsets` ulps.

    The moved element lies between its two reconstructions, where moving it trades one
    candidate's error for the other's; it keeps both its codes.
    """
    a = F32(a)
    c = candidates(units, a, m)
    x64 = units.astype(np.float64)
    v4, v6 = c["4"][2].astype(np.float64), c["6"][2].astype(np.float64)
    term = np.abs if mode == "mae" else np.square
    e4, e6 = term(v4 - x64), term(v6 - x64)
    between = (v4 - x64) * (v6 - x64) < 0
    between[:, 0] = False
    out = []
    for r in np.nonzero(between.any(axis=1))[0]:
        k = int(np.argmax(between[r]))
        o4, o6 = e4[r].sum() - e4[r, k], e6[r].sum() - e6[r, k]
        if mode == "mae":  # o4 + s (v4 - x) = o6 + s (x - v6), s = sign(v4 - x)
            s = np.sign(v4[r, k] - x64[r, k])
            x = (o4 - o6 + s * (v4[r, k] + v6[r, k])) / (2 * s)
        else:  # o4 + (v4 - x)^2 = o6 + (v6 - x)^2
            x = (v4[r, k] ** 2 - v6[r, k] ** 2 - (o6 - o4)) / (2 * (v4[r, k] - v6[r, k]))
        for off in offsets:
            xf = F32(x)
            for _ in range(abs(off)):
                xf = np.nextafter(xf, F32(np.inf if off > 0 else -np.inf))
            u = units[r].copy()
            u[k] = xf
            if abs(xf) >= abs(u[0]) or (v4[r, k] - xf) * (v6[r, k] - xf) >= 0:
                continue
            if all(np.array_equal(oracle.e2m1_code_rn(u * c[n][0][r]), c[n][1][r]) for n in "46"):
                out.append(u)
    return np.array(out, F32)


def picks_by(units, mode, m, a, variant):
    """Map-to-4 per unit, with the section's arithmetic or a plausible other one."""
    c = candidates(units, F32(a), m)
    err = {}
    for name in "46":
        enc, codes, val, s, s_dec = c[name]
        v = oracle.e2m1_value(codes) * s.astype(F32)[:, None]
        if variant == "reciprocal":
            val = (v * F32(a)) * (F32(1) / F32(6 * m))
        elif variant == "s_dec":
            val = v * s_dec
        d = val - units
        terms = np.abs(d) if mode == "mae" else d * d
        if variant == "pairwise":
            while terms.shape[1] > 1:
                terms = terms[:, 0::2] + terms[:, 1::2]
            err[name] = terms[:, 0]
        else:
            total = np.zeros(len(units), F32)
            for k in range(units.shape[1]):
                total = total + terms[:, k]
            err[name] = total
    return err["4"] < err["6"]


def tie_units(n, size, a, seed):
    rng = np.random.default_rng(seed)
    bmax = (rng.uniform(0.05, 1.0, n) * a).astype(F32)
    units = (rng.uniform(-1, 1, (n, size)) * bmax[:, None]).astype(F32)
    units[:, 0] = bmax
    return units


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", MAXES)
def test_near_ties_1x16(mode, m):
    a = F32(10.0)
    units = near_ties(tie_units(400, 16, a, seed=m + len(mode)), mode, m, a)
    # The data is sensitive to the operation order: other orders pick otherwise.
    exact = picks_by(units, mode, m, a, "section 13")
    for variant in ("reciprocal", "s_dec", "pairwise"):
        assert (picks_by(units, mode, m, a, variant) != exact).sum() > 0, variant
    assert 0.1 < exact.mean() < 0.9
    x = units.reshape(-1, 64) if len(units) % 4 == 0 else units
    for name in ("reference", "cpu"):
        check(make_impl(name), x, mode, m, amax=a, what=f"near ties {mode} {m}")


def tie_tiles(mode, m, a, seed, n_tiles=24):
    """(16, 16 * n) with n 16x16 tiles whose 16 rows are near-tie blocks of one amax: the
    tile's two error sums differ by little, and the order of their additions decides."""
    rng = np.random.default_rng(seed)
    tiles = []
    for bmax in rng.uniform(0.2, 1.0, n_tiles) * a:
        units = (rng.uniform(-1, 1, (40, 16)) * F32(bmax)).astype(F32)
        units[:, 0] = F32(bmax)
        rows = near_ties(units, mode, m, a, offsets=(-1, 0, 1))
        if len(rows) >= 16:
            tiles.append(rows[rng.permutation(len(rows))[:16]])
    return np.concatenate(tiles, axis=1)


@pytest.mark.parametrize("mode", MODES)
def test_near_ties_16x16(mode):
    """Tiles of near-tie rows: the tree over the rows of section 13 decides."""
    a, m = F32(10.0), 256
    x = tie_tiles(mode, m, a, seed=7)
    o = expected(x, mode, m, block_2d=True, amax=a)
    # A plain sum over the tile's rows (instead of the tree) decides some tiles otherwise.
    s_enc, s_dec = oracle.global_scales(a, m)
    ab = oracle._block_amax(x, True)
    _, pick = oracle.four_over_six_scales(x, ab, a, s_enc, s_dec, True, mode, m)
    sums = {}
    for name, s in (
        ("4", oracle.e4m3_rne(np.minimum(((ab / F32(6)) * s_enc) * F32(1.5), F32(448)))),
        ("6", oracle.e4m3_rne(np.minimum((ab / F32(6)) * s_enc, F32(448)))),
    ):
        err = oracle.four_over_six_errors(x.reshape(16, -1, 16), s, s_dec, a, mode, m)
        total = np.zeros(err.shape[1], F32)
        for r in range(16):
            total = total + err[r]
        sums[name] = total
    assert ((sums["4"] < sums["6"]) != pick[0]).sum() > 0
    assert 0 < pick[0].sum() < pick.shape[1]
    for name in ("reference", "cpu"):
        impl = make_impl(name)
        q = impl.quantize(x, amax=F32(a), **flags(mode, m, block_2d=True))
        assert_same_q(q, o, f"{name} near-tie tiles")


def test_exact_ties_keep_map_to_6():
    """A = 6M makes S_enc = 1 and every candidate value exact: ties are constructed."""
    for name, m in itertools.product(("reference", "cpu"), MAXES):
        impl = make_impl(name)
        a = F32(6 * m)
        x = np.zeros((6, 16), F32)
        x[0, 0] = a  # the tensor amax (for M = 448: s4 = s6 = 448, a tie)
        x[1, :3] = (48, 12, 24)  # on both grids: both errors 0
        x[2, :3] = (48, 12, -26)  # both round 26 to 24: both errors 2 (squares 4)
        x[3, :2] = (48, 36)  # map-to-4 exact (36 = 3 * 12), map-to-6 errs: map-to-4
        x[4, :2] = (48, 32)  # 32 is exact under map-to-6 only (4 * 8): map-to-6
        # row 5: all zeros
        for mode in MODES:
            o = check(impl, x, mode, m, amax=a, what=f"ties {mode} {m}")
            s = o.scales.astype(np.float32)[:, 0]
            map6, map4 = 8.0, 12.0  # base = 48 / 6 * 1 = 8
            assert list(s[1:6]) == [map6, map6, map4, map6, 0.0], (mode, m, s)
            assert s[0] == m  # 6M / 6: both candidates exact (M = 256) or equal (448)


# --- every ISA of the CPU kernels ----------------------------------------------------------------


def test_every_cpu_isa(cpu_isa):
    cpu = make_impl("cpu")
    for i, (mode, block_2d, rht, sr) in enumerate(
        [
            ("mae", False, True, True),
            ("mse", True, False, False),
            ("mse", False, False, False),
            ("mae", True, True, True),
        ]
    ):
        x = sample(((32, 256) if i == 1 else (48, 80)) if block_2d else (40, 96), "bf16", seed=i)
        check(cpu, x, mode, 256, block_2d=block_2d, rht=rht, sr=sr, what=f"{cpu_isa} {i}")
    a = F32(10.0)
    units = near_ties(tie_units(200, 16, a, seed=5), "mse", 448, a)
    check(cpu, units, "mse", 448, amax=a, what=f"{cpu_isa} near ties")


# --- the CUDA kernels' arithmetic, on the host --------------------------------------------------


def test_cuda_arithmetic_on_the_host(tmp_path):
    binary = build_host_check(
        "four_over_six_check.cc", tmp_path / "four_over_six_check", "-ffp-contract=off"
    )
    a = F32(10.0)
    ties = near_ties(tie_units(200, 16, a, seed=9), "mae", 256, a)
    cases = [
        (sample((32, 256), "f32", seed=1), None, "mse", 256, True, False, False),
        (sample((48, 64), "f32", seed=2), None, "mae", 448, True, True, True),
        (sample((33, 64), "f32", seed=3), None, "mse", 448, False, True, True),
        (ties, a, "mae", 256, False, False, False),
    ]
    k0, k1 = oracle.sr_key_words(KEY)
    for i, (x, amax, mode, m, block_2d, rht, sr) in enumerate(cases):
        o = expected(x, mode, m, block_2d=block_2d, rht=rht, sr=sr, amax=amax)
        (tmp_path / "x.bin").write_bytes(np.ascontiguousarray(x, F32).tobytes())
        used = F32(o.amax)
        run = subprocess.run(
            [
                str(binary),
                str(tmp_path / "x.bin"),
                str(tmp_path / "out.bin"),
                *map(str, x.shape),
                str(MODES.index(mode) + 1),
                str(m),
                str(int(block_2d)),
                str(int(rht)),
                str(int(sr)),
                str(k0),
                str(k1),
                str(int(used.view(np.uint32))),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        out = np.frombuffer((tmp_path / "out.bin").read_bytes(), np.uint8)
        codes, scales = out[: x.size // 2], out[x.size // 2 :]
        assert_same_bits(codes.reshape(o.packed.shape), o.packed, f"case {i} codes")
        assert_same_bits(
            scales.reshape(o.scales.shape), o.scales.view(np.uint8), f"case {i} scales"
        )


# --- what is stored, and dequantizing it ---------------------------------------------------------


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_stored_array_and_dequantize(name):
    impl = make_impl(name)
    x = sample((32, 64), "f32", seed=4)
    for m in MAXES:
        q = impl.quantize(x, **flags("mse", m))
        validate_nvfp4_array(q)
        a = np.asarray(q.amax)
        d = F32(a * (F32(1) / F32(6 * m)))
        assert_same_bits(q.decode_scale, d, "decode_scale")
        assert_same_bits(q.global_scale, d, "global_scale")
        assert "four_over_six='mse'" in repr(q) and f"e4m3_max={m}" in repr(q)
        o = expected(x, "mse", m)
        want = oracle.dequantize(o)
        for other in ("reference", "cpu"):
            assert_same_bits(make_impl(other).dequantize(q), want, f"{name} -> {other} dequantize")
        assert_same_bits(q.dequantize(), want, "method")
        # Without the leaf, the metadata alone gives the same D.
        bare = nvfp4_jax.NVFP4Array(
            q.codes, q.scales, q.amax, q.dtype, q.axis, False, False, None, "mse", m
        )
        assert_same_bits(bare.global_scale, d, "D from e4m3_max")
    # With the RHT the inverse is applied after decoding, in f32.
    q = impl.quantize(x, **flags("mae", 256, rht=True))
    want = oracle.dequantize(expected(x, "mae", 256, rht=True), rht=True)
    np.testing.assert_allclose(impl.dequantize(q), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_straight_through_gradient():
    """fake_quantize's derivative under 4/6: the identity, times S_enc = 6M / A without the
    global scale (docs/NUMERICS.md section 13's S_enc)."""
    x = jnp.asarray(sample((16, 32), "f32", seed=5))
    for global_scale in (True, False):
        for implementation in ("reference", "ffi"):
            grad = jax.grad(
                lambda v, g=global_scale, i=implementation: nvfp4_jax.fake_quantize(
                    v, four_over_six="mse", global_scale=g, implementation=i
                ).sum()
            )(x)
            want = 1.0 if global_scale else F32(1536) / F32(jnp.max(jnp.abs(x)))
            np.testing.assert_array_equal(grad, np.full(x.shape, want, F32))


def test_vmap_batches_the_decode_scale():
    x = np.stack([sample((16, 32), "f32", seed=s) for s in range(3)])
    q = jax.vmap(lambda v: nvfp4_jax.quantize(v, four_over_six="mae"))(x)
    assert q.decode_scale.shape == (3,)
    for i in range(3):
        o = expected(x[i], "mae", 256)
        assert_same_bits(q.codes[i], o.packed, "codes")
        np.testing.assert_array_equal(np.asarray(q.dequantize())[i], oracle.dequantize(o))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MESH_MODES)
@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_sharded_quantize_is_the_unsharded_one(name, mode):
    impl = make_impl(name)
    mesh = make_mesh((8,), ("d",), mode)
    x = sample((128, 64), "bf16", seed=8)
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec("d", None)))
    for block_2d, sr in ((False, True), (True, False)):
        kw = flags("mse", 256, block_2d=block_2d, sr=sr)

        def fn(v, kw=kw):
            return nvfp4_jax.quantize(v, key=KEY, implementation=impl.implementation, **kw)

        with mesh_context(mesh, mode):
            q = jax.jit(fn)(placed)
        assert_same_q(q, expected(x, "mse", 256, block_2d=block_2d, sr=sr), f"sharded {mode}")


# --- inputs at the edges -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_non_finite_and_tiny_inputs(name):
    impl = make_impl(name)
    x = sample((16, 64), "f32", seed=6)
    x[3, 5] = np.nan
    check(impl, x, "mse", 256, what="nan")
    x[3, 5] = np.inf
    check(impl, x, "mae", 448, what="inf", block_2d=True)
    zeros = np.zeros((16, 32), F32)
    o = check(impl, zeros, "mae", 256, what="zeros")
    assert not np.asarray(o.scales.view(np.uint8)).any()
    # Small values, but far from subnormal error terms: every implementation agrees.
    small = sample((16, 64), "f32", seed=7) * F32(1e-12)
    check(impl, small, "mse", 256, what="small")


def test_tiny_values_agree_on_the_cpu():
    """Where "mse" terms are subnormal the CPU implementations (which flush them) agree."""
    x = sample((16, 64), "f32", seed=9) * F32(1e-24)
    ref, cpu = make_impl("reference"), make_impl("cpu")
    for block_2d in (False, True):
        kw = flags("mse", 256, block_2d=block_2d)
        assert_same_q(cpu.quantize(x, **kw), ref.quantize(x, **kw), "tiny")


# --- argument checks ---------------------------------------------------------------------------

BAD = [
    (dict(four_over_six="max"), ValueError, "four_over_six must be None, 'mae', 'mse', got 'max'"),
    (dict(four_over_six="MAE"), ValueError, "four_over_six must be None, 'mae', 'mse', got 'MAE'"),
    (dict(four_over_six=True), TypeError, "four_over_six must be None, 'mae', 'mse', got True"),
    (dict(four_over_six=1), TypeError, "four_over_six must be None, 'mae', 'mse', got 1"),
    (
        dict(four_over_six="mae", four_over_six_e4m3_max=300),
        ValueError,
        "four_over_six_e4m3_max must be 256 or 448, got 300",
    ),
    (
        dict(four_over_six="mae", four_over_six_e4m3_max=256.0),
        TypeError,
        "four_over_six_e4m3_max must be the int 256 or 448, got 256.0",
    ),
    (
        dict(four_over_six="mse", four_over_six_e4m3_max=True),
        TypeError,
        "four_over_six_e4m3_max must be the int 256 or 448, got True",
    ),
    (dict(four_over_six_e4m3_max=0), ValueError, "four_over_six_e4m3_max must be 256 or 448"),
]


@pytest.mark.parametrize("op", ["quantize", "fake_quantize"])
def test_bad_arguments_are_named_alike(op):
    x = jnp.ones((16, 32))
    for kwargs, error, message in BAD:
        seen = []
        for fn in (
            lambda **kw: getattr(nvfp4_jax, op)(x, implementation="reference", **kw),
            lambda **kw: getattr(nvfp4_jax, op)(x, implementation="ffi", **kw),
            lambda **kw: getattr(reference, op)(x, **kw),
        ):
            with pytest.raises(error) as info:
                fn(**kwargs)
            seen.append(str(info.value))
        assert seen[0] == seen[1] == seen[2], seen
        assert seen[0].startswith(f"{op}: {message}"), seen


def test_raw_targets_reject_bad_attributes():
    make_impl("cpu")
    x, amax, key = np.ones((16, 32), F32), F32(1), np.zeros(4, np.uint32)
    out = (
        jax.ShapeDtypeStruct((16, 16), jnp.uint8),
        jax.ShapeDtypeStruct((16, 2), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    base = dict(block_2d=False, rht=False, stochastic_rounding=False)
    call = jax.ffi.ffi_call("nvfp4_quantize_4over6", out)
    for attrs, message in (
        (dict(error="max", e4m3_max=np.int32(256)), 'attribute error must be "mae" or "mse"'),
        (dict(error="mae", e4m3_max=np.int32(300)), "attribute e4m3_max must be 256 or 448"),
    ):
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(call(x, amax, key, **base, **attrs))
    codes, scales, stored = call(x, amax, key, **base, error="mse", e4m3_max=np.int32(448))
    assert float(stored) == 1.0 and np.asarray(scales).view(np.uint8).any()


def test_metadata_is_checked():
    q = nvfp4_jax.quantize(jnp.ones((16, 32)), four_over_six="mae")
    with pytest.raises(ValueError, match="e4m3_max=256 needs four_over_six"):
        validate_nvfp4_array(
            nvfp4_jax.NVFP4Array(
                q.codes, q.scales, q.amax, q.dtype, q.axis, False, False, None, None, 256
            )
        )
    with pytest.raises(ValueError, match="four_over_six must be None, 'mae', 'mse', got 'l1'"):
        validate_nvfp4_array(
            nvfp4_jax.NVFP4Array(
                q.codes, q.scales, q.amax, q.dtype, q.axis, False, False, None, "l1"
            )
        )


# --- the error it saves --------------------------------------------------------------------


def relative_mse(x, **kw) -> float:
    y = np.asarray(nvfp4_jax.fake_quantize(x, dtype=jnp.float32, **kw), np.float64)
    x = np.asarray(x, np.float64)
    return float(np.sum((y - x) ** 2) / np.sum(x**2))


def test_relative_mse_below_round_to_nearest():
    """N(0, 1) and heavy-tailed, 2^20 values each (docs/NUMERICS.md section 13's table)."""
    normal = np.asarray(jax.random.normal(jax.random.key(0), (1024, 1024), jnp.float32))
    heavy = heavy_tailed((1024, 1024), "f32", seed=1)
    rows = {}
    for data_name, data in (("normal", normal), ("heavy", heavy)):
        for block_2d in (False, True):
            row = {"plain": relative_mse(data, block_2d=block_2d)}
            for mode in MODES:
                row[mode] = relative_mse(data, **flags(mode, 256, block_2d=block_2d))
            rows[data_name, block_2d] = row
            print(
                data_name, "16x16" if block_2d else "1x16", {k: round(v, 5) for k, v in row.items()}
            )
    n1 = rows["normal", False]
    assert n1["mae"] < n1["plain"] and n1["mse"] < n1["plain"]
    assert n1["plain"] == pytest.approx(0.0090, abs=2e-4)  # section 10's anchor
    assert n1["mse"] < 0.0080 and n1["mae"] < 0.0080
    for key, row in rows.items():
        assert row["mae"] <= row["plain"] and row["mse"] <= row["plain"], key
