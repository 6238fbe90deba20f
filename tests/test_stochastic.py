"""Stochastic rounding (NUMERICS section 7): Threefry bits, determinism, unbiasedness, reach."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numerics_oracle as oracle
import numpy as np
import pytest
from conftest import heavy_tailed
from jax.extend.random import threefry_2x32

import nvfp4_jax

GRID = oracle.E2M1_VALUES


def eager_sr_quantize(x, key, **kw):
    return nvfp4_jax.quantize(
        jnp.asarray(x), stochastic_rounding=True, key=key, implementation="reference", **kw
    )


@functools.cache
def _jit_sr_quantize(static: tuple):
    return jax.jit(lambda x, key: eager_sr_quantize(x, key, **dict(static)))


def sr_quantize(x, key, **static):
    """The reference under jit, one compilation per configuration (faster than eager)."""
    return _jit_sr_quantize(tuple(sorted(static.items())))(jnp.asarray(x), key)


def ref_dequantize(q):
    return nvfp4_jax.dequantize(q, implementation="reference")


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
def test_sr_bits_match_oracle(case, seed):
    cfg = dict(SR_CASES[case])
    shape, dtype = cfg.pop("shape"), cfg.pop("dtype")
    x = heavy_tailed(shape, dtype, seed=seed + len(case), row_axis=cfg.get("axis", -1))
    key = jax.random.key(seed)
    q = sr_quantize(x, key, **cfg)
    k0, k1 = oracle.sr_key_words(key)
    o = oracle.quantize(x, sr_bytes=oracle.sr_random_bytes(k0, k1, x.size), **cfg)
    np.testing.assert_array_equal(np.asarray(q.codes), o.packed)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), o.scales.view(np.uint8))
    assert np.asarray(q.amax).view(np.uint32) == np.float32(o.amax).view(np.uint32)


def test_sr_key_words_come_from_random_bits():
    # Legacy uint32 keys and new-style typed keys both seed through jax.random.bits.
    x = heavy_tailed((16, 64), "f32", seed=1)
    for key in (jax.random.PRNGKey(5), jax.random.key(5)):
        k0, k1 = (int(w) for w in np.asarray(jax.random.bits(key, (2,), jnp.uint32)))
        o = oracle.quantize(x, sr_bytes=oracle.sr_random_bytes(k0, k1, x.size))
        np.testing.assert_array_equal(np.asarray(sr_quantize(x, key).codes), o.packed)


# ----------------------------------------------------------------------------- determinism


def test_same_key_same_bits_different_keys_differ():
    x = heavy_tailed((32, 128), "bf16", seed=2)
    a = sr_quantize(x, jax.random.key(1))
    b = sr_quantize(x, jax.random.key(1))
    c = sr_quantize(x, jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    differ = np.mean(code_values(a) != code_values(c))
    # Scales and amax do not depend on the key; only the rounding does.
    scales_a, scales_c = (np.asarray(v.scales).view(np.uint8) for v in (a, c))
    np.testing.assert_array_equal(scales_a, scales_c)
    assert differ > 0.2, f"two keys should round independently; only {differ:.1%} differ"


def test_sr_result_is_a_grid_neighbour():
    # y = x exactly (tensor amax 2688 -> S_enc = 1; block amax 6 -> s_b = 1, enc = 1).
    x = _unit_scale_tensor(np.random.default_rng(3).uniform(-6, 6, (64, 16)))
    vals = code_values(sr_quantize(x, jax.random.key(9)))[:-1]
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


def test_sr_is_unbiased_over_many_keys():
    n_keys = 512
    rng = np.random.default_rng(4)
    x = _unit_scale_tensor(rng.uniform(-6, 6, (32, 16)))
    keys = jax.random.split(jax.random.key(2024), n_keys)
    draw = jax.jit(jax.vmap(lambda k: ref_dequantize(sr_quantize(x, k))))
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


def test_every_grid_value_is_reachable():
    rng = np.random.default_rng(5)
    x = _unit_scale_tensor(rng.uniform(-6, 6, (128, 16)))
    vals = code_values(sr_quantize(x, jax.random.key(11)))
    np.testing.assert_array_equal(np.unique(np.abs(vals)), GRID)
    assert np.any(vals == -1.5) and np.any(vals == 1.5)


@pytest.mark.parametrize(
    "y,lo,hi", [(1.25, 1.0, 1.5), (1.75, 1.5, 2.0), (0.25, 0.0, 0.5), (5.0, 4.0, 6.0)]
)
def test_both_neighbours_are_drawn(y, lo, hi):
    x = _unit_scale_tensor(np.full((64, 16), y))
    vals = code_values(sr_quantize(x, jax.random.key(13)))[:-1, 1:]
    assert set(np.unique(vals).tolist()) == {lo, hi}
    # Half way between two grid points: each side about half the time.
    assert 0.4 < np.mean(vals == hi) < 0.6


def test_values_on_the_grid_are_kept():
    grid = np.concatenate([GRID, -GRID[1:], [0.0]])
    x = _unit_scale_tensor(np.tile(grid, (32, 1)))
    vals = code_values(sr_quantize(x, jax.random.key(17)))[:-1, 1:]
    np.testing.assert_array_equal(vals, np.tile(grid, (32, 1))[:, 1:])
