"""Stochastic rounding (docs/NUMERICS.md section 7): Threefry bits, determinism, unbiasedness,
reach, and the counter offset of shards (`SRSeed`). Runs on every implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numerics_oracle as oracle
import numpy as np
import pytest
from helpers import assert_same_bits, heavy_tailed
from jax.extend.random import threefry_2x32

import nvfp4_jax

GRID = oracle.E2M1_VALUES


def code_values(q) -> np.ndarray:
    return oracle.e2m1_value(oracle.unpack_nibbles(np.asarray(q.codes)))


# ----------------------------------------------------------------------------- threefry

# Known-answer vectors of Threefry-2x32-20 (Random123): (key, counter) -> output.
THREEFRY_KAT = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,ctr,want", THREEFRY_KAT, ids=["zeros", "ones", "pi"])
def test_oracle_threefry_known_answers(key, ctr, want):
    w0, w1 = oracle.threefry2x32(key[0], key[1], np.uint32([ctr[0]]), np.uint32([ctr[1]]))
    assert (int(w0[0]), int(w1[0])) == want


def test_oracle_threefry_matches_jax():
    rng = np.random.default_rng(0)
    for _ in range(4):
        k = rng.integers(0, 2**32, 2, dtype=np.uint32)
        x0, x1 = rng.integers(0, 2**32, (2, 500), dtype=np.uint32)
        # threefry_2x32 hashes pairs (count[i], count[i + n/2]) and returns them the same way.
        out = np.asarray(threefry_2x32((jnp.uint32(k[0]), jnp.uint32(k[1])), jnp.r_[x0, x1]))
        w0, w1 = oracle.threefry2x32(k[0], k[1], x0, x1)
        np.testing.assert_array_equal(out[:500], w0)
        np.testing.assert_array_equal(out[500:], w1)


def test_oracle_random_bytes_layout():
    # Element n takes byte n % 8 of w0 | w1 << 32 for counter (0, n // 8).
    k0, k1 = 0x1234, 0xABCDEF
    r = oracle.sr_random_bytes(k0, k1, 24)
    w0, w1 = oracle.threefry2x32(k0, k1, np.uint32([0, 0, 0]), np.uint32([0, 1, 2]))
    for j in range(3):
        word = int(w0[j]) | (int(w1[j]) << 32)
        np.testing.assert_array_equal(r[8 * j : 8 * j + 8], list(word.to_bytes(8, "little")))


# ----------------------------------------------------------------------------- vs oracle

SR_CASES = {
    "f32_1d_m32_k256": dict(shape=(32, 256), dtype="f32"),
    "bf16_1d_m32_k256": dict(shape=(32, 256), dtype="bf16"),
    "f16_1d_m16_k128": dict(shape=(16, 128), dtype="f16"),
    "bf16_1d_ax0_m128_k24": dict(shape=(128, 24), dtype="bf16", axis=0),
    "f32_1d_3d_b2_m8_k64": dict(shape=(2, 8, 64), dtype="f32"),
    "bf16_2d_m64_k64": dict(shape=(64, 64), dtype="bf16", block_2d=True),
    "bf16_1d_rht_ax0_m64_k32": dict(shape=(64, 32), dtype="bf16", axis=0, rht=True),
    "f32_1d_odd_rows_m3_k16": dict(shape=(3, 16), dtype="f32"),
}


@pytest.mark.parametrize("case", list(SR_CASES))
@pytest.mark.parametrize("seed", [0, 12345], ids=["key0", "key12345"])
def test_sr_bits_match_oracle(impl, case, seed):
    cfg = dict(SR_CASES[case])
    shape, dtype = cfg.pop("shape"), cfg.pop("dtype")
    x = heavy_tailed(shape, dtype, seed=seed + len(case), row_axis=cfg.get("axis", -1))
    key = jax.random.key(seed)
    q = impl.quantize(x, stochastic_rounding=True, key=key, **cfg)
    k0, k1 = oracle.sr_key_words(key)
    o = oracle.quantize(x, sr_bytes=oracle.sr_random_bytes(k0, k1, x.size), **cfg)
    np.testing.assert_array_equal(np.asarray(q.codes), o.packed)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), o.scales.view(np.uint8))
    assert np.asarray(q.amax).view(np.uint32) == np.float32(o.amax).view(np.uint32)


def test_sr_key_words_come_from_random_bits(impl):
    # Legacy uint32 keys and new-style typed keys both seed through jax.random.bits.
    x = heavy_tailed((16, 64), "f32", seed=1)
    for key in (jax.random.PRNGKey(5), jax.random.key(5)):
        k0, k1 = (int(w) for w in np.asarray(jax.random.bits(key, (2,), jnp.uint32)))
        o = oracle.quantize(x, sr_bytes=oracle.sr_random_bytes(k0, k1, x.size))
        np.testing.assert_array_equal(
            np.asarray(impl.quantize(x, stochastic_rounding=True, key=key).codes), o.packed
        )


# ----------------------------------------------------------------------------- determinism


def test_same_key_same_bits_different_keys_differ(impl):
    x = heavy_tailed((32, 128), "bf16", seed=2)
    a = impl.quantize(x, stochastic_rounding=True, key=jax.random.key(1))
    b = impl.quantize(x, stochastic_rounding=True, key=jax.random.key(1))
    c = impl.quantize(x, stochastic_rounding=True, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    differ = np.mean(code_values(a) != code_values(c))
    # Scales and amax do not depend on the key; only the rounding does.
    scales_a, scales_c = (np.asarray(v.scales).view(np.uint8) for v in (a, c))
    np.testing.assert_array_equal(scales_a, scales_c)
    assert differ > 0.2, f"two keys should round independently; only {differ:.1%} differ"


def test_sr_result_is_a_grid_neighbour(impl):
    # y = x exactly (tensor amax 2688 -> S_enc = 1; block amax 6 -> s_b = 1, enc = 1).
    x = _unit_scale_tensor(np.random.default_rng(3).uniform(-6, 6, (64, 16)))
    vals = code_values(impl.quantize(x, stochastic_rounding=True, key=jax.random.key(9)))[:-1]
    y = x[:-1].astype(np.float64)
    lo = GRID[np.searchsorted(GRID, np.abs(y), side="right") - 1]
    hi = GRID[np.minimum(np.searchsorted(GRID, np.abs(y), side="left"), 7)]
    mag = np.abs(vals)
    assert np.all((mag == lo) | (mag == hi))
    np.testing.assert_array_equal(np.signbit(vals), np.signbit(y))


def _unit_scale_tensor(rows: np.ndarray) -> np.ndarray:
    """Rows of 16 in [-6, 6] with S_enc = 1 and every block scale 1, so y == x exactly.

    Element 0 of each row is set to +-6 (block amax 6: s_b = e4m3(6 * RCP6) = 1); a last row
    holds 2688 (tensor amax: S_enc = 2688 / 2688 = 1).
    """
    rows = np.asarray(rows, np.float32).copy()
    rows[:, 0] = 6.0
    last = np.zeros((1, rows.shape[1]), np.float32)
    last[0, 0] = 2688
    return np.concatenate([rows, last])


# ----------------------------------------------------------------------------- statistics


def test_sr_is_unbiased_over_many_keys(impl):
    n_keys = 512
    rng = np.random.default_rng(4)
    x = _unit_scale_tensor(rng.uniform(-6, 6, (32, 16)))
    keys = jax.random.split(jax.random.key(2024), n_keys)
    draw = jax.jit(
        jax.vmap(lambda k: impl.dequantize(impl.quantize(x, stochastic_rounding=True, key=k)))
    )
    mean = np.asarray(draw(keys), np.float64).mean(axis=0)[:-1]
    d = float(np.float32(2688) * oracle.RCP2688)  # dec = s_b * D with s_b = 1
    y = x[:-1].astype(np.float64)
    step = np.where(np.abs(y) < 2, 0.5, np.where(np.abs(y) < 4, 1.0, 2.0))
    # E[q] is within step/256 of y (8 random bits); the sample mean of a two-point draw with
    # spread `step` has standard deviation <= step / (2 sqrt(n)). Allow 5 of them.
    bound = d * step * (1 / 256 + 5 / (2 * np.sqrt(n_keys))) + np.abs(y) * 2**-20
    err = np.abs(mean / d - y) * d
    assert np.all(err <= bound), f"max |bias|/bound = {np.max(err / bound):.2f}"
    # Aggregate: the mean signed error in steps is ~0 (RN would not pass the per-element test;
    # a biased SR would fail this one).
    z = np.mean((mean / d - y) / step)
    sigma = 0.5 / np.sqrt(n_keys * y.size)
    assert -1 / 256 - 5 * sigma <= z <= 5 * sigma, f"mean bias {z:.5f} steps"


def test_every_grid_value_is_reachable(impl):
    rng = np.random.default_rng(5)
    x = _unit_scale_tensor(rng.uniform(-6, 6, (128, 16)))
    vals = code_values(impl.quantize(x, stochastic_rounding=True, key=jax.random.key(11)))
    np.testing.assert_array_equal(np.unique(np.abs(vals)), GRID)
    assert np.any(vals == -1.5) and np.any(vals == 1.5)


@pytest.mark.parametrize(
    "y,lo,hi", [(1.25, 1.0, 1.5), (1.75, 1.5, 2.0), (0.25, 0.0, 0.5), (5.0, 4.0, 6.0)]
)
def test_both_neighbours_are_drawn(impl, y, lo, hi):
    x = _unit_scale_tensor(np.full((64, 16), y))
    vals = code_values(impl.quantize(x, stochastic_rounding=True, key=jax.random.key(13)))[:-1, 1:]
    assert set(np.unique(vals).tolist()) == {lo, hi}
    # Half way between two grid points: each side about half the time.
    assert 0.4 < np.mean(vals == hi) < 0.6


def test_values_on_the_grid_are_kept(impl):
    grid = np.concatenate([GRID, -GRID[1:], [0.0]])
    x = _unit_scale_tensor(np.tile(grid, (32, 1)))
    vals = code_values(impl.quantize(x, stochastic_rounding=True, key=jax.random.key(17)))[:-1, 1:]
    np.testing.assert_array_equal(vals, np.tile(grid, (32, 1))[:, 1:])


# ----------------------------------------------------------------------------- shards


@pytest.mark.parametrize("fake", [False, True], ids=["quantize", "fake_quantize"])
@pytest.mark.parametrize("offset_rows", [3, 16])
def test_seed_offset_gives_the_tail_of_the_whole_tensor(impl, fake, offset_rows):
    # Rows [r0:] quantized with an SRSeed advanced by r0 * C elements are the tail of the
    # whole tensor quantized with the plain key (the same amax).
    x = jnp.asarray(heavy_tailed((48, 64), "bf16", seed=9))
    r0, key = offset_rows, jax.random.key(7)
    amax = nvfp4_jax.tensor_amax(x, implementation="reference")
    op = impl.fake_quantize if fake else impl.quantize
    full = oracle.quantize(
        np.asarray(x),
        amax=float(amax),
        sr_bytes=oracle.sr_random_bytes(*oracle.sr_key_words(key), x.size),
    )
    for seed in (
        nvfp4_jax.SRSeed.from_key(key, element_offset=r0 * 64),  # a static offset
        jax.jit(lambda k: nvfp4_jax.SRSeed.from_key(k, element_offset=jnp.uint32(r0 * 64)))(key),
    ):
        tail = op(x[r0:], stochastic_rounding=True, key=seed, amax=amax)
        if fake:
            want = oracle.dequantize(full)[r0:].astype(np.float32)
            assert_same_bits(
                np.asarray(tail, np.float32), want.astype(tail.dtype).astype(np.float32)
            )
        else:
            assert_same_bits(tail.codes, full.packed[r0:], "codes")
            assert_same_bits(
                np.asarray(tail.scales).view(np.uint8), full.scales[r0:].view(np.uint8), "scales"
            )


def test_seed_counters_carry_into_the_high_word(impl):
    # Counters cross 2**32 inside the tensor: every implementation must carry.
    x = jnp.asarray(heavy_tailed((4, 64), "f32", seed=10))
    key = jax.random.key(7)
    offset = 2**35 - 64  # counter 2**32 - 8: the last 8 counters wrap the low word
    seed = nvfp4_jax.SRSeed.from_key(key, element_offset=offset)
    assert seed.counter_offset.tolist() == [2**32 - 8, 0]
    k0, k1 = oracle.sr_key_words(key)
    n = np.arange(x.size, dtype=np.uint64) + np.uint64(offset)
    j = n // np.uint64(8)
    w0, w1 = oracle.threefry2x32(
        k0,
        k1,
        (j >> np.uint64(32)).astype(np.uint32),
        (j & np.uint64(0xFFFFFFFF)).astype(np.uint32),
    )
    word = w0.astype(np.uint64) | (w1.astype(np.uint64) << np.uint64(32))
    random = ((word >> ((n % np.uint64(8)) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint8)
    np.testing.assert_array_equal(
        np.asarray(nvfp4_jax.reference.random_bytes(seed, x.size)), random
    )
    q = impl.quantize(x, stochastic_rounding=True, key=seed)
    assert_same_bits(q.codes, oracle.quantize(np.asarray(x), sr_bytes=random).packed, "codes")


def test_seed_rejects_offsets_off_the_block_grid():
    key = jax.random.key(0)
    for bad in (8, -16, 2**70):
        with pytest.raises(ValueError, match="multiple of 16"):
            nvfp4_jax.SRSeed.from_key(key, element_offset=bad)
    with pytest.raises(TypeError, match="element_offset"):
        nvfp4_jax.SRSeed.from_key(key, element_offset=jnp.float32(16))
    with pytest.raises(TypeError, match="PRNG key or an nvfp4_jax.SRSeed"):
        nvfp4_jax.quantize(jnp.ones((16, 16)), stochastic_rounding=True, key=jnp.ones(3))
