"""NVFP4Recipe: which operand of which GEMM gets which quantization."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import typing
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import backends, checks, formats
from nvfp4_jax._src.core.backends import Implementation
from nvfp4_jax._src.core.spec import QuantSpec

# The backward quantizations: NVIDIA's recipe, or Quartet II's MS-EDEN (docs/NUMERICS.md 14).
Backward = Literal["nvidia", "ms_eden"]
BACKWARDS = typing.get_args(Backward)
# The GEMM backends of `nvfp4_jax.gemm`: emulated anywhere, or `jax.nn.scaled_matmul`.
GemmBackend = Literal["emulated", "scaled_matmul"]
GEMM_BACKENDS = typing.get_args(GemmBackend)
# The operand classes Four Over Six is chosen for: W, x and dy.
FOUR_OVER_SIX_OPERANDS = ("weight", "activation", "gradient")
# The operands of a dense layer's three GEMMs (operand class, GEMM): `NVFP4Recipe.spec`'s.
GEMM_OPERANDS = (
    ("activation", "fprop"),
    ("weight", "fprop"),
    ("gradient", "dgrad"),
    ("weight", "dgrad"),
    ("activation", "wgrad"),
    ("gradient", "wgrad"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4Recipe:
    """The NVFP4 training recipe of a dense layer's three GEMMs (NVIDIA's NVFP4 paper).

    | GEMM                | operand | blocks              | RHT            | SR                    |
    | fprop  y = x W      | x       | 1x16 along K        | no             | no                    |
    | fprop               | W       | 16x16 (`weight_2d`) | no             | no                    |
    | dgrad  dx = dy W^T  | dy      | 1x16 along N        | no             | `stochastic_rounding` |
    | dgrad               | W       | the fprop W         | no             | no                    |
    | wgrad  dW = x^T dy  | x, dy   | 1x16 along tokens   | `wgrad_rht`    | dy: SR                |

    Every switch is on by default; with all of them off every operand is still quantized
    (1x16, round to nearest). Hashable, so it can be a static argument of `jax.jit`.

    Four Over Six (docs/NUMERICS.md section 13) per operand class: `weight_four_over_six`
    (W, both its GEMMs), `activation_four_over_six` (x, in fprop and wgrad) and
    `gradient_four_over_six` (dy, in dgrad and wgrad), each None (plain NVFP4), "mae" or
    "mse", with the global scale's E4M3 maximum `four_over_six_e4m3_max` (256 or 448). Under
    4/6 a stochastically rounded dy keeps SR inside the chosen candidate (section 13).

    `fprop`, `dgrad` and `wgrad` choose each GEMM's precision (a precision schedule, e.g. a
    high-precision forward late in training): True runs it in NVFP4 as above, False in high
    precision, on the unquantized operands in their own dtypes with f32 accumulation, as
    `jax.lax.dot_general(..., preferred_element_type=float32)` and its autodiff compute it
    (docs/NUMERICS.md section 9). The other switches only concern the GEMMs in NVFP4.

    `backward="ms_eden"` is Quartet II's backward (docs/NUMERICS.md section 14): the forward
    is as above (round to nearest, 16x16 W with `weight_2d`, Four Over Six on W and x where
    set), and dgrad and wgrad multiply the forward's quantized operands and dy, each
    re-quantized with MS-EDEN along the GEMM's contraction axis (zero-padded to a multiple
    of 128), the two operands of a GEMM rotated with the same random signs, fresh every step
    from the layer's key. `stochastic_rounding` and `wgrad_rht` (NVIDIA's backward) do not
    apply; `gradient_four_over_six` cannot be combined with it.

    Example:
      >>> NVFP4Recipe(stochastic_rounding=False).weight_2d
      True
      >>> NVFP4Recipe(backward="ms_eden").random_backward
      True
    """

    # 16x16 weight blocks, so that W and W^T quantize to the same values (fprop = dgrad W).
    weight_2d: bool = True
    # Random Hadamard Transform of both wgrad operands along the token axis.
    wgrad_rht: bool = True
    # Stochastic rounding of the output gradient dy (dgrad and wgrad operands).
    stochastic_rounding: bool = True
    # The dtype the quantized operands are handed to the GEMM in; bf16 holds them exactly.
    gemm_dtype: jnp.dtype = jnp.bfloat16
    # None: the native kernels where built, else the reference; or "reference" / "ffi".
    implementation: Implementation | None = None
    # The three GEMMs: "emulated" (docs/NUMERICS.md section 9 in `gemm_dtype`, anywhere),
    # "scaled_matmul" (`jax.nn.scaled_matmul` on Blackwell; an error elsewhere), or None:
    # "scaled_matmul" on CUDA devices of compute capability >= 10, else "emulated".
    gemm_backend: GemmBackend | None = None
    # Each GEMM in NVFP4 (True) or in high precision (False): y = x W, dx = dy W^T, dW = x^T dy.
    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    # Four Over Six per operand class: None, "mae" or "mse"; and the E4M3 maximum M of the
    # global scale of every operand quantized with it (256 leaves room for the map-to-4).
    weight_four_over_six: str | None = None
    activation_four_over_six: str | None = None
    gradient_four_over_six: str | None = None
    four_over_six_e4m3_max: int = formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX
    # The backward GEMMs' quantization: "nvidia" (the switches above: dy stochastically
    # rounded, the wgrad operands rotated by the 16-point RHT) or "ms_eden" (Quartet II:
    # MS-EDEN on dy and the forward's quantized W and x, a random 128-point rotation).
    backward: Backward = "nvidia"

    def __post_init__(self):
        for name in ("weight_2d", "wgrad_rht", "stochastic_rounding", "fprop", "dgrad", "wgrad"):
            checks.check_flag(getattr(self, name), "NVFP4Recipe", name)
        dtype = checks.check_dtype(self.gemm_dtype, "NVFP4Recipe", "gemm_dtype")
        object.__setattr__(self, "gemm_dtype", dtype)
        for kind in FOUR_OVER_SIX_OPERANDS:
            name = f"{kind}_four_over_six"
            checks.check_four_over_six(getattr(self, name), 256, f"NVFP4Recipe.{name}")
        _, e4m3_max = checks.check_four_over_six(
            "mse", self.four_over_six_e4m3_max, "NVFP4Recipe", "four_over_six_e4m3_max"
        )
        object.__setattr__(self, "four_over_six_e4m3_max", e4m3_max)
        checks.check_choice(
            "NVFP4Recipe.implementation",
            self.implementation,
            tuple(backends.REGISTRY),
            allow_none=True,
        )
        checks.check_choice("NVFP4Recipe.backward", self.backward, Backward)
        if self.backward == "ms_eden" and self.gradient_four_over_six is not None:
            raise ValueError(
                "NVFP4Recipe: backward='ms_eden' quantizes dy with MS-EDEN; it cannot be "
                f"combined with gradient_four_over_six={self.gradient_four_over_six!r}"
            )
        checks.check_choice(
            "NVFP4Recipe.gemm_backend", self.gemm_backend, GemmBackend, allow_none=True
        )

    def four_over_six(self, operand: str) -> dict:
        """The `quantize` arguments of Four Over Six for an operand class.

        `operand` is "weight", "activation" or "gradient"; returns `four_over_six` and
        `four_over_six_e4m3_max` (`four_over_six` None: plain NVFP4).
        """
        checks.check_choice("NVFP4Recipe.four_over_six: operand", operand, FOUR_OVER_SIX_OPERANDS)
        return dict(
            four_over_six=getattr(self, f"{operand}_four_over_six"),
            four_over_six_e4m3_max=self.four_over_six_e4m3_max,
        )

    def spec(self, operand: str, gemm: str) -> QuantSpec:
        """The `QuantSpec` of one operand of one GEMM, in the layout the GEMM hands it over.

        | operand, GEMM     | layout      | axis                     | blocks | RHT         | SR |
        | activation, fprop | x (M, K)    | -1 (K)                   | 1x16   | no          | no |
        | weight, fprop     | W (K, N)    | 0 (K)                    | 2D     | no          | no |
        | weight, dgrad     | W (K, N)    | 0 (K); 1 (N) if not 2D   | 2D     | no          | no |
        | gradient, dgrad   | dy (M, N)   | -1 (N)                   | 1x16   | no          | SR |
        | activation, wgrad | x (M, K)    | 0 (M)                    | 1x16   | `wgrad_rht` | no |
        | gradient, wgrad   | dy^T (N, M) | -1 (M)                   | 1x16   | `wgrad_rht` | SR |

        (2D: 16x16 blocks with `weight_2d`, else 1x16; SR: `stochastic_rounding`.) Each
        operand class has its Four Over Six (`four_over_six(operand)`). The weight of dgrad
        is fprop's when `weight_2d` (16x16 tiles transpose exactly), else quantized again
        along N. Under `backward="ms_eden"` the four operands of dgrad and wgrad are MS-EDEN
        along their contraction axis (N for dgrad: axis 1 of W; M for wgrad: axis 0 of x;
        -1 for dy and dy^T), of dy and of the forward's quantized W and x.
        """
        checks.check_choice("NVFP4Recipe.spec: (operand, gemm)", (operand, gemm), GEMM_OPERANDS)
        if gemm != "fprop" and self.backward == "ms_eden":
            axis = {"weight": 1, "activation": 0, "gradient": -1}[operand]
            return QuantSpec(axis=axis, ms_eden=True)
        axis, block_2d, sr = -1, False, False
        if operand == "weight":
            axis = 0 if self.weight_2d or gemm != "dgrad" else 1
            block_2d = self.weight_2d
        elif operand == "activation":
            axis = 0 if gemm == "wgrad" else -1
        else:
            sr = self.stochastic_rounding
        rht = gemm == "wgrad" and self.wgrad_rht
        return QuantSpec(
            axis=axis,
            block_2d=block_2d,
            rht=rht,
            stochastic_rounding=sr,
            four_over_six=getattr(self, f"{operand}_four_over_six"),
            e4m3_max=self.four_over_six_e4m3_max,
        )

    def ms_eden_spec(self) -> QuantSpec:
        """The `QuantSpec` of an MS-EDEN backward operand in its stored layout (along -1)."""
        return QuantSpec(ms_eden=True)

    @property
    def random_backward(self) -> bool:
        """True when the backward draws random bits: the layers give such a recipe a key.

        Stochastic rounding of dy under `backward="nvidia"` (`stochastic_rounding`);
        MS-EDEN's rotation and scale rounding under `backward="ms_eden"`.
        """
        return self.backward == "ms_eden" or self.stochastic_rounding

    @property
    def uses_four_over_six(self) -> bool:
        """True when any operand class is quantized with Four Over Six."""
        return any(getattr(self, f"{k}_four_over_six") for k in FOUR_OVER_SIX_OPERANDS)


# --- the forward's precision chosen at run time (`high_precision_forward`) ---------------------

_HIGH_PRECISION_FORWARD: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "nvfp4_jax_high_precision_forward", default=None
)


@contextlib.contextmanager
def high_precision_forward(flag=True) -> Iterator[None]:
    """Inside, the NVFP4 GEMMs compute their forward in high precision where `flag` is true.

    `flag` is a bool, or a traced bool scalar: a jitted training step takes it as an argument
    and switches the forward of every NVFP4 `dot_general` and `ragged_dot` traced in the
    block (the layers', the drop-ins', the einsum's) between NVFP4 and high precision at run
    time, through `jax.lax.cond`, without compiling again. Where it is true a GEMM computes
    bit for bit what its recipe with `fprop=False` computes (docs/NUMERICS.md section 9); the
    backward GEMMs stay as the recipe says, with the same residuals and SR keys. A recipe
    whose `fprop` is already False ignores it; high-precision layers have no NVFP4 GEMM.
    This is the high-precision finish in one compiled step (docs/guides/training.md).

    Args:
      flag: a bool, or a bool scalar array (NumPy's or JAX's, traced or not).

    Raises:
      TypeError: when `flag` is not a bool or a bool scalar.

    Example:
      >>> import jax, jax.numpy as jnp, nvfp4_jax
      >>> @jax.jit
      ... def forward(x, w, finish):
      ...     with nvfp4_jax.high_precision_forward(finish):
      ...         return nvfp4_jax.dot_general(x, w, (((1,), (0,)), ((), ())))
      >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))  # exact in NVFP4 too
      >>> bool((forward(x, w, True) == forward(x, w, False)).all())
      True
      >>> forward._cache_size()  # one program for both
      1
    """
    value = jnp.asarray(flag) if isinstance(flag, bool | np.bool_ | np.ndarray) else flag
    if not isinstance(value, jax.Array) or (  # a tracer is a jax.Array too
        value.shape != () or value.dtype != jnp.bool_
    ):
        raise TypeError(
            "high_precision_forward: flag must be a bool or a bool scalar array, got "
            f"{getattr(value, 'dtype', type(value).__name__)}"
            f"{list(getattr(value, 'shape', ()))}"
        )
    token = _HIGH_PRECISION_FORWARD.set(value)
    try:
        yield
    finally:
        _HIGH_PRECISION_FORWARD.reset(token)


def forward_flag(recipe: NVFP4Recipe) -> jax.Array | None:
    """The `high_precision_forward` flag a GEMM with `recipe` obeys.

    None outside the block, or when the recipe's forward is not in NVFP4.
    """
    return _HIGH_PRECISION_FORWARD.get() if recipe.fprop else None
