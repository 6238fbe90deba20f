"""The Random Hadamard Transform (RHT) of the NVFP4 weight-gradient operands, in pure jnp.

Shapes: an input `x` of shape (..., C) with C a multiple of 16 is transformed in blocks of
16 consecutive elements along its last axis. With `H` the 16x16 Sylvester Hadamard matrix
and `s` the fixed sign vector, each block becomes `x_b @ M` where `M = diag(s) @ H / 4`, an
orthogonal matrix whose entries are all +-0.25; the inverse is `y_b @ M.T`
(docs/NUMERICS.md section 5). Names follow TransformerEngine's JAX module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import checks, formats, primal_types

_WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def get_hadamard_matrix(n: int = formats.BLOCK_SIZE, dtype=jnp.float32) -> jax.Array:
    """Returns the unnormalized n x n Sylvester Hadamard matrix, `H[i, j] = (-1)^popcount(i & j)`.

    Args:
      n: the size, a positive power of two.
      dtype: the element type of the result.

    Example:
      >>> get_hadamard_matrix(2).tolist()
      [[1.0, 1.0], [1.0, -1.0]]

    """
    valid = isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))
    if not valid or n < 1 or n & (n - 1):
        raise ValueError(f"get_hadamard_matrix: n must be a positive power of two, got n={n!r}")
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return jnp.asarray(1 - 2 * parity, dtype=dtype)


def get_wgrad_sign_vector(dtype=jnp.float32) -> jax.Array:
    """Returns the fixed 16-element sign vector of the wgrad RHT (entries +-1).

    TransformerEngine's signs, packed as the bits of 0xD7E8 (`get_sign_from_vector`).

    Args:
      dtype: the dtype of the result.

    Example:
      >>> import nvfp4_jax
      >>> nvfp4_jax.get_wgrad_sign_vector().astype(int).tolist()
      [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]

    """
    return jnp.asarray(_WGRAD_SIGNS, dtype=dtype)


def get_sign_from_vector(vector) -> int:
    """Returns the bitmask of a sign vector: bit i set where `vector[i] == -1`.

    Example:
      >>> hex(get_sign_from_vector(get_wgrad_sign_vector()))
      '0xd7e8'

    """
    values = np.asarray(vector).reshape(-1)
    if not np.all(np.isin(values, (-1, 1))):
        raise ValueError(f"get_sign_from_vector: entries must be +-1, got {values.tolist()}")
    return int(sum(1 << i for i, v in enumerate(values) if v == -1))


def get_rht_matrix(dtype=jnp.float32) -> jax.Array:
    """Returns the 16x16 RHT matrix `M = diag(sign) @ H16 / 4`; every entry is +-0.25.

    `sign` is `get_wgrad_sign_vector()` and `H16` the Sylvester Hadamard matrix
    (`get_hadamard_matrix(16)`). `M` is orthogonal: `apply_rht` multiplies each 16-group by it,
    the inverse by its transpose (docs/NUMERICS.md section 5).

    Args:
      dtype: the dtype of the result.

    Example:
      >>> import jax.numpy as jnp, nvfp4_jax
      >>> m = nvfp4_jax.get_rht_matrix()
      >>> m.shape, bool(jnp.allclose(m @ m.T, jnp.eye(16)))
      ((16, 16), True)

    """
    signs = np.asarray(_WGRAD_SIGNS, np.float32)
    hadamard = np.asarray(get_hadamard_matrix(formats.BLOCK_SIZE))
    return jnp.asarray(signs[:, None] * hadamard * np.float32(0.25), dtype=dtype)


def _fwht16(v: jax.Array) -> jax.Array:
    """Unnormalized Walsh-Hadamard transform of f32 blocks (..., 16) in the contract's order.

    Stage h pairs (i, i + h) for every i with `i & h == 0` and writes (sum, difference).
    Viewing a block as (16 / 2h, 2, h), the pair partners are the two rows of the middle axis.
    """
    lead = v.shape[:-1]
    h = 1
    while h < formats.BLOCK_SIZE:
        pairs = v.reshape(*lead, formats.BLOCK_SIZE // (2 * h), 2, h)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        v = jnp.stack([first + second, first - second], axis=-2).reshape(*lead, formats.BLOCK_SIZE)
        h *= 2
    return v


def apply_rht(x: jax.Array, *, inverse: bool = False) -> jax.Array:
    """The Random Hadamard Transform in blocks of 16 along the last axis, in pure jnp.

    Forward: `v = s * x; v = H v (butterflies h = 1, 2, 4, 8); y = v * 0.25`. Inverse:
    `v = H y; v = v * 0.25; x = s * v`. All in f32, rounded to x's dtype at the end.

    Args:
      x: bf16, f16 or f32 array of any rank whose last dimension is a multiple of 16.
      inverse: apply `M.T` (the inverse) instead of `M`.

    Returns:
      An array of x's shape and dtype.

    Example:
      >>> x = jnp.arange(16, dtype=jnp.float32)
      >>> bool(jnp.allclose(apply_rht(apply_rht(x), inverse=True), x))
      True

    """
    x = checks.check_rht_input(x)
    inverse = checks.check_flag(inverse, "apply_rht", "inverse")
    x = primal_types.whole_blocks(x, (-1,), formats.BLOCK_SIZE)  # shards of whole 16-groups
    lead = x.shape[:-1]
    groups = x.shape[-1] // formats.BLOCK_SIZE  # explicit: -1 is ambiguous for zero-size x
    blocks = x.astype(jnp.float32).reshape(*lead, groups, formats.BLOCK_SIZE)
    signs = get_wgrad_sign_vector(jnp.float32)
    if not inverse:
        blocks = blocks * signs
    blocks = _fwht16(blocks) * jnp.float32(0.25)
    if inverse:
        blocks = blocks * signs
    return blocks.reshape(x.shape).astype(x.dtype)
