"""Import: placing the arrays, each with `jax.make_array_from_callback`.

A sharding (one for every array, or a function of the Flax path) decides where each array
lives; each process reads only the slices its devices hold, through `reader`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.io.hf.load.files import (
    BadTensor,
)

# Places one array: (flax path, shape, dtype, read(index) -> numpy, transposed) -> Array;
# `transposed`: the stored (out, in) parts of an NVFP4 kernel (in, out).
Place = Callable[..., jax.Array]


def placer(sharding) -> Place:
    if sharding is None:
        return lambda path, shape, dtype, read, transposed=False: jnp.asarray(read(None))

    def place(path, shape, dtype, read, transposed=False):
        if isinstance(sharding, jax.sharding.Sharding):
            target = _fit(sharding, shape, transposed)
        else:
            target = sharding(path, tuple(shape), np.dtype(dtype))
        try:
            return jax.make_array_from_callback(tuple(shape), target, read)
        except BadTensor:
            raise
        except (ValueError, TypeError, IndexError) as error:
            raise ValueError(
                f"load_hf_checkpoint: cannot place {path} {tuple(shape)} on {target}: {error} "
                "(pass sharding= a function (flax path, shape, dtype) -> Sharding to choose "
                "each array's)"
            ) from error

    return place


def _fit(sharding: jax.sharding.Sharding, shape, transposed: bool = False):
    """The sharding of one array when one sharding is given for every array.

    A `NamedSharding`'s spec applies to the arrays of rank >= len(spec), as the Flax model
    sees them (the stored (out, in) codes and scales of an NVFP4 kernel (in, out) take its
    entries for the last two axes swapped, (E, out, in) those of a stacked (E, in, out)
    one); arrays of lower rank, scalars included, are replicated over its mesh. Other
    shardings are used as they are.
    """
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    if len(spec) > len(shape):
        spec = ()
    elif transposed:
        spec = (*spec, *(None,) * (len(shape) - len(spec)))
        spec = (*spec[:-2], spec[-1], spec[-2])
    return sharding.update(spec=jax.sharding.PartitionSpec(*spec))


def reader(owner, name, transpose=False, dtype=None, shape=None, check=None):
    """`read(index)` of tensor `name`: the (transposed, cast) array or its slice.

    `check` sees every slice, as stored, before it is returned.
    """
    file = owner[name]

    def read(index):
        source = None if index is None else (tuple(index)[::-1] if transpose else tuple(index))
        array = file.read(name, source)
        if check is not None:
            check(array)
        array = array.T if transpose else array
        array = array.reshape(shape) if shape is not None else array
        return array if dtype is None else array.astype(dtype, copy=False)

    return read
