"""NVFP4Array: the quantized-tensor pytree, and the check of its invariants."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import checks, formats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """A tensor quantized to NVFP4.

    Shape letters: the logical tensor has shape `S`; the *stored layout* is `S` with the
    quantized axis moved last, `(..., C)`.

    Invariants (checked by `validate_nvfp4_array`):
      * `codes`: uint8 `(..., C // 2)`, two E2M1 codes per byte along the last axis (element
        2i in the low nibble, bit 3 of a code is its sign).
      * `scales`: float8_e4m3fn `(..., C // 16)`, one per 16 consecutive stored elements. With
        `block_2d`, rows are grouped in 16s over the second-to-last stored axis and every row
        of a 16x16 tile holds the tile's scale.
      * `amax`: f32 scalar, the tensor amax the scales were computed from (after the RHT if
        `rht`); NaN if the input held NaN or inf, and then every scale is NaN (0x7F) and
        every code 0 (docs/NUMERICS.md section 8). A batch made by `vmap` has one amax per
        tensor: shape `codes.shape[:k]`.
      * `axis` is negative (it counts from the end of the logical shape), so that leading
        batch dimensions added by `vmap` leave it valid. The logical shape is derived from
        `codes`, never stored.

      * `decode_scale`: None, or an f32 scalar (shaped like `amax`): the tensor decode factor
        `D` to use instead of `amax * RCP2688` (docs/NUMERICS.md section 3). Only a tensor
        read from another tool's checkpoint carries one (ModelOpt's `weight_scale_2` is
        `amax / 2688`, which no f32 amax times `RCP2688` reproduces in every case); then
        `amax` is `D * 2688`, the amax it stands for. A Four Over Six tensor always carries
        its `D = amax * f32(1/(6 * e4m3_max))` here (section 13), so that whatever stores or
        exports only the leaves keeps the right factor; its `amax` is the real tensor amax.
      * `four_over_six`: None (plain NVFP4), or "mae" / "mse": the block scales were chosen
        by Four Over Six with that error measure (docs/NUMERICS.md section 13). The stored
        format is plain NVFP4 either way.
      * `e4m3_max`: the E4M3 maximum M of the global scale, `S_enc = 6M / A`: 448 for plain
        NVFP4; 256 or 448 under Four Over Six.

    Leaves: `codes`, `scales`, `amax`, `decode_scale` (when not None). Static metadata:
    `dtype` (of the tensor that was quantized), `axis`, `block_2d`, `rht`, `four_over_six`,
    `e4m3_max`.
    """

    codes: jax.Array
    scales: jax.Array
    amax: jax.Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    block_2d: bool = dataclasses.field(metadata=dict(static=True))
    rht: bool = dataclasses.field(metadata=dict(static=True))
    decode_scale: jax.Array | None = None
    four_over_six: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    e4m3_max: int = dataclasses.field(default=448, metadata=dict(static=True))

    @property
    def global_scale(self) -> jax.Array:
        """The tensor decode factor D: `decode_scale` if set, else `amax * f32(1/(6M))`.

        `M = e4m3_max`: 448 (`amax * RCP2688`) except for a Four Over Six tensor made with
        M = 256, which carries its D in `decode_scale` anyway.
        """
        if self.decode_scale is not None:
            return jnp.asarray(self.decode_scale, jnp.float32)
        return formats.decode_scale(self.amax, self.e4m3_max)

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
        return _dequantize_method(self, dtype, implementation=implementation)

    # The static fields a plain NVFP4 array leaves out of its metadata (they hold their
    # defaults): its metadata is that of the versions before Four Over Six.
    _FOUR_OVER_SIX_FIELDS = ("four_over_six", "e4m3_max")

    @classmethod
    def _static_fields(cls) -> tuple[str, ...]:
        """The names of the static (metadata) fields, in their order: dtype, axis, ..."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("static"))

    def _to_metadata(self) -> dict:
        """The static fields as JSON values (dtype by name); `_from_metadata` reads them back.

        Four Over Six's fields only when set: a plain array's metadata is that of earlier
        versions. The checkpoint's writer and reader (`nvfp4_jax/_src/io/checkpoint/`)
        store and compare this dict.
        """
        meta = {name: getattr(self, name) for name in self._static_fields()}
        meta["dtype"] = jnp.dtype(self.dtype).name
        if self.four_over_six is None:
            for name in self._FOUR_OVER_SIX_FIELDS:
                del meta[name]
        return meta

    @classmethod
    def _from_metadata(cls, meta: Mapping, **parts) -> NVFP4Array:
        """The NVFP4Array of the array `parts` with the static fields of `meta`.

        `meta` is `_to_metadata`'s dict (other keys are ignored): a field it lacks takes its
        default (a missing required one None, for `validate_nvfp4_array` to reject); dtype is
        a name or a dtype. Not validated.
        """
        static = {}
        for field in dataclasses.fields(cls):
            if field.metadata.get("static"):
                default = None if field.default is dataclasses.MISSING else field.default
                static[field.name] = meta.get(field.name, default)
        if static["dtype"] is not None:
            static["dtype"] = jnp.dtype(static["dtype"])
        return cls(**parts, **static)

    def __repr__(self) -> str:
        four_over_six = (
            ""
            if self.four_over_six is None
            else f", four_over_six={self.four_over_six!r}, e4m3_max={self.e4m3_max}"
        )
        return (
            f"NVFP4Array(shape={self.shape}, dtype={jnp.dtype(self.dtype).name}, axis={self.axis}, "
            f"block_2d={self.block_2d}, rht={self.rht}{four_over_six})"
        )


def is_nvfp4_array(value) -> bool:
    """Returns True if `value` is an `NVFP4Array`.

    Useful as `is_leaf` of `jax.tree` functions, to treat each quantized tensor as one leaf.

    Example:
      >>> import jax, jax.numpy as jnp, nvfp4_jax
      >>> tree = {"w": nvfp4_jax.quantize(jnp.ones((16, 32))), "b": jnp.zeros(32)}
      >>> jax.tree.map(nvfp4_jax.is_nvfp4_array, tree, is_leaf=nvfp4_jax.is_nvfp4_array)
      {'b': False, 'w': True}

    """
    return isinstance(value, NVFP4Array)


# The array parts (leaves) every NVFP4Array has, and the dtype of each part, the optional
# decode_scale's too: the home of the part dtypes (the checkpoint stores these).
PARTS = ("codes", "scales", "amax")
PART_DTYPES = {
    "codes": jnp.uint8,
    "scales": jnp.float8_e4m3fn,
    "amax": jnp.float32,
    "decode_scale": jnp.float32,
}


def validate_nvfp4_array(q: NVFP4Array, name: str = "NVFP4Array") -> NVFP4Array:
    """Checks the invariants of `NVFP4Array`'s docstring; returns `q` or raises.

    Works on concrete arrays and on `jax.ShapeDtypeStruct` leaves (only shapes, dtypes and
    metadata are read).

    Raises:
      TypeError: a leaf or the `dtype` metadata has the wrong dtype, or metadata the wrong
        type.
      ValueError: shapes that do not fit together, or an invalid `axis`.
    """
    if not is_nvfp4_array(q):
        raise TypeError(f"{name}: expected an NVFP4Array, got {type(q).__name__}")
    for part in PARTS:
        leaf, dtype = getattr(q, part), PART_DTYPES[part]
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(f"{name}: {part} must be an array, got {type(leaf).__name__}")
        if jnp.dtype(leaf.dtype) != jnp.dtype(dtype):
            raise TypeError(f"{name}: {part} must be {jnp.dtype(dtype)}, got {leaf.dtype}")
    codes, scales, amax = (tuple(getattr(q, part).shape) for part in PARTS)
    columns = 2 * codes[-1] if codes else 0
    if not codes or columns % formats.BLOCK_SIZE:
        raise ValueError(f"{name}: codes {codes} must hold a multiple of 16 codes per row")
    if scales != (*codes[:-1], columns // formats.BLOCK_SIZE):
        raise ValueError(
            f"{name}: codes {codes} need scales of shape "
            f"{(*codes[:-1], columns // formats.BLOCK_SIZE)}, got {scales}"
        )
    if len(amax) >= len(codes) or amax != codes[: len(amax)]:
        raise ValueError(f"{name}: amax of shape {amax} does not fit codes {codes}")
    _validate_decode_scale(q.decode_scale, name, amax)
    _validate_metadata(q, name, codes, rank=len(codes) - len(amax))
    return q


def _validate_decode_scale(decode_scale, name: str, amax_shape: tuple[int, ...]) -> None:
    if decode_scale is None:
        return
    dtype = jnp.dtype(PART_DTYPES["decode_scale"])
    if not hasattr(decode_scale, "shape") or jnp.dtype(decode_scale.dtype) != dtype:
        raise TypeError(f"{name}: decode_scale must be None or float32, got {decode_scale!r}")
    if tuple(decode_scale.shape) != amax_shape:
        raise ValueError(
            f"{name}: decode_scale of shape {tuple(decode_scale.shape)} must be shaped like "
            f"amax {amax_shape}"
        )


def _validate_metadata(q: NVFP4Array, name: str, codes: tuple[int, ...], rank: int) -> None:
    """The static fields against codes of shape `codes` holding tensors of rank `rank`."""
    for flag in ("block_2d", "rht"):
        checks.check_flag(getattr(q, flag), name, flag)
    if isinstance(q.axis, bool) or not isinstance(q.axis, int):
        raise TypeError(f"{name}: axis must be an int, got {q.axis!r}")
    if not -rank <= q.axis < 0:
        raise ValueError(
            f"{name}: axis must be negative and within the {rank} dims of one tensor "
            f"(codes {codes}), got {q.axis}"
        )
    if q.block_2d and (rank < 2 or codes[-2] % formats.BLOCK_SIZE):
        raise ValueError(f"{name}: block_2d needs rows in multiples of 16, got codes {codes}")
    checks.check_dtype(q.dtype, name, "dtype")
    mode, _ = checks.check_four_over_six(q.four_over_six, q.e4m3_max, name, "e4m3_max")
    if mode is None and q.e4m3_max != formats.E4M3_MAX:
        raise ValueError(
            f"{name}: e4m3_max={q.e4m3_max} needs four_over_six; plain NVFP4 has e4m3_max=448"
        )


# `NVFP4Array.dequantize` calls the public `nvfp4_jax.dequantize`, which lives in a layer
# above this one (`nvfp4_jax.ops`); that module hands it down with `bind_dequantize` when it
# is imported, which `import nvfp4_jax` always does. So this module imports nothing above it.
_dequantize_impl: Callable[..., jax.Array] | None = None


def bind_dequantize(fn: Callable[..., jax.Array]) -> None:
    """Sets the function `NVFP4Array.dequantize` calls (done once by `nvfp4_jax.ops`)."""
    global _dequantize_impl
    _dequantize_impl = fn


def _dequantize_method(q: NVFP4Array, dtype, *, implementation) -> jax.Array:
    if _dequantize_impl is None:
        raise RuntimeError("NVFP4Array.dequantize: import nvfp4_jax first")
    return _dequantize_impl(q, dtype, implementation=implementation)


__all__ = ["NVFP4Array", "bind_dequantize", "is_nvfp4_array", "validate_nvfp4_array"]
