"""QuantSpec: how one tensor is quantized, as one frozen, hashable value.

The options of a quantizing op (the quantized axis, 16x16 blocks, the RHT, stochastic
rounding, Four Over Six and its E4M3 maximum, and for `fake_quantize` the tensor factor and
the result dtype) travel together: the public ops build a `QuantSpec` once at their edge,
where it is validated (with the messages of the shared `checks`), and hand it whole to
the backends, the reference and the kernel bindings, which build their FFI attributes from
it in one place (`ffi_target`). Being hashable, it is the static argument of the ops'
`custom_jvp` rules and the cache key of the kernels' sharding rules. `NVFP4Recipe` produces
the spec of every GEMM operand (`NVFP4Recipe.spec`).

The data-dependent arguments are not part of it: the tensor, its amax and the stochastic
rounding key (an `SRSeed`) stay arguments of their own.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import checks

# The FFI targets a spec names (`ffi_target`): the plain ones, whose attributes are the flags,
# and under Four Over Six their `_4over6` twins, which take `error` and `e4m3_max` too.
_QUANTIZE_TARGETS = ("nvfp4_quantize", "nvfp4_fake_quantize")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """The static options of one quantization; validated when it is made.

    Attributes:
      axis: the quantized axis of the tensor the spec is applied to (checked against its
        shape where it meets one, `check_shape`; -1 in the stored layout the backends see).
      block_2d: 16x16 blocks (one scale per tile) instead of 1x16.
      rht: the Random Hadamard Transform along `axis` first.
      stochastic_rounding: round the E2M1 codes stochastically (the key is an argument of
        its own, not part of the spec).
      four_over_six: None (plain NVFP4), "mae" or "mse" (docs/NUMERICS.md section 13).
      e4m3_max: the E4M3 maximum M of the global scale, `S_enc = 6M / A`: given as
        `four_over_six_e4m3_max` (256 or 448), and 448 whenever `four_over_six` is None.
      global_scale: `fake_quantize` only: multiply the values by the tensor decode factor.
      dtype: `fake_quantize` only: the dtype of the values (None: the input's).
      op: the op named in error messages; not part of the value (neither compared nor hashed).

    Example:
      >>> QuantSpec(block_2d=True, four_over_six="mse", e4m3_max=256).e4m3_max
      256
      >>> QuantSpec(e4m3_max=256).e4m3_max  # plain NVFP4 uses 448
      448
    """

    axis: int = -1
    block_2d: bool = False
    rht: bool = False
    stochastic_rounding: bool = False
    four_over_six: str | None = None
    e4m3_max: int = 448
    global_scale: bool = True
    dtype: jnp.dtype | None = None
    op: str = dataclasses.field(default="quantize", compare=False, repr=False)

    def __post_init__(self):
        op = self.op
        for name in ("block_2d", "rht", "stochastic_rounding"):
            object.__setattr__(self, name, checks.check_flag(getattr(self, name), op, name))
        mode, e4m3_max = checks.check_four_over_six(self.four_over_six, self.e4m3_max, op)
        object.__setattr__(self, "four_over_six", mode)
        object.__setattr__(self, "e4m3_max", e4m3_max)
        global_scale = checks.check_flag(self.global_scale, op, "global_scale")
        object.__setattr__(self, "global_scale", global_scale)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", checks.check_dtype(self.dtype, op))

    def replace(self, **changes) -> QuantSpec:
        """This spec with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_shape(self, shape: tuple[int, ...]) -> QuantSpec:
        """The spec for a tensor of `shape`: its axis as a negative index, the blocks checked.

        Raises for a rank-0 tensor, an axis that is not an int in range, or a quantized axis
        (with `block_2d`, stored rows) that is not a multiple of 16.
        """
        op = self.op
        if len(shape) == 0:
            raise ValueError(f"{op}: x must have at least one dimension, got shape {shape}")
        axis = checks.normalize_axis(self.axis, shape, op)
        checks.check_blocks(shape, axis, self.block_2d, op)
        return self if axis == self.axis else self.replace(axis=axis)

    def stored(self) -> QuantSpec:
        """The spec of the stored layout (the quantized axis last): what backends receive."""
        return self if self.axis == -1 else self.replace(axis=-1)

    def ffi_target(self, name: str) -> tuple[str, dict]:
        """The FFI target and attributes of the quantizing target `name` for this spec.

        `name` is "nvfp4_quantize" or "nvfp4_fake_quantize". The plain targets take
        `block_2d`, `rht` and `stochastic_rounding` (and fake quantize `global_scale`); under
        Four Over Six their `_4over6` twins take `error` and `e4m3_max` (i32) as well.
        """
        if name not in _QUANTIZE_TARGETS:
            raise ValueError(f"QuantSpec.ffi_target: unknown target {name!r}")
        attrs = dict(
            block_2d=self.block_2d, rht=self.rht, stochastic_rounding=self.stochastic_rounding
        )
        if name == "nvfp4_fake_quantize":
            attrs["global_scale"] = self.global_scale
        if self.four_over_six is None:
            return name, attrs
        attrs.update(error=self.four_over_six, e4m3_max=np.int32(self.e4m3_max))
        return f"{name}_4over6", attrs
