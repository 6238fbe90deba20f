"""QuantSpec: how one tensor is quantized, as one frozen, hashable value; and the call checks.

The options of a quantizing op (the quantized axis, 16x16 blocks, the RHT, stochastic
rounding, Four Over Six and its E4M3 maximum, and for `fake_quantize` the tensor factor and
the result dtype) travel together: the public ops build a `QuantSpec` once at their edge
(the only place that spells them as keywords), where it is validated with the messages of
the shared `checks`, and hand it whole to everything below: the backends, the reference,
the kernel bindings (which build their FFI attributes from it in one place, `ffi_target`),
the GEMM operands and the diagnostics. Being hashable, it is the static argument of the
ops' `custom_jvp` rules and the cache key of the kernels' sharding rules. `NVFP4Recipe`
produces the spec of every GEMM operand (`NVFP4Recipe.spec`).

The data-dependent arguments are not part of it: the tensor, its amax and the stochastic
rounding key (an `SRSeed`) stay arguments of their own. `QuantSpec.check_call` checks them,
for every implementation, so that every entry point rejects bad input with one message, and
`QuantSpec.array` wraps a quantize result as an `NVFP4Array`.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import checks, formats
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.sr_seed import as_seed

# The FFI targets a spec names (`ffi_target`): the plain ones, whose attributes are the flags,
# and under Four Over Six their `_4over6` twins, which take `error` and `e4m3_max` too.
_QUANTIZE_TARGETS = ("nvfp4_quantize", "nvfp4_fake_quantize")
# The public ops' keywords whose spec field has another name.
_KEYWORD_FIELDS = {"four_over_six_e4m3_max": "e4m3_max"}


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
      ms_eden: MS-EDEN (docs/NUMERICS.md section 14): a random rotation of every 128
        values along `axis`, round to nearest, the EDEN correction of each 128-group and the
        corrected E4M3 scales rounded stochastically; the key and the rotation are
        arguments of their own. Excludes `block_2d`, `rht`, `stochastic_rounding` and
        `four_over_six`; the quantized axis must be a multiple of 128.
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
    ms_eden: bool = False
    global_scale: bool = True
    dtype: jnp.dtype | None = None
    op: str = dataclasses.field(default="quantize", compare=False, repr=False)

    def __post_init__(self):
        op = self.op
        for name in ("block_2d", "rht", "stochastic_rounding", "ms_eden"):
            object.__setattr__(self, name, checks.check_flag(getattr(self, name), op, name))
        mode, e4m3_max = checks.check_four_over_six(self.four_over_six, self.e4m3_max, op)
        object.__setattr__(self, "four_over_six", mode)
        object.__setattr__(self, "e4m3_max", e4m3_max)
        if self.ms_eden:
            others = ("block_2d", "rht", "stochastic_rounding", "four_over_six")
            clash = [f"{name}={getattr(self, name)!r}" for name in others if getattr(self, name)]
            if clash:
                raise ValueError(
                    f"{op}: ms_eden=True rotates and rounds in its own way; it cannot be "
                    f"combined with {', '.join(clash)}"
                )
        global_scale = checks.check_flag(self.global_scale, op, "global_scale")
        object.__setattr__(self, "global_scale", global_scale)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", checks.check_dtype(self.dtype, op))

    @classmethod
    def from_keywords(cls, op: str, /, *, e4m3_max_default: int = 256, **keywords) -> QuantSpec:
        """The spec of quantize options given as keywords: field names or the public names.

        `four_over_six_e4m3_max` (the public ops' name) is `e4m3_max`, which defaults to
        `e4m3_max_default` (used only under Four Over Six). An unknown keyword is a TypeError
        naming it.
        """
        fields = {f.name for f in dataclasses.fields(cls)} - {"op"}
        spec = {}
        for name, value in keywords.items():
            field = _KEYWORD_FIELDS.get(name, name)
            if field not in fields or field in spec:
                raise TypeError(f"{op}: got an unexpected keyword argument {name!r}")
            spec[field] = value
        spec.setdefault("e4m3_max", e4m3_max_default)
        return cls(**spec, op=op)

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
        if self.ms_eden and shape[axis] % formats.MS_EDEN_GROUP:
            raise ValueError(
                f"{op}: ms_eden=True rotates groups of {formats.MS_EDEN_GROUP}: the quantized "
                f"axis (axis={axis}) of x with shape {tuple(shape)} has size {shape[axis]}, "
                f"which is not a multiple of {formats.MS_EDEN_GROUP}"
            )
        return self if axis == self.axis else self.replace(axis=axis)

    @property
    def random(self) -> bool:
        """Whether the quantization draws random bits from a key (SR or MS-EDEN)."""
        return self.stochastic_rounding or self.ms_eden

    def check_call(self, x, key, amax, *, rotation=None, amax_is_data: bool = False):
        """Validated (x, the spec for x's shape, seed or None, f32 amax or None, rotation).

        The argument checks of a quantizing call that the spec (validated when it was made)
        cannot do alone, shared by every entry point and implementation, so they raise the
        same errors. The seed is the `SRSeed` of `key` when the spec draws random bits (SR,
        MS-EDEN); the rotation is MS-EDEN's uint32 (4,) words (`rotation_words`), None
        otherwise. A caller's concrete amax that is negative, NaN or inf is an error; with
        `amax_is_data` (an amax the library computed or stores, e.g. a GEMM operand's
        `tensor_amax`) only its type is checked: such an amax is NaN exactly when the data
        is, and gives the NaN tensor eagerly as under `jit`.
        """
        op = self.op
        x = checks.as_float_array(x, op)
        for flag in ("stochastic_rounding", "ms_eden"):
            if getattr(self, flag) and key is None:
                raise ValueError(f"{op}: {flag}=True needs a PRNG key, got key=None")
        spec = self.check_shape(x.shape)
        seed = as_seed(key, op) if spec.random else None
        rotation = rotation_words(rotation, op) if spec.ms_eden else None
        if amax is not None and amax_is_data:
            return x, spec, seed, _amax_data(amax, op), rotation
        return x, spec, seed, checks.check_amax(amax, op), rotation

    def stored(self) -> QuantSpec:
        """The spec of the stored layout (the quantized axis last): what backends receive."""
        return self if self.axis == -1 else self.replace(axis=-1)

    def with_dtype(self, dtype) -> QuantSpec:
        """A fake-quantize spec with its values' dtype: `dtype` (the input's) when it has none."""
        return self if self.dtype is not None else self.replace(dtype=dtype)

    def array(self, codes, scales, stored_amax, dtype) -> NVFP4Array:
        """The `NVFP4Array` of a quantize result under this spec (its axis: the logical one).

        A Four Over Six one carries its decode factor: `D = A * f32(1/(6M))` goes into
        `decode_scale` (section 13), so that checkpoints and exports, which keep the leaves,
        decode it right whatever they make of the metadata.
        """
        fos = self.four_over_six
        decode = None
        if fos is not None:
            decode = formats.decode_scale(stored_amax, self.e4m3_max)
        elif self.ms_eden:
            decode = formats.ms_eden_decode_scale(stored_amax)
        return NVFP4Array(
            codes=codes,
            scales=scales,
            amax=stored_amax,
            dtype=jnp.dtype(dtype),
            axis=self.axis,
            block_2d=self.block_2d,
            rht=self.rht,
            decode_scale=decode,
            four_over_six=fos,
            e4m3_max=self.e4m3_max,
        )

    def decode_scale(self, amax) -> jax.Array:
        """The tensor decode factor D of a tensor of amax `amax` quantized by this spec.

        `A * f32(1/(6M))` (`A * RCP2688` for plain NVFP4), or MS-EDEN's `A * f32(1/C)`.
        """
        if self.ms_eden:
            return formats.ms_eden_decode_scale(amax)
        return formats.decode_scale(amax, self.e4m3_max)

    def ffi_target(self, name: str) -> tuple[str, dict]:
        """The FFI target and attributes of the quantizing target `name` for this spec.

        `name` is "nvfp4_quantize" or "nvfp4_fake_quantize". The plain targets take
        `block_2d`, `rht` and `stochastic_rounding` (and fake quantize `global_scale`); under
        Four Over Six their `_4over6` twins take `error` and `e4m3_max` (i32) as well; under
        MS-EDEN the `_ms_eden` twins take the rotation as a fourth operand and no flags but
        fake quantize's `global_scale`.
        """
        if name not in _QUANTIZE_TARGETS:
            raise ValueError(f"QuantSpec.ffi_target: unknown target {name!r}")
        if self.ms_eden:  # operands (x, amax, key, rotation); no flags but global_scale
            attrs = dict(global_scale=self.global_scale) if name == "nvfp4_fake_quantize" else {}
            return f"{name}_ms_eden", attrs
        attrs = dict(
            block_2d=self.block_2d, rht=self.rht, stochastic_rounding=self.stochastic_rounding
        )
        if name == "nvfp4_fake_quantize":
            attrs["global_scale"] = self.global_scale
        if self.four_over_six is None:
            return name, attrs
        attrs.update(error=self.four_over_six, e4m3_max=np.int32(self.e4m3_max))
        return f"{name}_4over6", attrs


def rotation_words(rotation, op: str) -> jax.Array:
    """MS-EDEN's rotation as uint32 (4,): a PRNG key's bits, or such words as they are.

    A key gives `jax.random.bits(key, (4,), uint32)`: bit `i % 32` of word `i // 32` set
    means that sign i of the 128 is -1 (docs/NUMERICS.md section 14).
    """
    if rotation is None:
        raise ValueError(
            f"{op}: ms_eden=True needs rotation_key (the random signs of the rotation, shared "
            "by the two operands of a GEMM), got None"
        )
    dtype = getattr(rotation, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if jnp.shape(rotation) != ():
            raise ValueError(f"{op}: rotation_key must be one PRNG key, got shape {rotation.shape}")
        return jax.random.bits(rotation, (4,), jnp.uint32)
    if dtype is not None and jnp.dtype(dtype) == jnp.uint32 and jnp.shape(rotation) == (4,):
        return jnp.asarray(rotation)
    raise TypeError(
        f"{op}: rotation_key must be a JAX PRNG key (or its uint32 (4,) rotation words), got "
        f"{getattr(rotation, 'dtype', type(rotation).__name__)}{list(jnp.shape(rotation))}"
    )


def _amax_data(amax, op: str) -> jax.Array:
    """A computed amax as an f32 scalar, NaN, inf or negative included (a NaN tensor)."""
    amax = jnp.asarray(amax)
    if amax.shape != () or not jnp.issubdtype(amax.dtype, jnp.floating):
        raise TypeError(f"{op}: amax must be a float scalar, got {amax.dtype} {amax.shape}")
    return amax.astype(jnp.float32)


def spec_of_call(
    spec, options: dict, op: str, *, e4m3_max_default: int = 256, deprecated: bool = False
) -> QuantSpec:
    """The spec of a function that takes a `QuantSpec`, or its options as keywords.

    `spec` is used as it is; with `spec` None the keywords `options` make one
    (`QuantSpec.from_keywords`), with a DeprecationWarning where `deprecated` (the functions
    that once spelled the options out and now take the spec). Giving both is a TypeError.
    """
    if spec is None:
        if deprecated and options:
            warnings.warn(
                f"{op}: the quantize options as keywords are deprecated; pass a QuantSpec",
                DeprecationWarning,
                stacklevel=3,
            )
        return QuantSpec.from_keywords(op, e4m3_max_default=e4m3_max_default, **options)
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{op}: spec must be a QuantSpec, got {type(spec).__name__}")
    if options:
        raise TypeError(f"{op}: pass a QuantSpec or the options {sorted(options)}, not both")
    return spec


def check_dequantize_call(q, dtype, op: str) -> jnp.dtype:
    """Checks the arguments of an op that decodes `q`; returns `dtype` as a jnp dtype.

    For every implementation, so they raise the same errors.
    """
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"{op}: q must be an NVFP4Array, got {type(q).__name__}")
    return checks.check_dtype(dtype, op)


__all__ = ["QuantSpec", "check_dequantize_call", "rotation_words", "spec_of_call"]
