"""NVFP4Recipe: which operand of which GEMM gets which quantization."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from nvfp4_jax import formats

Implementation = Literal["reference", "ffi"] | None
GemmBackend = Literal["emulated", "scaled_matmul"] | None


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

    Example:
      >>> NVFP4Recipe(stochastic_rounding=False).weight_2d
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
    implementation: Implementation = None
    # The three GEMMs: "emulated" (NUMERICS section 9 in `gemm_dtype`, any platform),
    # "scaled_matmul" (`jax.nn.scaled_matmul` on Blackwell; an error elsewhere), or None:
    # "scaled_matmul" on CUDA devices of compute capability >= 10, else "emulated".
    gemm_backend: GemmBackend = None

    def __post_init__(self):
        for name in ("weight_2d", "wgrad_rht", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"NVFP4Recipe.{name} must be a bool, got {getattr(self, name)!r}")
        if jnp.dtype(self.gemm_dtype) not in formats.SUPPORTED_DTYPES:
            raise TypeError(
                f"NVFP4Recipe.gemm_dtype must be bfloat16, float16 or float32, got "
                f"{self.gemm_dtype!r}"
            )
        object.__setattr__(self, "gemm_dtype", jnp.dtype(self.gemm_dtype))
        if self.implementation not in (None, "reference", "ffi"):
            raise ValueError(
                f"NVFP4Recipe.implementation must be None, 'reference' or 'ffi', got "
                f"{self.implementation!r}"
            )
        if self.gemm_backend not in (None, "emulated", "scaled_matmul"):
            raise ValueError(
                f"NVFP4Recipe.gemm_backend must be None, 'emulated' or 'scaled_matmul', got "
                f"{self.gemm_backend!r}"
            )
