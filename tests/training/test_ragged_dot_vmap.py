"""`ragged_dot` under vmap (nvfp4_jax/_src/training/ragged/ragged_dot.py and grouped_gemm.py's
batched forms): a batch of token sets, each with its own group sizes (a per-sequence MoE),
is the loop over the sets, bit for bit; grad of vmap and vmap of grad too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, skip_eager_reference
from ragged_oracle import VMAP_SIZES, data, one_sequence_vjp

from nvfp4_jax import NVFP4Recipe, ragged_dot

# --- vmap: a batch of token sets, each with its own group sizes (a per-sequence MoE) ---------


def vmap_data():
    """x (B, M, K), the shared experts W (G, K, N), dy (B, M, N), group sizes (B, G); f32,
    one set of shapes for the tests below (eagerly, the reference compiles every op once per
    shape: a minute and a half)."""
    xs, _, dys = zip(*(data(48, 32, 32, 4, 20 + b) for b in range(3)), strict=True)
    w = data(48, 32, 32, 4, 30)[1]
    return jnp.stack(xs), w, jnp.stack(dys), jnp.array(VMAP_SIZES, jnp.int32)


# Under jit: eagerly the reference runs op by op (XLA compiles each op on its own, a minute
# per case); tests/core/test_ops_vmap.py's ragged_dot case runs vmap of ragged_dot eagerly too.
@pytest.mark.slow
@pytest.mark.parametrize(("key_kind", "mode"), [("key", "jit"), ("none", "jit")])
def test_vmap_over_token_sets_is_the_loop_bit_for_bit(impl, key_kind, mode):
    """vmap of the vjp (the weights shared, each token set its own sizes and key) against a
    Python loop of the per-element calls, eagerly and under jit: the same bits."""
    x, w, dy, sizes = vmap_data()
    keys = jax.random.split(jax.random.key(11), 3) if key_kind == "key" else None
    recipe = NVFP4Recipe(implementation=impl.implementation)
    one = functools.partial(one_sequence_vjp, recipe=recipe)
    batched = jax.vmap(one, in_axes=(0, None, 0, 0, None if keys is None else 0))
    if mode == "jit":
        one, batched = jax.jit(one), jax.jit(batched)
    got = batched(x, w, sizes, dy, keys)
    for b in range(3):
        want = one(x[b], w, sizes[b], dy[b], None if keys is None else keys[b])
        for name, a, e in zip(("y", "dx", "dW"), got, want, strict=True):
            assert_same_bits(a[b], e, f"{name} of token set {b}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_grad_of_vmap_and_vmap_of_grad_are_the_loop(impl, mode):
    """The per-sequence MoE's gradients both ways round: vmap of grad gives each token set's
    (dx, dW), grad of vmap each set's dx and the shared weight's dW summed over the sets."""
    skip_eager_reference(impl, mode)
    x, w, dy, sizes = vmap_data()
    keys = jax.random.split(jax.random.key(12), 3)
    recipe = NVFP4Recipe(implementation=impl.implementation)

    def loss(a, b, gs, cotangent, key):
        return jnp.sum(ragged_dot(a, b, gs, recipe=recipe, key=key) * cotangent)

    grad = jax.grad(loss, argnums=(0, 1))
    vmap_of_grad = jax.vmap(grad, in_axes=(0, None, 0, 0, 0))

    def batched_loss(a, b):
        return jnp.sum(jax.vmap(loss, in_axes=(0, None, 0, 0, 0))(a, b, sizes, dy, keys))

    grad_of_vmap = jax.grad(batched_loss, argnums=(0, 1))
    if mode == "jit":
        grad, vmap_of_grad, grad_of_vmap = map(jax.jit, (grad, vmap_of_grad, grad_of_vmap))
    loop = [grad(x[b], w, sizes[b], dy[b], keys[b]) for b in range(3)]
    dx, dw = vmap_of_grad(x, w, sizes, dy, keys)
    gx, gw = grad_of_vmap(x, w)
    for b, (dx_b, dw_b) in enumerate(loop):
        assert_same_bits(dx[b], dx_b, f"vmap of grad: dx of token set {b}")
        assert_same_bits(dw[b], dw_b, f"vmap of grad: dW of token set {b}")
        assert_same_bits(gx[b], dx_b, f"grad of vmap: dx of token set {b}")
    # The shared weight's gradient is the sum of the token sets' (JAX's transpose of the
    # broadcast), which XLA may fuse under jit with the last scaling of each (FMAs): equal
    # up to the rounding of the terms and of their f32 sum.
    per_set = np.stack([np.asarray(d) for _, d in loop])
    atol = 4 * 2.0**-24 * np.abs(per_set).sum(axis=0)
    assert np.all(np.abs(np.asarray(gw) - per_set.sum(axis=0)) <= atol), "grad of vmap: dW"


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["high_precision", "w1d_no_sr", "nested"])
def test_vmap_of_every_gemm_form_is_the_loop(impl, recipe_name):
    """Under jit: the GEMMs a recipe puts in high precision (`jax.lax.ragged_dot` and its
    autodiff, written out), the 1x16 weights' dgrad, and vmap of vmap (two batch dims, the
    weights shared by both): every token set's (y, dx, dW) is its own call's bits."""
    x, w, dy, sizes = vmap_data()
    recipe = {
        "high_precision": NVFP4Recipe(fprop=False, dgrad=False, wgrad=False),
        "w1d_no_sr": NVFP4Recipe(weight_2d=False, stochastic_rounding=False),
        "nested": NVFP4Recipe(),
    }[recipe_name]
    recipe = dataclasses.replace(recipe, implementation=impl.implementation)
    key = jax.random.key(13)
    one = functools.partial(one_sequence_vjp, key=key, recipe=recipe)
    batched = jax.vmap(one, in_axes=(0, None, 0, 0))
    if recipe_name == "nested":  # (2, 3) token sets: the same three, the second copy scaled
        x, dy, sizes = (jnp.stack([a, 2 * a]) for a in (x, dy, sizes))
        sizes = sizes.at[1].set(jnp.flip(sizes[1], axis=1) // 2)
        batched = jax.vmap(batched, in_axes=(0, None, 0, 0))
    got = jax.jit(batched)(x, w, sizes, dy)
    one = jax.jit(one)
    for index in np.ndindex(sizes.shape[:-1]):
        want = one(x[index], w, sizes[index], dy[index])
        for name, a, e in zip(("y", "dx", "dW"), got, want, strict=True):
            assert_same_bits(a[index], e, f"{name} of token set {index}")
