"""What the sharded tests on 8 CPU devices share (test_distributed.py,
test_distributed_training.py, and the two-process tests of tests/integration/): the mesh
axis, the fixtures `impl` (the implementations that run on the 8 CPU devices) and `mode`
(Auto axes, or Explicit under set_mesh), which each test module binds to its own names, the
helpers that run a function sharded or on one device, the sharded quantize cases
(`JIT_CASES`) and the NVFP4 MLP's training step (`mlp_loss`, `train_setup`, `TRAIN_SPECS`)
with what must match bit for bit (`EXACT_LEAVES`) or to f32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DENSE,
    make_impl,
    make_mesh,
    mesh_context,
)
from jax.sharding import PartitionSpec as P

from nvfp4_jax import (
    dot_general,
)

AXIS = "x"


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
