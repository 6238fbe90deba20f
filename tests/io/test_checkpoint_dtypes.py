"""Checkpoints of bfloat16, float8, int4 and the other ml_dtypes leaves: stored bit for bit.

NumPy gives every ml_dtypes type the kind "V" (as for structured dtypes); these tests check
that such leaves are stored and restored like any numeric leaf, every bit pattern (NaN
payloads and negative zeros included), and that what orbax cannot store is refused by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import same_bits

from nvfp4_jax.checkpoint import restore_checkpoint, save_checkpoint

# The ml_dtypes types that tensorstore (orbax's writer) stores.
STORABLE = [
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "int4",
    "int2",
]


def every_value(name: str) -> np.ndarray:
    """Every bit pattern of the type (its canonical one for the types under a byte)."""
    dtype = np.dtype(getattr(ml_dtypes, name))
    if dtype.itemsize == 2:
        return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    if name == "float4_e2m1fn":
        return np.arange(16, dtype=np.uint8).view(dtype)
    if name in ("int4", "int2"):
        bits = int(name[3:])
        return np.arange(-(1 << (bits - 1)), 1 << (bits - 1)).astype(dtype)
    return np.arange(256, dtype=np.uint8).view(dtype)


@pytest.mark.parametrize("name", STORABLE)
def test_ml_dtypes_leaves_round_trip_bit_exact(tmp_path, name):
    values = every_value(name)
    grid = jnp.asarray(np.resize(values, 16).reshape(4, 4))
    tree = {"np": values, "jax": jnp.asarray(values), "grid": grid}
    assert same_bits(tree["jax"], values)
    save_checkpoint(tmp_path / "c", tree)
    for target in (None, tree, jax.eval_shape(lambda: tree)):
        restored = restore_checkpoint(tmp_path / "c", target)
        for key, leaf in tree.items():
            assert same_bits(restored[key], leaf), (key, target is None)
        assert isinstance(restored["jax"], jax.Array)
        # NumPy leaves come back NumPy (as a float64 does), unless the target asks for jax.
        is_numpy = target is None or target is tree
        assert isinstance(restored["np"], np.ndarray if is_numpy else jax.Array)


def test_bfloat16_nans_and_negative_zero_round_trip(tmp_path):
    patterns = np.array([0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x8000, 0x0000, 0x7F80, 0x0001], np.uint16)
    tree = {"w": jnp.ones((4, 4), jnp.bfloat16), "odd": jnp.asarray(patterns.view(jnp.bfloat16))}
    save_checkpoint(tmp_path / "c", tree)
    for target in (None, jax.eval_shape(lambda: tree)):
        restored = restore_checkpoint(tmp_path / "c", target)
        assert same_bits(restored["w"], tree["w"])
        assert np.array_equal(np.asarray(restored["odd"]).view(np.uint16), patterns)


def test_a_bfloat16_nnx_model_round_trips(tmp_path):
    model = nnx.Linear(3, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    save_checkpoint(tmp_path / "m", nnx.state(model))
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: nnx.Linear(3, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)))
    )
    restored = nnx.merge(graphdef, restore_checkpoint(tmp_path / "m", abstract))
    assert restored.kernel[...].dtype == jnp.bfloat16
    assert same_bits(restored.kernel[...], model.kernel[...])
    assert same_bits(restored.bias[...], model.bias[...])
    x = jnp.ones((2, 3), jnp.bfloat16)
    assert same_bits(restored(x), model(x))


@pytest.mark.parametrize(
    "leaf, dtype, why",
    [
        (np.zeros(3, ml_dtypes.float8_e4m3), "float8_e4m3", "tensorstore"),
        (np.zeros(3, ml_dtypes.uint4), "uint4", "tensorstore"),
        (np.zeros(3, ml_dtypes.float6_e2m3fn), "float6_e2m3fn", "tensorstore"),
        (np.zeros(3, "datetime64[s]"), "datetime64", "not a boolean or numeric"),
        (np.zeros(3, [("a", "<i4"), ("b", "<f4")]), r"\[\('a'", "not a boolean or numeric"),
        (np.zeros(3, "V4"), r"\|V4", "not a boolean or numeric"),
        (np.array(["a", "b"]), "<U1", "not a boolean or numeric"),
        (np.array([None, 1], object), "object", "not a boolean or numeric"),
    ],
)
def test_dtypes_orbax_cannot_store_are_refused_by_name(tmp_path, leaf, dtype, why):
    tree = {"fine": jnp.ones(2, jnp.bfloat16), "bad": [jnp.zeros(1), leaf]}
    with pytest.raises(TypeError, match=rf"the leaf at \['bad'\]\[1\] has dtype {dtype}.*{why}"):
        save_checkpoint(tmp_path / "c", tree)
    assert not (tmp_path / "c").exists()
