"""MS-EDEN (docs/NUMERICS.md section 14) on every implementation: the oracle's bits, one key's
bits under jit, vmap, sharding and shard_map, the errors of the other ops, the derivative.

The statistical properties (error, unbiasedness) are tests/core/test_ms_eden_statistics.py.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numerics_oracle as oracle
import numpy as np
import pytest
from helpers import (
    MESH_MODES,
    assert_same_bits,
    assert_same_q,
    heavy_tailed,
    make_impl,
    make_mesh,
    mesh_context,
    np_dtype,
    with_underflow_block,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax
from nvfp4_jax import reference

KEY, ROTATION = jax.random.key(21), jax.random.key(22)


def run(impl, x, *, key=KEY, rotation=ROTATION, fake=False, place=True, **options):
    """`nvfp4_jax.quantize` (or `fake_quantize`) with MS-EDEN on `impl`, under jit.

    `x` is put on the implementation's device unless `place` is False (sharded input).
    """
    x = jax.device_put(jnp.asarray(x), impl.device) if place else x
    return _jitted(impl.implementation, fake, tuple(sorted(options.items())))(x, key, rotation)


@functools.cache
def _jitted(implementation, fake, options):
    op = nvfp4_jax.fake_quantize if fake else nvfp4_jax.quantize
    kw = dict(options)
    amax = kw.pop("amax", None)
    return jax.jit(
        lambda x, key, rotation: op(
            x, ms_eden=True, key=key, rotation_key=rotation, amax=amax,
            implementation=implementation, **kw,
        )
    )  # fmt: skip


def expected(x, *, key=KEY, rotation=ROTATION, axis=-1, amax=None):
    words = np.asarray(reference.rotation_words(rotation))
    return oracle.ms_eden_quantize(x, oracle.sr_key_words(key), words, axis=axis, amax=amax)


def assert_oracle_q(q, o, what=""):
    assert_same_bits(q.codes, o.packed, f"{what} codes")
    assert_same_bits(np.asarray(q.scales).view(np.uint8), o.scales.view(np.uint8), f"{what} scales")
    assert np.float32(q.amax).tobytes() == np.float32(o.amax).tobytes(), f"{what} amax"
    decode = np.float32(o.amax * oracle.MS_EDEN_RCPC)
    assert np.float32(q.decode_scale).tobytes() == decode.tobytes(), f"{what} decode scale"


# --- the oracle's bits -------------------------------------------------------------------------

CASES = {
    "bf16_m8_k256": dict(shape=(8, 256), dtype="bf16"),
    "f32_ax0_m256_k48": dict(shape=(256, 48), dtype="f32", axis=0),
    "f16_3d_b2_m3_k128": dict(shape=(2, 3, 128), dtype="f16"),
    "bf16_underflow_m4_k384": dict(shape=(4, 384), dtype="bf16", underflow=True),
    "f32_amax_below_m4_k128": dict(shape=(4, 128), dtype="f32", amax=0.5),
    "f32_amax_above_m4_k128": dict(shape=(4, 128), dtype="f32", amax=1e3),
    "f32_zeros_m2_k128": dict(shape=(2, 128), dtype="f32", zeros=True),
}


def case_data(name):
    cfg = dict(CASES[name])
    shape, dtype = cfg.pop("shape"), cfg.pop("dtype")
    x = heavy_tailed(shape, dtype, seed=len(name), row_axis=cfg.get("axis", -1))
    if cfg.pop("underflow", False):
        x = with_underflow_block(x, row=1, block=3)
    if cfg.pop("zeros", False):
        x = np.zeros(shape, np_dtype(dtype))
    return x, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_quantize_matches_the_oracle(impl, case):
    x, cfg = case_data(case)
    assert_oracle_q(run(impl, x, **cfg), expected(x, **cfg), case)


@pytest.mark.parametrize("case", ["bf16_m8_k256", "f32_ax0_m256_k48", "bf16_underflow_m4_k384"])
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_fake_quantize_is_the_dequantized_tensor(impl, case, out):
    x, cfg = case_data(case)
    o = expected(x, **cfg)
    axis = cfg.get("axis", -1)
    values = run(impl, x, fake=True, dtype=np_dtype(out), **cfg)
    want = np.moveaxis(o.dequant_stored, -1, axis).astype(np_dtype(out))
    assert_same_bits(values, want, "fake_quantize")
    # Without the tensor factor: value(code) * f32(s_b), exact.
    bare = run(impl, x, fake=True, global_scale=False, dtype=jnp.float32, **cfg)
    blocks = oracle.e2m1_value(o.codes) * np.repeat(o.scales.astype(np.float32), 16, axis=-1)
    assert_same_bits(bare, np.moveaxis(blocks, -1, axis), "fake_quantize without D")
    q = run(impl, x, **cfg)
    assert_same_bits(q.dequantize(np_dtype(out)), want, "dequantize")


def test_the_rotation_words_come_from_random_bits():
    words = np.asarray(jax.random.bits(ROTATION, (4,), jnp.uint32))
    assert_same_bits(reference.rotation_words(ROTATION), words)
    signs = oracle.ms_eden_signs(words)
    assert set(np.unique(signs)) == {-1.0, 1.0}
    x = heavy_tailed((3, 256), "f32", seed=1)
    assert_same_bits(reference.apply_rotation(x, words), oracle.ms_eden_rotate(x, words))


def test_the_rotation_is_orthogonal_and_shared_rotations_cancel():
    words = reference.rotation_words(ROTATION)
    a, b = heavy_tailed((32, 256), "f32", seed=2), heavy_tailed((16, 256), "f32", seed=3)
    back = reference.apply_rotation(reference.apply_rotation(a, words), words, inverse=True)
    np.testing.assert_allclose(back, a, rtol=0, atol=1e-5 * np.max(np.abs(a)))
    product = reference.apply_rotation(a, words) @ reference.apply_rotation(b, words).T
    np.testing.assert_allclose(product, a @ b.T, rtol=0, atol=1e-4 * np.max(np.abs(a @ b.T)))


@pytest.mark.parametrize(
    "target,u,lo,hi",
    [
        (1.03, 0.0, 1.0, 1.125),  # u = 0 goes up whenever the target is above lo
        (1.03, 1 - 2.0**-24, 1.0, 1.125),  # the largest u stays down below the top
        (1.0, 0.0, 1.0, 1.125),  # an E4M3 value is kept
        (448.0, 0.0, 448.0, 448.0),  # 448 has no value above it
        (0.001, 0.5, 0.0, 0.001953125),  # below the smallest subnormal
    ],
)
def test_round_scale_picks_a_neighbour(target, u, lo, hi):
    byte = reference.round_scale(jnp.float32(target), jnp.float32(u))
    value = float(jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(jnp.float32))
    up = u * (hi - lo) < target - lo
    assert value == (hi if up else lo)


# --- one key, one result ------------------------------------------------------------------------


def test_each_source_of_randomness_changes_the_result(impl):
    x = heavy_tailed((16, 256), "bf16", seed=4)
    a, b = run(impl, x), run(impl, x)
    assert_same_q(a, b, "same keys")
    other_key = run(impl, x, key=jax.random.key(99))
    other_rotation = run(impl, x, rotation=jax.random.key(98))
    # The key draws only the scales' rounding: the codes stay, some scales move.
    assert_same_bits(other_key.codes, a.codes, "codes under another key")
    scales = [np.asarray(q.scales).view(np.uint8) for q in (a, other_key)]
    assert 0.2 < np.mean(scales[0] != scales[1]) < 0.8
    # The rotation changes the rotated tensor itself.
    assert np.mean(np.asarray(other_rotation.codes) != np.asarray(a.codes)) > 0.5


def test_eager_jit_and_vmap_give_one_bits(impl):
    x = heavy_tailed((4, 8, 128), "bf16", seed=5)
    keys = jax.random.split(KEY, 4)
    opts = dict(ms_eden=True, rotation_key=ROTATION, implementation=impl.implementation)
    with jax.default_device(impl.device):
        eager = [nvfp4_jax.quantize(jnp.asarray(x[i]), key=keys[i], **opts) for i in range(4)]
        batched = jax.jit(jax.vmap(lambda v, k: nvfp4_jax.quantize(v, key=k, **opts)))(x, keys)
    for i in range(4):
        assert_oracle_q(eager[i], expected(x[i], key=keys[i]), f"eager {i}")
        assert_same_bits(batched.codes[i], eager[i].codes, f"vmap codes {i}")
        assert_same_bits(batched.scales[i], eager[i].scales, f"vmap scales {i}")
        assert_same_bits(batched.decode_scale[i], eager[i].decode_scale, f"vmap decode {i}")


# Set in the process `_run_isolated` starts.
_ISOLATED = "NVFP4_TEST_ISOLATED"


def _run_isolated(nodeid: str) -> None:
    """Runs one test in a fresh pytest process; fails with its output if it fails."""
    env = dict(os.environ, **{_ISOLATED: "1"})
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", nodeid]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{nodeid} in its own process:\n{result.stdout[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MESH_MODES)
@pytest.mark.parametrize("name", ["reference", "cpu"])
@pytest.mark.parametrize("spec", [P("d", None), P(None, "d"), P("d")], ids=["rows", "cols", "1d"])
def test_sharded_input_gives_the_one_device_bits(request, name, mode, spec):
    if not os.environ.get(_ISOLATED):
        # In a process of its own: three times in a full run (2026-11-29) a test worker that
        # had run hundreds of other tests died of a segfault inside XLA while compiling this
        # program (twice in XLA's compile, once serializing it for the compilation cache),
        # the native kernels' case and then, with that one isolated, the pure-jnp
        # reference's: XLA's, not the kernels' (which ran clean under AddressSanitizer,
        # tests/core whole in one process); never in a fresh process. The bits are checked
        # all the same.
        _run_isolated(request.node.nodeid)
        return
    impl = make_impl(name)
    mesh = make_mesh((8,), ("d",), mode)
    x = heavy_tailed((64, 256) if len(spec) == 2 else (2048,), "bf16", seed=6)
    placed = jax.device_put(x, NamedSharding(mesh, spec))
    with mesh_context(mesh, mode):
        q = run(impl, placed, place=False)
        values = run(impl, placed, place=False, fake=True, dtype=jnp.float32)
    o = expected(x)
    assert_oracle_q(q, o, f"sharded {mode}")
    assert_same_bits(values, o.dequant_stored, f"sharded fake {mode}")


def test_shard_map_with_seed_offsets_gives_the_whole_tensor(impl):
    # Rows quantized on 4 shards, each with the global amax and its SRSeed advanced to its
    # first element, are the whole tensor's bits: the block uniforms follow the global index.
    mesh = make_mesh((4,), ("d",))
    x = jnp.asarray(heavy_tailed((32, 256), "f32", seed=7))
    amax = nvfp4_jax.tensor_amax(x, rotation_key=ROTATION, implementation="reference")
    rows = x.shape[0] // 4

    def shard(v):
        offset = jax.lax.axis_index("d").astype(jnp.uint32) * jnp.uint32(rows * 256)
        seed = nvfp4_jax.SRSeed.from_key(KEY, element_offset=offset)
        q = nvfp4_jax.quantize(
            v, ms_eden=True, key=seed, rotation_key=reference.rotation_words(ROTATION),
            amax=amax, implementation=impl.implementation,
        )  # fmt: skip
        return q.codes, q.scales

    if impl.name == "cuda":
        pytest.skip("the CPU mesh of this test has no GPU devices")
    codes, scales = jax.jit(
        jax.shard_map(shard, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d")))
    )(x)
    o = expected(np.asarray(x))
    assert_same_bits(codes, o.packed, "codes")
    assert_same_bits(np.asarray(scales).view(np.uint8), o.scales.view(np.uint8), "scales")


def test_tensor_amax_of_the_rotation(impl):
    x = heavy_tailed((4, 256), "bf16", seed=8)
    with jax.default_device(impl.device):
        got = nvfp4_jax.tensor_amax(
            jnp.asarray(x), rotation_key=ROTATION, implementation=impl.implementation
        )
    assert np.float32(got).tobytes() == np.float32(expected(x).amax).tobytes()


# --- bad input --------------------------------------------------------------------------------

BAD_CALLS = [
    ("axis_not_128", dict(shape=(4, 64)), ValueError, "not a multiple of 128"),
    ("axis0_not_128", dict(shape=(64, 128), axis=0), ValueError, r"axis=-2\) .* size 64"),
    ("no_key", dict(key=None), ValueError, "ms_eden=True needs a PRNG key"),
    ("no_rotation", dict(rotation_key=None), ValueError, "needs rotation_key"),
    ("rotation_f32", dict(rotation_key=jnp.zeros(4)), TypeError, "rotation_key must be"),
    ("rotation_words_5", dict(rotation_key=jnp.zeros(5, jnp.uint32)), TypeError, "uint32"),
    ("keys_2", dict(rotation_key=jax.random.split(KEY)), ValueError, "one PRNG key"),
    ("with_rht", dict(rht=True), ValueError, r"cannot be combined with rht=True"),
    ("with_sr", dict(stochastic_rounding=True), ValueError, "stochastic_rounding=True"),
    ("with_2d", dict(block_2d=True), ValueError, "block_2d=True"),
    ("with_4over6", dict(four_over_six="mse"), ValueError, "four_over_six='mse'"),
    ("ms_eden_int", dict(ms_eden=1), TypeError, "ms_eden must be a bool"),
    ("amax_nan", dict(amax=jnp.float32(jnp.nan)), ValueError, "amax must be a finite"),
    ("x_int", dict(dtype=np.int32), TypeError, "x must be bfloat16, float16 or float32"),
]


@pytest.mark.parametrize("op", ["quantize", "fake_quantize"])
@pytest.mark.parametrize(
    "args,error,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_is_rejected(impl, op, args, error, match):
    args = dict(args)
    x = np.ones(args.pop("shape", (4, 128)), args.pop("dtype", np.float32))
    kw = dict(ms_eden=True, key=KEY, rotation_key=ROTATION, implementation=impl.implementation)
    kw.update(args)
    with pytest.raises(error, match=f"^{op}: .*{match}"):
        getattr(nvfp4_jax, op)(x, **kw)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_input_gives_the_nan_tensor(impl, bad):
    x = heavy_tailed((8, 256), "f32", seed=9)
    x[5, 77] = bad
    q = run(impl, x)
    assert np.isnan(float(q.amax)) and np.isnan(float(q.decode_scale))
    assert np.all(np.asarray(q.scales).view(np.uint8) == 0x7F)
    assert not np.asarray(q.codes).any()
    assert np.all(np.isnan(np.asarray(run(impl, x, fake=True))))


def test_zero_size_input(impl):
    q = run(impl, np.zeros((0, 128), np.float32))
    assert q.codes.shape == (0, 64) and float(q.amax) == 0


# --- the derivative ----------------------------------------------------------------------------


def test_fake_quantize_gradient_is_the_rotation(impl):
    # The straight-through estimator: d sum(c * fq(x)) / dx = c @ R^T, R the rotation; with a
    # caller's amax, zero where the rotated value clips; without the global scale, times S_enc.
    x = jnp.asarray(heavy_tailed((4, 256), "f32", seed=10))
    c = jnp.asarray(heavy_tailed((4, 256), "f32", seed=11))
    words = reference.rotation_words(ROTATION)
    opts = dict(ms_eden=True, key=KEY, rotation_key=ROTATION, implementation=impl.implementation)

    def loss(v, **kw):
        return jnp.sum(c * nvfp4_jax.fake_quantize(v, **opts, **kw))

    with jax.default_device(impl.device):
        grad = jax.grad(loss)(x)
        y = reference.apply_rotation(x, words)
        amax = 0.5 * jnp.max(jnp.abs(y))
        clipped = jax.grad(functools.partial(loss, amax=amax))(x)
        bare = jax.grad(functools.partial(loss, global_scale=False))(x)
    want = jax.vjp(lambda v: reference.apply_rotation(v, words), x)[1](c)[0]
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)
    kept = jnp.where(jnp.abs(y) <= amax, c, 0)
    want_clipped = jax.vjp(lambda v: reference.apply_rotation(v, words), x)[1](kept)[0]
    np.testing.assert_allclose(clipped, want_clipped, rtol=1e-6, atol=1e-6)
    s_enc = reference.ms_eden_encode_scale(jnp.max(jnp.abs(y)))
    # The factor is applied before the transposed rotation: the same up to f32 rounding.
    scale = float(jnp.max(jnp.abs(want * s_enc)))
    np.testing.assert_allclose(bare, want * s_enc, rtol=0, atol=1e-5 * scale)
