"""Frozen NVFP4 layers (`from_quantized`, an `NVFP4Array` kernel): state.

* State: `Experts.from_quantized` holds concrete variables, as `Linear.from_quantized` does,
  so a model holding it runs under `nnx.jit`, saves as a checkpoint and calibrates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_bits, heavy_tailed

import nvfp4_jax
from nvfp4_jax import gemm

G, K, N = 3, 64, 32


def weight(seed=0, shape=(K, N)):
    w = heavy_tailed(shape, seed=seed) * np.float32(shape[0] ** -0.5)
    return nvfp4_jax.quantize(jnp.asarray(w), axis=0)


def experts_weight(seed=0):
    per_expert = [weight(seed + e) for e in range(G)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_expert)


def activations(shape, seed=1, dtype=jnp.bfloat16):
    return jnp.asarray(heavy_tailed(shape, seed=seed), jnp.float32).astype(dtype)


def sizes_for(rows: int) -> jax.Array:
    """G group sizes covering all but the last row (it belongs to no expert)."""
    first = rows // 3
    return jnp.asarray([first, 0, rows - first - 1], jnp.int32)


# --- state: frozen layers hold concrete variables --------------------------------------


class MoE(nnx.Module):
    def __init__(self):
        self.experts = nvfp4_jax.nnx.Experts.from_quantized(experts_weight(seed=40))
        self.linear = nvfp4_jax.nnx.Linear.from_quantized(weight(seed=41, shape=(N, N)))

    def __call__(self, x, sizes):
        return self.linear(self.experts(x, sizes))


def test_frozen_layers_hold_no_abstract_state():
    for layer in (MoE().experts, MoE().linear):
        leaves = jax.tree.leaves(nnx.state(layer))
        assert leaves and all(isinstance(leaf, jax.Array) for leaf in leaves), nnx.state(layer)
    experts = MoE().experts
    assert_same_bits(experts.input_amax[...], np.zeros((G,), np.float32), "input_amax")


@pytest.mark.parametrize("rows", [6, gemm.WEIGHT_ONLY_MAX_ROWS + 4])
def test_a_model_with_frozen_experts_jits_saves_and_calibrates(rows, tmp_path):
    model = MoE()
    x, sizes = activations((rows, K), seed=42, dtype=jnp.float32), sizes_for(rows)
    eager = model(x, sizes)
    forward = nnx.jit(lambda m, x, s: m(x, s))
    assert_same_bits(forward(model, x, sizes), eager, "nnx.jit")
    # A checkpoint of the state restores into a fresh (abstract) model, bit for bit.
    nvfp4_jax.save_checkpoint(tmp_path / "ckpt", nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(MoE))
    restored = nnx.merge(graphdef, nvfp4_jax.restore_checkpoint(tmp_path / "ckpt", abstract))
    assert_same_bits(restored(x, sizes), eager, "restored")
    # Calibration records each expert's max |x| (and the linear's), eagerly and under jit.
    assert nvfp4_jax.nnx.calibrate(model) == 2
    forward(model, x, sizes)
    model(0.5 * x, sizes)
    want = nvfp4_jax.ragged.group_amax(x, sizes, G)
    assert_same_bits(model.experts.input_amax[...], want, "experts' input_amax")
    assert float(model.linear.input_amax[...]) > 0
