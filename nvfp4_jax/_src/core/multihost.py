"""A global array's value on every host: what the export and post-training quantization read.

In a multi-process JAX program a global `jax.Array` may span devices of other processes;
`to_host` gathers it (a collective), so that every process sees the whole value as NumPy.
"""

from __future__ import annotations

import jax
import numpy as np


def to_host(value) -> np.ndarray:
    """The whole value of an array as NumPy, on every process.

    A global `jax.Array` that spans devices of other processes is gathered: a collective, so
    every process must call this for the same arrays in the same order.
    """
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if not value.is_fully_replicated:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return np.asarray(multihost_utils.process_allgather(value, tiled=True))
        value = value.addressable_data(0)
    return np.asarray(value)
