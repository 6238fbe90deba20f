"""Checkpoints of NVFP4Arrays, pytrees and nnx states with orbax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4_jax import quantize
from nvfp4_jax.array import validate_nvfp4_array
from nvfp4_jax.checkpoint import restore_checkpoint, save_checkpoint


def normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(
        a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    )


def assert_same_nvfp4(a, b):
    for part in ("codes", "scales", "amax"):
        assert same_bits(getattr(a, part), getattr(b, part)), part
    assert (a.dtype, a.axis, a.block_2d, a.rht) == (b.dtype, b.axis, b.block_2d, b.rht)


def test_checkpoint_round_trip_of_a_pytree(tmp_path):
    tree = {
        "w": quantize(normal((64, 32), dtype=jnp.bfloat16), axis=0, block_2d=True),
        "layers": [quantize(normal((16, 48), 1), rht=True), jnp.arange(5.0)],
    }
    save_checkpoint(tmp_path / "ckpt", tree)
    target = jax.eval_shape(lambda: tree)
    restored = restore_checkpoint(tmp_path / "ckpt", target)
    assert_same_nvfp4(restored["w"], tree["w"])
    assert_same_nvfp4(restored["layers"][0], tree["layers"][0])
    assert same_bits(restored["layers"][1], tree["layers"][1])
    untargeted = restore_checkpoint(tmp_path / "ckpt")
    assert_same_nvfp4(untargeted["layers"]["0"], tree["layers"][0])


class QuantizedMLP(nnx.Module):
    def __init__(self, seed):
        keys = jax.random.split(jax.random.key(seed))
        self.up = nnx.Variable(
            quantize(jax.random.normal(keys[0], (64, 32)), axis=0, block_2d=True)
        )
        self.down = nnx.Variable(quantize(jax.random.normal(keys[1], (32, 64)), axis=0))
        self.bias = nnx.Param(jnp.zeros((64,)))

    def __call__(self, x):
        h = jax.nn.relu(x @ self.up.get_value().dequantize())
        return h @ self.down.get_value().dequantize() + self.bias[...]


def test_checkpoint_round_trip_of_an_nnx_model(tmp_path):
    model = QuantizedMLP(0)
    save_checkpoint(tmp_path / "model", nnx.state(model))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: QuantizedMLP(1)))
    restored = nnx.merge(graphdef, restore_checkpoint(tmp_path / "model", abstract))
    assert_same_nvfp4(restored.up.get_value(), model.up.get_value())
    assert_same_nvfp4(restored.down.get_value(), model.down.get_value())
    x = normal((4, 64), 7)
    assert same_bits(restored(x), model(x))


def test_restore_with_wrong_shape_or_metadata_raises(tmp_path):
    save_checkpoint(tmp_path / "c", {"w": quantize(normal((64, 32)), axis=0)})
    wrong_shape = jax.eval_shape(lambda: {"w": quantize(normal((64, 64)), axis=0)})
    with pytest.raises(ValueError, match="'w' was saved with"):
        restore_checkpoint(tmp_path / "c", wrong_shape)
    wrong_meta = jax.eval_shape(lambda: {"w": quantize(normal((64, 32)), axis=0, block_2d=True)})
    with pytest.raises(ValueError, match="block_2d"):
        restore_checkpoint(tmp_path / "c", wrong_meta)
    with pytest.raises(ValueError, match="no entry 'v'"):
        restore_checkpoint(tmp_path / "c", {"v": jax.ShapeDtypeStruct((3,), jnp.float32)})


def test_validate_rejects_wrong_dtypes_and_shapes():
    q = quantize(normal((32, 64)))
    with pytest.raises(TypeError, match="scales must be float8_e4m3fn"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "scales": q.scales.astype(jnp.float32)}))
    with pytest.raises(ValueError, match="need scales of shape"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "scales": q.scales[:, :2]}))
    with pytest.raises(TypeError, match="codes must be uint8"):
        validate_nvfp4_array(q.__class__(**{**vars(q), "codes": q.codes.astype(jnp.int32)}))
    assert validate_nvfp4_array(q) is q


def test_save_rejects_an_invalid_array(tmp_path):
    q = quantize(normal((32, 64)))
    bad = q.__class__(**{**vars(q), "amax": q.amax.astype(jnp.bfloat16)})
    with pytest.raises(TypeError, match="amax must be float32"):
        save_checkpoint(tmp_path / "bad", {"w": bad})
