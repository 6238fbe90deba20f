"""Trees compared bit for bit, as the checkpoint tests compare a restored tree with the saved
one (test_checkpoint.py, test_checkpoint_restore.py): the same structure, and every leaf the
same bits, NVFP4 metadata and key impls included (`same_tree`).
"""

from __future__ import annotations

import jax
import numpy as np
from helpers import same_bits

from nvfp4_jax._src.core.array import is_nvfp4_array


def same_leaf(a, b):
    if is_nvfp4_array(a) or is_nvfp4_array(b):
        meta = ("dtype", "axis", "block_2d", "rht")
        return (
            is_nvfp4_array(a)
            and is_nvfp4_array(b)
            and [getattr(a, m) for m in meta] == [getattr(b, m) for m in meta]
            and all(same_bits(getattr(a, p), getattr(b, p)) for p in ("codes", "scales", "amax"))
            and same_optional(getattr(a, "decode_scale", None), getattr(b, "decode_scale", None))
        )
    if is_key(a) or is_key(b):
        return (
            is_key(a)
            and is_key(b)
            and jax.random.key_impl(a) == jax.random.key_impl(b)
            and same_bits(jax.random.key_data(a), jax.random.key_data(b))
        )
    return same_bits(a, b)


def same_optional(a, b):
    return a is b is None or (a is not None and b is not None and same_bits(a, b))


def is_key(x):
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def same_tree(a, b):
    """Same structure, and every leaf the same bits (NVFP4 metadata and key impls included)."""
    flat_a, tree_a = jax.tree_util.tree_flatten(a, is_leaf=is_nvfp4_array)
    flat_b, tree_b = jax.tree_util.tree_flatten(b, is_leaf=is_nvfp4_array)
    return tree_a == tree_b and all(map(same_leaf, flat_a, flat_b))
