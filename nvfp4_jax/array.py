"""NVFP4Array: the quantized-tensor pytree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """A tensor quantized to NVFP4.

    Shape letters: the logical tensor has shape `S`; the *stored layout* is `S` with the
    quantized axis moved last, `(..., C)`.

    Invariants:
      * `codes`: uint8 `(..., C // 2)`, two E2M1 codes per byte along the last axis (element
        2i in the low nibble, bit 3 of a code is its sign).
      * `scales`: float8_e4m3fn `(..., C // 16)`, one per 16 consecutive stored elements. With
        `block_2d`, rows are grouped in 16s over the second-to-last stored axis and every row
        of a 16x16 tile holds the tile's scale.
      * `amax`: f32 scalar, the tensor amax the scales were computed from (after the RHT if
        `rht`); NaN if the input held NaN or inf.
      * `axis` is negative (it counts from the end of the logical shape), so that leading
        batch dimensions added by `vmap` leave it valid. The logical shape is derived from
        `codes`, never stored.

    Leaves: `codes`, `scales`, `amax`. Static metadata: `dtype`, `axis`, `block_2d`, `rht`.
    """

    codes: jax.Array
    scales: jax.Array
    amax: jax.Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    block_2d: bool = dataclasses.field(metadata=dict(static=True))
    rht: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the stored layout (quantized axis last)."""
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: the shape of the tensor that was quantized."""
        stored = list(self.stored_shape)
        last = stored.pop()
        stored.insert(len(stored) + 1 + self.axis, last)
        return tuple(stored)

    @property
    def ndim(self) -> int:
        """The number of logical dimensions."""
        return len(self.codes.shape)

    @property
    def size(self) -> int:
        """The number of logical elements."""
        return self.codes.size * 2

    @property
    def nbytes(self) -> int:
        """Bytes held by codes, scales and amax."""
        return self.codes.nbytes + self.scales.nbytes + self.amax.nbytes

    def dequantize(self, dtype=jnp.float32, *, implementation: str | None = None) -> jax.Array:
        """Returns the dequantized tensor in its logical shape (see `nvfp4_jax.dequantize`)."""
        from nvfp4_jax.quantize import dequantize  # noqa: PLC0415  (quantize imports us)

        return dequantize(self, dtype, implementation=implementation)

    def __repr__(self) -> str:
        return (
            f"NVFP4Array(shape={self.shape}, dtype={jnp.dtype(self.dtype).name}, axis={self.axis}, "
            f"block_2d={self.block_2d}, rht={self.rht})"
        )


def is_nvfp4_array(value) -> bool:
    """Returns True if `value` is an `NVFP4Array`."""
    return isinstance(value, NVFP4Array)


def stored_to_logical(values: jax.Array, axis: int) -> jax.Array:
    """Moves the stored last axis back to its logical position `axis` (negative)."""
    return jnp.moveaxis(values, -1, axis)


__all__ = ["NVFP4Array", "is_nvfp4_array"]
