"""Sharded quantization on 8 CPU devices, bit for bit against one device (the public ops under
sharding and nvfp4_jax/_src/training/distributed.py).

Every test process sees 8 CPU devices (conftest.py sets the XLA flag), so these are plain
tests. Each compares a sharded computation with the same computation on one device, on the
reference and on the native CPU kernels:

* quantize under `jit` with a `NamedSharding` (rows sharded, or the quantized axis sharded
  in multiples of 16, with and without SR, RHT and 16x16 blocks): codes, scales and amax;
* quantize inside `shard_map` with the global amax, and with SR through
  `distributed.quantize_shard` (global amax and the shard's `SRSeed`);
* fake_quantize, dequantize, apply_rht, tensor_amax and non-finite inputs under `jit`;
* the compiled HLO of the native ops on a row-sharded input runs the custom call on the
  local shard: no all-gather (only scalar all-reduces for the amax);
* `quantize_master_weights` on 1-D and 2-D meshes;
* quantize under `vmap` over a sharded batch.

The jit tests run with Auto axes (shardings only on the arrays) and with Explicit axes
(`jax.make_mesh`'s default) under `jax.set_mesh` (`helpers.MESH_MODES`). The training steps
are test_distributed_training.py's; the fixtures and helpers distributed_setup.py's.
"""

from __future__ import annotations

import functools

import distributed_setup
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed_setup import AXIS, JIT_CASES, data, mesh, on_one_device, run_sharded
from helpers import (
    MESH_MODES,
    assert_same_bits,
    assert_same_q,
    make_impl,
    make_mesh,
    mesh_context,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax import (
    apply_rht,
    dequantize,
    fake_quantize,
    quantize,
    quantize_master_weights,
    tensor_amax,
)
from nvfp4_jax._src.training import distributed

# The implementations and mesh modes of the sharded tests (distributed_setup.py).
impl, mode = distributed_setup.impl, distributed_setup.mode


pytestmark = [
    pytest.mark.skipif(jax.device_count("cpu") < 8, reason="needs 8 CPU devices"),
    pytest.mark.distributed,
]


@pytest.mark.parametrize("case", list(JIT_CASES))
def test_quantize_jit_sharded(impl, case, mode):
    shape, spec, kw = JIT_CASES[case]
    x = data(shape)
    if case.endswith("bf16"):
        x = x.astype(jnp.bfloat16)

    def run(x, key):
        return quantize(x, key=key, implementation=impl.implementation, **kw)

    key = jax.random.key(3)
    expected = jax.jit(run)(*on_one_device(x, key))
    q = run_sharded(run, mode, jax.device_put(x, NamedSharding(mesh(mode), spec)), key)
    assert_same_q(q, expected, case)


def other_ops(implementation):
    """name -> fn(x, key) of the ops other than quantize."""
    return {
        "fake_quantize_sr": lambda x, k: fake_quantize(
            x, stochastic_rounding=True, key=k, implementation=implementation
        ),
        "fake_quantize_rht_2d_bf16_out": lambda x, k: fake_quantize(
            x, rht=True, block_2d=True, dtype=jnp.bfloat16, implementation=implementation
        ),
        "fake_quantize_no_global_scale": lambda x, k: fake_quantize(
            x, global_scale=False, implementation=implementation
        ),
        "dequantize_rht": lambda x, k: dequantize(
            quantize(x, rht=True, implementation=implementation), implementation=implementation
        ),
        "apply_rht": lambda x, k: apply_rht(x, implementation=implementation),
        "tensor_amax_rht": lambda x, k: tensor_amax(x, rht=True, implementation=implementation),
        "quantize_caller_amax": lambda x, k: quantize(
            x, amax=jnp.float32(3), implementation=implementation
        ),
        "fake_quantize_caller_amax": lambda x, k: fake_quantize(
            x, amax=jnp.float32(3), implementation=implementation
        ),
    }


# name -> (mesh shape, axis names, spec): shards holding fewer than 16 values of the last axis.
SMALL_SHARDS = {
    "8_per_shard": ((8,), ("x",), P(None, "x")),
    "8_per_shard_two_axes": ((2, 4), ("a", "b"), P(None, ("a", "b"))),
    "rows_and_4_per_shard": ((2, 4), ("a", "b"), P("a", "b")),
}


@pytest.mark.newest
@pytest.mark.parametrize("mode", MESH_MODES)
@pytest.mark.parametrize("layout", list(SMALL_SHARDS))
@pytest.mark.parametrize("op", [*other_ops("reference"), "quantize_sr_4over6"])
def test_ops_on_shards_smaller_than_a_block(impl, op, layout, mode):
    """Every op gathers what a shard cannot quantize alone: one device's bits, any mesh."""
    shape, names, spec = SMALL_SHARDS[layout]
    mesh_ = make_mesh(shape, names, mode)
    x = data((16, 64) if layout != "rows_and_4_per_shard" else (32, 16), seed=4)
    ops = other_ops(impl.implementation)
    ops["quantize_sr_4over6"] = lambda x, k: quantize(
        x, stochastic_rounding=True, key=k, four_over_six="mse", implementation=impl.implementation
    )
    fn, key = ops[op], jax.random.key(6)
    expected = jax.jit(fn)(*on_one_device(x, key))
    with mesh_context(mesh_, mode):
        actual = jax.jit(fn)(jax.device_put(x, NamedSharding(mesh_, spec)), key)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert_same_bits(a, e, op)


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf_in_one_shard"])
@pytest.mark.parametrize("op", list(other_ops("reference")))
def test_other_ops_jit_sharded(impl, op, finite, mode):
    if mode == "explicit" and not finite and op.startswith("fake"):
        pytest.skip("the same rule as quantize's non-finite case, run under Explicit axes there")
    x = data((128, 64), seed=2)
    if not finite:
        x = x.at[37, 5].set(jnp.inf)
    fn, key = other_ops(impl.implementation)[op], jax.random.key(5)
    expected = jax.jit(fn)(*on_one_device(x, key))
    actual = run_sharded(fn, mode, jax.device_put(x, NamedSharding(mesh(mode), P(AXIS, None))), key)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert_same_bits(a, e, op)


# --- the native custom calls run on local shards (no all-gather in the compiled HLO) ---------

# name -> (target, function of the row-sharded input)
HLO_CASES = {
    "amax": ("nvfp4_amax", lambda x: tensor_amax(x, rht=True, implementation="ffi")),
    "quantize": ("nvfp4_quantize", lambda x: quantize(x, implementation="ffi").codes),
    "quantize_sr_2d": (
        "nvfp4_quantize",
        lambda x: (
            quantize(
                x,
                block_2d=True,
                stochastic_rounding=True,
                key=jax.random.key(0),
                implementation="ffi",
            ).codes
        ),
    ),
    "fake_quantize_rht_sr": (
        "nvfp4_fake_quantize",
        lambda x: fake_quantize(
            x, rht=True, stochastic_rounding=True, key=jax.random.key(0), implementation="ffi"
        ),
    ),
    "dequantize": (
        "nvfp4_dequantize",
        lambda x: dequantize(quantize(x, rht=True, implementation="ffi"), implementation="ffi"),
    ),
    "apply_rht": ("nvfp4_rht", lambda x: apply_rht(x, implementation="ffi")),
    "quantize_axis0": ("nvfp4_quantize", lambda x: quantize(x, axis=0, implementation="ffi").codes),
}


@pytest.mark.parametrize("hlo_mode", ["auto", "explicit"])
@pytest.mark.parametrize("case", list(HLO_CASES))
def test_native_ops_run_on_local_shards_without_all_gather(case, hlo_mode):
    make_impl("cpu")
    target, fn = HLO_CASES[case]
    x = jax.device_put(data((128, 64), seed=3), NamedSharding(mesh(hlo_mode), P(AXIS, None)))
    with mesh_context(mesh(hlo_mode), hlo_mode):
        text = jax.jit(fn).lower(x).compile().as_text()
    calls = [line for line in text.splitlines() if f'custom_call_target="{target}"' in line]
    assert calls, f"no custom call {target} in the compiled HLO"
    # The custom call must see the local shard (16 of 128 rows), and nothing gathered.
    assert any("[16,64]" in line or "[64,16]" in line for line in calls), calls
    gathers = [line.strip()[:300] for line in text.splitlines() if "all-gather(" in line]
    assert not gathers, gathers


# --- quantize inside shard_map with a global amax -------------------------------------------

# name -> (shape, spec of the input, spec of codes and scales (stored layout), kwargs)
SHARD_MAP_CASES = {
    "rows_sharded_1x16": ((128, 64), P(AXIS, None), P(AXIS, None), {}),
    "quantized_axis_sharded_1x16": ((64, 128), P(None, AXIS), P(None, AXIS), {}),
    "quantized_axis_sharded_rht": ((64, 128), P(None, AXIS), P(None, AXIS), {"rht": True}),
    "rows_sharded_2d": ((128, 64), P(AXIS, None), P(AXIS, None), {"block_2d": True}),
}


@pytest.mark.parametrize("case", list(SHARD_MAP_CASES))
def test_quantize_shard_map_global_amax(impl, case):
    shape, in_spec, out_spec, kw = SHARD_MAP_CASES[case]
    x = data(shape, seed=1)
    implementation = impl.implementation

    def local(x_shard):
        amax = distributed.global_amax(
            x_shard, AXIS, rht=kw.get("rht", False), implementation=implementation
        )
        q = quantize(x_shard, amax=amax, implementation=implementation, **kw)
        return q.codes, q.scales, q.amax[None]  # every shard's amax, to compare all

    sharded = jax.jit(
        jax.shard_map(local, mesh=mesh(), in_specs=in_spec, out_specs=(out_spec, out_spec, P(AXIS)))
    )
    codes, scales, amax = sharded(jax.device_put(x, NamedSharding(mesh(), in_spec)))
    expected = jax.jit(functools.partial(quantize, implementation=implementation, **kw))(
        *on_one_device(x)
    )
    assert_same_bits(codes, expected.codes, "codes")
    assert_same_bits(scales, expected.scales, "scales")
    for shard_amax in amax:
        assert_same_bits(shard_amax, expected.amax, "amax")


# name -> (shape, spec of the input = spec of codes and scales, kwargs)
SHARD_MAP_SR_CASES = {
    "rows_sharded_sr": ((128, 64), P(AXIS, None), {}),
    "rows_sharded_rht_sr_bf16": ((128, 64), P(AXIS, None), {"rht": True}),
    "rows_sharded_2d_sr": ((128, 64), P(AXIS, None), {"block_2d": True}),
    "rows_sharded_3d_sr": ((16, 4, 64), P(AXIS, None, None), {}),
    "axis0_sr": ((64, 128), P(None, AXIS), {"axis": 0}),  # stored (128, 64): rows sharded
}


@pytest.mark.parametrize("case", list(SHARD_MAP_SR_CASES))
def test_quantize_shard_map_sr(impl, case):
    shape, spec, kw = SHARD_MAP_SR_CASES[case]
    x = data(shape, seed=4)
    if case.endswith("bf16"):
        x = x.astype(jnp.bfloat16)
    stored_spec = spec if kw.get("axis", -1) == -1 else P(spec[1], spec[0])
    flags = dict(stochastic_rounding=True, implementation=impl.implementation, **kw)

    def local(x_shard, key):
        q = distributed.quantize_shard(x_shard, axis_names=AXIS, key=key, **flags)
        values = distributed.fake_quantize_shard(x_shard, axis_names=AXIS, key=key, **flags)
        return q.codes, q.scales, q.amax[None], values

    sharded = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh(),
            in_specs=(spec, P()),
            out_specs=(stored_spec, stored_spec, P(AXIS), spec),
        )
    )
    key = jax.random.key(9)
    codes, scales, amax, values = sharded(jax.device_put(x, NamedSharding(mesh(), spec)), key)

    def unsharded(x, key):
        return quantize(x, key=key, **flags), fake_quantize(x, key=key, **flags)

    expected, expected_values = jax.jit(unsharded)(*on_one_device(x, key))
    assert_same_bits(codes, expected.codes, "codes")
    assert_same_bits(scales, expected.scales, "scales")
    assert_same_bits(values, expected_values, "fake_quantize")
    for shard_amax in amax:
        assert_same_bits(shard_amax, expected.amax, "amax")


# --- master weights ---------------------------------------------------------------------------

# name -> (weight spec, quantized axis, block_2d, mesh shape)
MASTER_CASES = {
    "rows_1d": (P("x", None), -1, False, (8,)),
    "cols_1d": (P(None, "x"), -1, False, (8,)),
    "rows_2d_blocks": (P("x", None), -1, True, (8,)),
    "cols_2d_blocks_axis0": (P(None, "x"), 0, True, (8,)),
    "both_axes_2d_blocks": (P("x", "y"), -1, True, (4, 2)),
    # NaN on one device: the whole tensor is NaN on every device, as unsharded (section 8).
    "nan_on_one_shard": (P("x", None), -1, False, (8,)),
}


@pytest.mark.parametrize("case", list(MASTER_CASES))
def test_master_weights_sharded_equal_unsharded(impl, case):
    spec, axis, block_2d, mesh_shape = MASTER_CASES[case]
    names = ("x", "y")[: len(mesh_shape)]
    mesh_ = jax.make_mesh(
        mesh_shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices("cpu")
    )
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 512)) * rng.lognormal(0, 1.5, (256, 1))
    w[3, 7] = 900.0  # the global amax lives on one device only
    if case == "nan_on_one_shard":
        w[200, 5] = np.nan
    w = jnp.asarray(w, jnp.float32)
    flags = dict(axis=axis, block_2d=block_2d, implementation=impl.implementation)
    sharded = jax.device_put(w, NamedSharding(mesh_, spec))
    q = jax.jit(lambda a: quantize_master_weights(a, mesh=mesh_, spec=spec, **flags))(sharded)
    expected = quantize(*on_one_device(w), **flags)
    assert_same_q(q, expected, case)
    for part in ("codes", "scales"):
        leaf = getattr(q, part)
        assert len(leaf.sharding.device_set) == 8, leaf.sharding
        assert leaf.addressable_shards[0].data.size < leaf.size, f"{part} is not sharded"


def test_master_weights_reject_blocks_across_devices():
    mesh_ = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu"))
    # 136 columns over 8 shards: 17 each, so blocks of 16 would straddle devices.
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_master_weights(jnp.ones((32, 136)), mesh=mesh_, spec=P(None, "x"))
    # 2D blocks also need whole 16-row tiles per shard: 64 rows over 8 shards is 8 each.
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_master_weights(jnp.ones((64, 128)), mesh=mesh_, spec=P("x", None), block_2d=True)


def test_master_weights_on_one_device_equal_quantize():
    mesh_ = jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1])
    w = data((32, 64))
    q = quantize_master_weights(w, mesh=mesh_, spec=P(None, "x"))
    assert_same_q(q, quantize(w))


def test_shard_map_result_that_differs_between_shards_is_caught(impl):
    """An op whose result is per-shard cannot be returned as replicated (out_specs=P())."""
    x = data((128, 64))

    def local(x_shard):
        return tensor_amax(x_shard, implementation=impl.implementation)

    with pytest.raises(Exception, match="(?i)replicat|vary|varying"):
        jax.jit(jax.shard_map(local, mesh=mesh(), in_specs=P(AXIS, None), out_specs=P()))(
            jax.device_put(x, NamedSharding(mesh(), P(AXIS, None)))
        )


@pytest.mark.parametrize("sr", [False, True], ids=["rn", "sr"])
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_vmap_over_a_sharded_batch(impl, mode, sr):
    """`jax.vmap` of quantize over a batch sharded over the mesh: each element as unsharded."""
    x = data((8, 32, 64), seed=9)
    key = jax.random.key(1) if sr else None

    def one(a):
        return quantize(a, stochastic_rounding=sr, key=key, implementation=impl.implementation)

    expected = jax.jit(jax.vmap(one))(*on_one_device(x))
    q = run_sharded(jax.vmap(one), mode, jax.device_put(x, NamedSharding(mesh(mode), P(AXIS))))
    assert_same_q(q, expected, f"{mode} vmap")
