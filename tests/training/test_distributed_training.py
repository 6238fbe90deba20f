"""Sharded training on 8 CPU devices, bit for bit against one device: a training step of a
2-layer NVFP4 MLP, data-parallel and FSDP-style (loss and gradients); the data-parallel
pattern of `shard_map` with a replicated weight (dot_general, the drop-in, ragged_dot); the
Flax layers and the example's step under each mesh mode. On the reference and on the native
CPU kernels; the training step also with Auto axes under `jax.set_mesh`
(`helpers.MESH_MODES`). The fixtures and helpers are distributed_setup.py's.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import distributed_setup
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed_setup import (
    AXIS,
    EXACT_LEAVES,
    F32_SUM_TOLERANCE,
    TRAIN_SPECS,
    data,
    mesh,
    mlp_loss,
    on_one_device,
    train_setup,
)
from flax import nnx
from helpers import (
    DENSE,
    MESH_MODES,
    assert_same_bits,
    make_mesh,
    mesh_context,
    skip_where_xla_sums_follow_the_program,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax
from nvfp4_jax import (
    NVFP4Recipe,
    dot_general,
    nvfp4_dot_general,
)
from nvfp4_jax._src.flax import linen as nvfp4_linen
from nvfp4_jax._src.flax import nnx as nvfp4_nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import lm_model

# The implementations and mesh modes of the sharded tests (distributed_setup.py).
impl, mode = distributed_setup.impl, distributed_setup.mode

pytestmark = [
    pytest.mark.skipif(jax.device_count("cpu") < 8, reason="needs 8 CPU devices"),
    pytest.mark.distributed,
]


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
