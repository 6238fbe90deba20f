"""nvfp4_threefry2x32 (nvfp4_jax/_src/core/kernels/_threefry.py, ffi/cpu/threefry.cc): JAX's
hash of the SR keys as one custom call, bit for bit JAX's threefry, and its operands
checked by name.
"""

from __future__ import annotations

import jax
import jax.extend.random
import numpy as np
import pytest
from ffi_calls import CPU, F32, U32, call, sds

from nvfp4_jax import kernels

if not kernels.is_available("cpu"):  # registers the targets
    pytest.skip(
        f"native CPU kernels not built: {kernels.unavailable_reason('cpu')}",
        allow_module_level=True,
    )


# --- nvfp4_threefry2x32: JAX's hash of the SR keys as one custom call ------------------------


def test_threefry_is_jax_threefry_bit_for_bit():
    rng = np.random.default_rng(3)
    k0, k1, x0, x1 = rng.integers(0, 2**32, (4, 257), dtype=np.uint64).astype(U32)
    want = jax.extend.random.threefry2x32_p.bind(*(jax.numpy.asarray(v) for v in (k0, k1, x0, x1)))
    got = call("nvfp4_threefry2x32", [k0, k1, x0, x1], (sds((257,), U32),) * 2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, np.asarray(w))
    # The wrapper: a scalar key broadcast over the counters, under jit and vmap, and no elements.
    key = (U32(7), U32(0xFFFFFFFF))
    want = jax.extend.random.threefry2x32_p.bind(
        *(jax.numpy.full((257,), v, U32) for v in key), x0, x1
    )
    with jax.default_device(CPU):
        for got in (
            kernels.threefry2x32(*key, x0, x1),
            jax.jit(kernels.threefry2x32)(*key, x0, x1),
            jax.vmap(kernels.threefry2x32, in_axes=(None, None, 0, 0))(*key, x0, x1),
        ):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        empty = kernels.threefry2x32(*key, np.zeros((0,), U32), np.zeros((0,), U32))
        assert [e.shape for e in empty] == [(0,), (0,)]


def test_threefry_rejects_bad_operands_by_name():
    ones = np.ones((4,), U32)
    cases = [
        ([ones, ones, ones.astype(np.int32), ones], (sds((4,), U32),) * 2, "x0 of shape (4,)"),
        ([ones, ones, ones, np.ones((5,), U32)], (sds((4,), U32),) * 2, "x1 of shape (5,)"),
        ([ones] * 4, (sds((4,), U32), sds((4,), F32)), "y1 of shape (4,) and dtype f32"),
    ]
    for args, results, message in cases:
        with pytest.raises(Exception) as info:
            call("nvfp4_threefry2x32", args, results)
        assert f"nvfp4_threefry2x32: {message}" in str(info.value)
        assert "expected u32 of k0's shape (4,)" in str(info.value)
    with pytest.raises(TypeError, match="threefry2x32: x1 must be uint32, got int32"):
        kernels.threefry2x32(ones, ones, ones, ones.astype(np.int32))
    with pytest.raises(ValueError, match=r"do not broadcast: k0 \(4,\), k1 \(4,\), x0 \(3,\)"):
        kernels.threefry2x32(ones, ones, np.ones((3,), U32), ones)
