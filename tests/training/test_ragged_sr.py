"""The stochastic rounding bits of `ragged_dot` (nvfp4_jax/_src/training/ragged/sr.py and
`sr_keys.threefry2x32`): the written-out threefry is JAX's bit for bit, and the numbering's
64-bit counters have no size limit (a Mixtral-sized batch traces; counters past 2**32 are
docs/NUMERICS.md section 7's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry_2x32
from ragged_oracle import one_sequence_vjp

from nvfp4_jax import NVFP4Recipe
from nvfp4_jax._src.core import sr_keys
from nvfp4_jax._src.training.ragged.groups import Groups
from nvfp4_jax._src.training.ragged.sr import padded_random, row_random


def test_the_written_out_threefry_is_jax_threefry_bit_for_bit():
    rng = np.random.default_rng(7)
    words = rng.integers(0, 2**32, (4, 4096), dtype=np.uint32)
    k0, k1, x0, x1 = (jnp.asarray(w) for w in words)
    ours = jax.jit(sr_keys.threefry2x32)(k0, k1, x0, x1)
    theirs = jax.vmap(lambda a, b, c, d: threefry_2x32((a, b), jnp.stack([c, d])))(k0, k1, x0, x1)
    np.testing.assert_array_equal(np.stack([np.asarray(o) for o in ours], -1), theirs)


# --- stochastic rounding's numbering: 64-bit counters, no size limit -------------------------

# A Mixtral-sized global batch: 2M tokens routed top-2 (M = 4M rows), K = 4096, N = 14336,
# G = 8; `N * 16 * ceil(M / 16)` is 6.0e10, past 2**35 (the counters past 2**32).
MIXTRAL = (2**22, 4096, 14336, 8)


LARGE_RECIPES = {
    "default": NVFP4Recipe(),
    "no_sr": NVFP4Recipe(stochastic_rounding=False),
    "high_precision": NVFP4Recipe(fprop=False, dgrad=False, wgrad=False),
}


@pytest.mark.parametrize("recipe_name", list(LARGE_RECIPES))
def test_mixtral_sized_batches_trace(impl, recipe_name):
    """The forward and both gradients trace at that size (abstract shapes, nothing allocated),
    with stochastic rounding and without."""
    m, k, n, g = MIXTRAL
    recipe = dataclasses.replace(LARGE_RECIPES[recipe_name], implementation=impl.implementation)
    shapes = [((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16), ((g,), jnp.int32)]
    x, w, sizes, dy = (jax.ShapeDtypeStruct(*s) for s in [*shapes, ((m, n), jnp.bfloat16)])
    for key in (jax.random.key(0), None):
        y, dx, dw = jax.eval_shape(
            functools.partial(one_sequence_vjp, key=key, recipe=recipe), x, w, sizes, dy
        )
        assert (y.shape, dx.shape, dw.shape) == ((m, n), (m, k), (g, k, n)), recipe_name


def fake_groups(row_local, pad_local, padded_size):
    """A `Groups` of one group with the given local indices (rows, and the padded layout's
    positions) and padded size: the SR numbering's inputs, without a tensor that large."""
    zeros = jnp.zeros_like
    row_local, pad_local = jnp.asarray(row_local, jnp.int32), jnp.asarray(pad_local, jnp.int32)
    return Groups(
        sizes=None,
        row_group=zeros(row_local),
        row_local=row_local,
        padded_sizes=jnp.array([padded_size], jnp.int32),
        pad_group=zeros(pad_local),
        pad_local=pad_local,
        pad_row=None,
    )


@pytest.mark.slow
def test_sr_numbering_past_2_to_the_32_counters_is_section_7():
    """Element n of a group's own tensor draws counter n // 8 as 64 bits (docs/NUMERICS.md
    section 7: the high word is its own, no wrap), past 2**35 elements as below: the bytes
    the dense reference gives those elements (`random_bytes` from the counter offset of the
    row, or of the padded layout's chunk)."""
    from nvfp4_jax._src.core.reference.stochastic import random_bytes  # noqa: PLC0415
    from nvfp4_jax._src.core.sr_seed import SRSeed  # noqa: PLC0415

    words = jnp.array([[0x12345678, 0x9ABCDEF0]], jnp.uint32)

    def section_7(n0, count):  # the bytes of elements n0 .. n0 + count - 1 (n0 % 16 == 0)
        j = n0 // 8
        seed = SRSeed(words[0], jnp.array([j & 0xFFFFFFFF, j >> 32], jnp.uint32))
        return np.asarray(random_bytes(seed, count))

    # dgrad's dy (rows of N): element (t, c) is n = t * N + c; rows past 2**32 counters.
    n = 14336
    rows = [0, 1, 2**21 + 3, 2**22 - 1, 2**31 - 1]
    got = np.asarray(row_random(words, fake_groups(rows, [0], 16), n))
    for i, t in enumerate(rows):
        np.testing.assert_array_equal(got[i], section_7(t * n, n), err_msg=f"row {t}")
    # wgrad's dy, stored (N, Mp): element (c, p) is n = c * L + p for the group's L tokens.
    length, positions = 2**28, np.arange(2**28 - 64, 2**28)  # counters past 2**32 from c = 128
    groups = fake_groups([0], positions, length)
    got = np.asarray(padded_random(words, groups, 256))
    for c in (0, 1, 127, 128, 255):
        want = section_7(c * length + int(positions[0]), 64)
        np.testing.assert_array_equal(got[c], want, err_msg=f"row {c} of the padded layout")
