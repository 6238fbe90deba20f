"""Sharded quantization and training on 8 CPU devices, bit for bit against one device.

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
* a training step of a 2-layer NVFP4 MLP, data-parallel and FSDP-style: loss and gradients;
* `quantize_master_weights` on 1-D and 2-D meshes.

The jit tests run with Auto axes (shardings only on the arrays) and with Explicit axes
(`jax.make_mesh`'s default) under `jax.set_mesh`, where the shardings are in the types;
the training step also with Auto axes under `jax.set_mesh` (`helpers.MESH_MODES`).
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    DENSE,
    MESH_MODES,
    assert_same_bits,
    assert_same_q,
    make_impl,
    make_mesh,
    mesh_context,
    skip_where_xla_sums_follow_the_program,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax
from nvfp4_jax import (
    NVFP4Recipe,
    apply_rht,
    dequantize,
    dot_general,
    fake_quantize,
    nvfp4_dot_general,
    quantize,
    quantize_master_weights,
    tensor_amax,
)
from nvfp4_jax._src.flax import linen as nvfp4_linen
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.training import distributed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import lm_model

AXIS = "x"

pytestmark = [
    pytest.mark.skipif(jax.device_count("cpu") < 8, reason="needs 8 CPU devices"),
    pytest.mark.distributed,
]


@pytest.fixture(params=["reference", "cpu"])
def impl(request):
    """The implementations that run on the 8 CPU devices."""
    return make_impl(request.param)


def mesh(mode: str = "auto"):
    return make_mesh((8,), (AXIS,), mode)


@pytest.fixture(params=["auto", "explicit"])
def mode(request) -> str:
    """How the sharded computation uses its mesh: Auto axes, or Explicit under set_mesh."""
    return request.param


def run_sharded(fn, mode, *args):
    """`jax.jit(fn)(*args)` with the mesh used as `mode` says (args already placed on it)."""
    with mesh_context(mesh(mode), mode):
        return jax.jit(fn)(*args)


def on_one_device(*arrays):
    return [jax.device_put(a, jax.devices("cpu")[0]) for a in arrays]


def data(shape, seed=0):
    """Normal times a lognormal factor per row, so blocks and shards have different amaxes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * rng.lognormal(0.0, 1.5, (shape[0],) + (1,) * (len(shape) - 1))
    return jnp.asarray(x.astype(np.float32))


# --- quantize under jit with NamedSharding ------------------------------------------------

# name -> (shape, partition spec of the input, quantize kwargs)
JIT_CASES = {
    "rows_sharded_1x16": ((128, 64), P(AXIS, None), {"axis": -1}),
    "quantized_axis_sharded_1x16": ((64, 128), P(None, AXIS), {"axis": -1}),
    "quantized_axis_sharded_axis0": ((128, 64), P(AXIS, None), {"axis": 0}),
    "rows_sharded_2d": ((128, 64), P(AXIS, None), {"axis": -1, "block_2d": True}),
    "quantized_axis_sharded_rht": ((128, 64), P(AXIS, None), {"axis": 0, "rht": True}),
    "rows_sharded_sr": ((128, 64), P(AXIS, None), {"axis": -1, "stochastic_rounding": True}),
    "rows_sharded_rht_sr_bf16": (
        (128, 64),
        P(AXIS, None),
        {"axis": 0, "rht": True, "stochastic_rounding": True},
    ),
    "rows_sharded_rht_sr": ((128, 64), P(AXIS, None), {"rht": True, "stochastic_rounding": True}),
    "rows_sharded_2d_sr": (
        (128, 64),
        P(AXIS, None),
        {"block_2d": True, "stochastic_rounding": True},
    ),
    "rows_sharded_3d_sr": ((16, 8, 64), P(AXIS, None, None), {"stochastic_rounding": True}),
    "middle_axis_sharded_3d_sr": ((4, 16, 64), P(None, AXIS, None), {"stochastic_rounding": True}),
    "rows_sharded_2d_8_rows": ((64, 64), P(AXIS, None), {"block_2d": True}),
    # One block along the quantized axis (a 16-wide head): a size-1 factor in the rule.
    "rows_sharded_one_block": ((256, 16), P(AXIS, None), {"axis": -1}),
    "rows_sharded_one_block_sr": ((256, 16), P(AXIS, None), {"stochastic_rounding": True}),
    # Shards of fewer than 16 values of the quantized axis: gathered along it, same bits.
    "quantized_axis_8_per_shard": ((16, 64), P(None, AXIS), {}),
    "quantized_axis_4_per_shard_sr": ((16, 32), P(None, AXIS), {"stochastic_rounding": True}),
    "quantized_axis_2_per_shard_one_block": ((16, 16), P(None, AXIS), {}),
    "quantized_axis_8_per_shard_axis0_2d": ((64, 32), P(AXIS, None), {"axis": 0, "block_2d": True}),
    "quantized_axis_8_per_shard_rht": ((64, 32), P(AXIS, None), {"axis": 0, "rht": True}),
}


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


# --- training steps ---------------------------------------------------------------------------

BATCH, IN, WIDTH, OUT = 128, 128, 128, 64


def mlp_loss(params, x, y, key, recipe):
    # Layer 1 draws SR bits from a key; layer 2 from its gradient's bits (key=None): both
    # must be sharding-invariant. The weights go to dot_general as they are sharded; the
    # bias is gathered under Explicit axes, where adding a sharded (WIDTH,) to activations
    # sharded by rows is a type error.
    b1 = params["b1"]
    if jax.sharding.get_abstract_mesh().explicit_axes:
        b1 = jax.sharding.reshard(b1, P())
    h = jax.nn.gelu(dot_general(x, params["w1"], DENSE, recipe=recipe, key=key) + b1)
    out = dot_general(h, params["w2"], DENSE, recipe=recipe, key=None)
    return jnp.mean((out - y) ** 2)


def train_setup(in_=IN, width=WIDTH, out=OUT):
    rng = np.random.default_rng(7)
    params = {
        "w1": rng.standard_normal((in_, width)) / np.sqrt(in_),
        "b1": rng.standard_normal((width,)) * 0.1,
        "w2": rng.standard_normal((width, out)) / np.sqrt(width),
    }
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    x = jnp.asarray(rng.standard_normal((BATCH, in_)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((BATCH, out)), jnp.float32)
    return params, x, y, jax.random.key(11)


# Every quantized operand is the same bits sharded or not (quantization is blockwise, the
# amax a max, SR bits positional, the derived key a wrapping integer sum), and XLA gathers
# the token axis for the wgrad GEMM (its blocks and RHT run along it), so the NVFP4 weight
# gradients must be bit-exact. The bias gradient is a plain f32 sum over the sharded batch:
# per-device partial sums and an all-reduce, another summation order than one device's; it
# (and the loss, a mean over the batch) may differ by f32 rounding: 1e-5 relative.
EXACT_LEAVES = ("w1", "w2")
F32_SUM_TOLERANCE = 1e-5

TRAIN_SPECS = {
    "data_parallel": {"w1": P(), "b1": P(), "w2": P()},
    # Weights sharded along their first axis (16 rows per device), the batch too.
    "fsdp": {"w1": P(AXIS, None), "b1": P(AXIS), "w2": P(AXIS, None)},
    # Weights of 64 rows (8 per device: less than a block of K) and 64 columns.
    "fsdp_8_rows": {"w1": P(AXIS, None), "b1": P(AXIS), "w2": P(AXIS, None)},
}
# The layouts whose weights have 64 rows and columns (IN = WIDTH = OUT = 64).
SMALL_WEIGHTS = ("fsdp_8_rows",)


@pytest.mark.parametrize("layout", list(TRAIN_SPECS))
@pytest.mark.parametrize("mode", MESH_MODES)
def test_train_step_sharded_equals_one_device(impl, layout, mode):
    if impl.implementation == "reference":  # its GEMMs sum in XLA's order
        skip_where_xla_sums_follow_the_program("the reference's sharded step")
    params, x, y, key = train_setup(*(64, 64, 64) if layout in SMALL_WEIGHTS else ())
    recipe = NVFP4Recipe(implementation=impl.implementation)
    step = jax.jit(jax.value_and_grad(mlp_loss), static_argnums=4)
    loss_1, grads_1 = step(*on_one_device(params, x, y, key), recipe)
    batch = NamedSharding(mesh(mode), P(AXIS, None))
    sharded_params = jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh(mode), s)), params, TRAIN_SPECS[layout]
    )
    with mesh_context(mesh(mode), mode):
        loss_8, grads_8 = step(
            sharded_params, jax.device_put(x, batch), jax.device_put(y, batch), key, recipe
        )
    if mode == "explicit":  # each gradient's type: sharded as its parameter
        for name, grad in grads_8.items():
            want = sharded_params[name].sharding
            assert grad.sharding.is_equivalent_to(want, grad.ndim), (name, grad.sharding)
    np.testing.assert_allclose(loss_8, loss_1, rtol=F32_SUM_TOLERANCE)
    for name in EXACT_LEAVES:
        assert_same_bits(grads_8[name], grads_1[name], name)
    scale = np.max(np.abs(grads_1["b1"]))
    np.testing.assert_allclose(grads_8["b1"], grads_1["b1"], atol=F32_SUM_TOLERANCE * scale)


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


# --- shard_map: the data-parallel pattern with a replicated weight ---------------------------

SHARD_MAP_GRAD_RECIPES = {
    "nvfp4": {},
    "high_precision_backward": {"dgrad": False, "wgrad": False},
    "high_precision": {"fprop": False, "dgrad": False, "wgrad": False},
}


def shard_map_grad_ops(recipe):
    """name -> fn(x, w) of the ops a shard_map'ed data-parallel step differentiates."""
    return {
        "dot_general": lambda x, w: dot_general(x, w, DENSE, recipe=recipe, key=jax.random.key(1)),
        "drop_in": lambda x, w: nvfp4_dot_general(recipe)(x, w, DENSE),
        # Two experts: the weight and its half, tokens 20 and 12 of each shard's 32.
        "ragged_dot": lambda x, w: nvfp4_jax.ragged_dot(
            x, jnp.stack([w, w * 0.5]), jnp.array([20, 12]), recipe=recipe, key=jax.random.key(1)
        ),
    }


# Every recipe on dot_general; the drop-in (the same custom_vjp) and ragged_dot with the
# NVFP4 and high-precision backwards.
SHARD_MAP_GRAD_CASES = [
    *(("dot_general", r) for r in SHARD_MAP_GRAD_RECIPES),
    *((op, r) for op in ("drop_in", "ragged_dot") for r in ("nvfp4", "high_precision_backward")),
]


@pytest.mark.parametrize(("op", "recipe_name"), SHARD_MAP_GRAD_CASES)
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_shard_map_replicated_weight_grads(impl, op, recipe_name, mode):
    """Tokens P(AXIS), weight P(), grad inside shard_map with JAX's replication check.

    As for `jax.lax.dot_general`: each shard's dx is its local gradient, and dW (of a weight
    that is the same on every shard) the sum of the shards' local weight gradients.
    """
    recipe = NVFP4Recipe(implementation=impl.implementation, **SHARD_MAP_GRAD_RECIPES[recipe_name])
    fn = shard_map_grad_ops(recipe)[op]
    shards = 4
    x, w = data((shards * 32, 64), seed=5), data((64, 32), seed=6) / 8

    def local(x, w):
        return jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), argnums=(0, 1))(x, w)

    mesh_ = make_mesh((shards,), (AXIS,), mode)
    with mesh_context(mesh_, mode):
        mapped = jax.jit(
            jax.shard_map(local, mesh=mesh_, in_specs=(P(AXIS), P()), out_specs=(P(AXIS), P()))
        )
        dx, dw = mapped(
            jax.device_put(x, NamedSharding(mesh_, P(AXIS))),
            jax.device_put(w, NamedSharding(mesh_, P())),
        )
    per_shard = [jax.jit(local)(*on_one_device(xs, w)) for xs in jnp.split(x, shards)]
    assert_same_bits(dx, jnp.concatenate([g[0] for g in per_shard]), "dx")
    # The psum adds the shards' f32 gradients in the all-reduce's order.
    expected_dw = functools.reduce(jnp.add, [g[1] for g in per_shard])
    np.testing.assert_allclose(
        dw, expected_dw, rtol=1e-6, atol=1e-6 * float(jnp.abs(expected_dw).max())
    )


# --- the Flax layers and the example's step under each mesh mode ----------------------------


def _nnx_linear_grads(impl_name, x):
    layer = nvfp4_nnx.Linear(
        64, 32, recipe=NVFP4Recipe(implementation=impl_name), rngs=nnx.Rngs(0, quantize=1)
    )

    @nnx.jit
    def step(layer, x):
        return nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1))(layer, x)

    loss, (grads, dx) = step(layer, x)
    return loss, {"kernel": grads.kernel[...], "bias": grads.bias[...], "x": dx}


def _linen_dense_grads(impl_name, x):
    layer = nvfp4_linen.Dense(32, recipe=NVFP4Recipe(implementation=impl_name))
    params = layer.init(jax.random.key(0), jnp.zeros((16, 64)))

    @jax.jit
    def step(params, x):
        def loss(params, x):
            y = layer.apply(params, x, rngs={"quantize": jax.random.key(1)})
            return jnp.sum(y**2)

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    loss, (grads, dx) = step(params, x)
    return loss, {"kernel": grads["params"]["kernel"], "bias": grads["params"]["bias"], "x": dx}


LAYERS = {"nnx_linear": _nnx_linear_grads, "linen_dense": _linen_dense_grads}


@pytest.mark.parametrize("mode", ["auto", "explicit"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer_data_parallel_equals_one_device(impl, layer, mode):
    """A layer's loss and gradients with a batch sharded over the mesh, as on one device.

    The parameters are made under the mesh (replicated); the NVFP4 gradients (the kernel's,
    the input's) are the same bits, the bias gradient and loss plain f32 sums. One exception,
    documented: the reference's emulated wgrad GEMM with Auto axes and no mesh in the
    context, where XLA's partitioner may split its sum over the sharded tokens (f32 order).
    """
    x = data((128, 64), seed=8)
    loss_1, grads_1 = LAYERS[layer](impl.implementation, *on_one_device(x))
    with mesh_context(mesh(mode), mode):
        sharded = jax.device_put(x, NamedSharding(mesh(mode), P(AXIS, None)))
        loss_8, grads_8 = LAYERS[layer](impl.implementation, sharded)
    np.testing.assert_allclose(loss_8, loss_1, rtol=F32_SUM_TOLERANCE)
    if impl.implementation == "reference" and mode == "auto":
        np.testing.assert_allclose(grads_8["kernel"], grads_1["kernel"], rtol=1e-6)
    else:
        assert_same_bits(grads_8["kernel"], grads_1["kernel"], "kernel")
    assert_same_bits(grads_8["x"], grads_1["x"], "x")
    scale = float(jnp.max(jnp.abs(grads_1["bias"])))
    np.testing.assert_allclose(grads_8["bias"], grads_1["bias"], atol=F32_SUM_TOLERANCE * scale)


def _example_grads(batch, experts: int = 0):
    """The example LM's (examples/lm_model.py) NVFP4 training loss and gradients."""
    cfg = lm_model.LMConfig(width=64, depth=1, heads=2, max_len=32, experts=experts, top_k=2)
    model = lm_model.TransformerLM(cfg, nnx.Rngs(params=0))
    rules = [nvfp4_jax.Rule(".*", NVFP4Recipe())]
    nvfp4_jax.quantize_model(model, rules, rngs=nnx.Rngs(quantize=1))

    @nnx.jit
    def step(model, batch):
        value_and_grad = nnx.value_and_grad(lm_model.train_loss_fn, has_aux=True)
        (_, (loss, _)), grads = value_and_grad(model, batch)
        return loss, nnx.to_pure_dict(grads)

    return step(model, batch)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_example_step_data_parallel(experts):
    """The example's training step with its batch sharded, under `jax.set_mesh` with Auto
    and with Explicit axes (the layers' tests above take every way to use a mesh; each way
    compiles the example anew, so this one takes JAX's two defaults).

    The step equals one device's up to the f32 sums of the layers around the NVFP4 GEMMs
    (norms, attention, router), which XLA compiles differently per program; a gradient
    that moves by an ulp may flip an NVFP4 code of the next GEMM, so the gradients are
    compared at the recipe's error (the dense step; a MoE's routing may move tokens). The
    dense step with Explicit axes gives the same bits as with Auto axes. The MoE step under
    Explicit axes gathers the tokens for its sort (another program), where XLA may keep a
    bf16 product in f32 (its default `xla_allow_excess_precision`) before the next
    quantization: the same bits with that flag off (checked by hand), here the loss at the
    recipe's error.
    """
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (8, 33)), jnp.int32)
    loss_1, grads_1 = _example_grads(*on_one_device(batch), experts)
    results = {}
    for mode in ("auto_set_mesh", "explicit"):
        with mesh_context(mesh(mode), mode):
            sharded = jax.device_put(batch, NamedSharding(mesh(mode), P(AXIS)))
            results[mode] = _example_grads(sharded, experts)
    loss_8, grads_8 = results["auto_set_mesh"]
    np.testing.assert_allclose(loss_8, loss_1, rtol=F32_SUM_TOLERANCE)
    flat_1 = jax.tree_util.tree_flatten_with_path(grads_1)[0]
    if not experts:  # the MoE: see below
        for (path, a), b in zip(flat_1, jax.tree.leaves(grads_8), strict=True):
            scale = float(jnp.max(jnp.abs(a)))
            np.testing.assert_allclose(b, a, atol=3e-2 * scale, err_msg=jax.tree_util.keystr(path))
    if experts:
        # A bf16 product kept in f32 moves an NVFP4 code, which moves a router logit; with
        # top-2 routing at initialization that moves tokens between experts: the loss stays
        # within the recipe's error, the gradients are checked finite and shaped.
        loss, grads = results["explicit"]
        np.testing.assert_allclose(loss, loss_8, rtol=1e-3)
        for (path, a), b in zip(flat_1, jax.tree.leaves(grads), strict=True):
            assert b.shape == a.shape and bool(jnp.all(jnp.isfinite(b))), path
        return
    leaves = zip(*(jax.tree.leaves(results[mode]) for mode in results), strict=True)
    for auto, explicit in leaves:
        assert_same_bits(explicit, auto, "explicit")


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
