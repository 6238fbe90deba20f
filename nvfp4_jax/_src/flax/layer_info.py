"""What an nnx layer computes with, and whether it can compute in NVFP4.

`layer_recipe(layer)` reads the recipe a linear, einsum or experts layer computes with now
(None: high precision). The `*_problem` functions say why a layer cannot compute in NVFP4
("" when it can): a frozen quantized weight (`frozen_problem`), a subclass computing its own
way, sizes that are not multiples of 16, an einsum that is not a plain dense contraction.
The `*_stack` functions read the leading layer axes of a stacked layer's kernel (one made
under `nnx.vmap` and run under `nnx.scan`).
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.flax.einsum import NVFP4Einsum, einsum_plan
from nvfp4_jax._src.training.recipe import NVFP4Recipe


def _is_nvfp4_linear(layer) -> bool:
    return isinstance(layer, nvfp4_nnx.Linear)


def dot_general_recipe(fn) -> NVFP4Recipe | None:
    """The recipe of a `nvfp4_dot_general(recipe)` function, None for any other function."""
    recipe = getattr(fn, "nvfp4_recipe", None)
    return recipe if isinstance(recipe, NVFP4Recipe) else None


def layer_recipe(layer) -> NVFP4Recipe | None:
    """The recipe an nnx layer computes with now, or None for high precision.

    An `nvfp4_jax.nnx.Linear` computes with its `recipe`, an `nnx.Linear` built with
    `dot_general=nvfp4_dot_general(recipe)` with that recipe, an `nnx.Einsum` with
    `einsum_op=NVFP4Einsum(recipe)` with that one, an `nvfp4_jax.nnx.Experts` with its
    `recipe`; a frozen layer (`frozen_problem`) and any other layer in high precision.

    Example:
      >>> from nvfp4_jax import nvfp4_dot_general
      >>> layer = nnx.Linear(32, 16, dot_general=nvfp4_dot_general(), rngs=nnx.Rngs(0))
      >>> layer_recipe(layer) == NVFP4Recipe()
      True
    """
    if frozen_problem(layer):
        return None
    if _is_nvfp4_linear(layer):
        return layer.recipe
    if isinstance(layer, nnx.Linear):
        return dot_general_recipe(layer.dot_general)
    if isinstance(layer, nnx.Einsum) and isinstance(layer.einsum_op, NVFP4Einsum):
        return layer.einsum_op.recipe
    if isinstance(layer, nvfp4_nnx.Experts):
        return layer.recipe
    return None


def frozen_problem(layer) -> str:
    """Why rules leave `layer` as it is because its weight is frozen ("" if it is not).

    Every frozen nnx layer (`Linear.from_quantized`, `Experts.from_quantized`) holds its
    weight as an `nvfp4_jax.nnx.QuantizedKernel`: an `NVFP4Array` that computes the same
    whatever a rule says, and that has no float weight to quantize or keep in high precision.

    Example:
      >>> frozen_problem(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
      ''
    """
    if isinstance(getattr(layer, "kernel", None), nvfp4_nnx.QuantizedKernel):
        # A frozen layer is built by its base class's constructor (`Linear.from_quantized`).
        name = type(layer).__name__.removeprefix("Frozen")
        return f"a frozen quantized weight ({name}.from_quantized)"
    return ""


def linear_kind_problem(layer: nnx.Linear) -> str:
    """Why rules leave an `nnx.Linear` subclass as it is ("" for `nnx.Linear` or ours)."""
    if type(layer) not in (nnx.Linear, nvfp4_nnx.Linear):
        return f"a subclass of nnx.Linear ({type(layer).__name__}) computes its own way"
    return ""


def weight_problem(shape: Sequence[int]) -> str:
    """Why a weight of `shape` cannot be an NVFP4 GEMM operand ("" if it can).

    Example:
      >>> weight_problem((24, 16))
      'in_features=24 and out_features=16 must be multiples of 16'
    """
    shape = tuple(shape)
    if len(shape) != 2:
        return f"its kernel {shape} is not a 2-D (in, out) matrix"
    if shape[0] % formats.BLOCK_SIZE or shape[1] % formats.BLOCK_SIZE:
        return (
            f"in_features={shape[0]} and out_features={shape[1]} must be multiples of "
            f"{formats.BLOCK_SIZE}"
        )
    return ""


def linear_stack(layer: nnx.Linear) -> tuple[int, ...] | None:
    """The leading layer axes of an `nnx.Linear`'s kernel: `()` for a plain (K, N) kernel.

    A stacked layer (made under `nnx.vmap`, run under `nnx.scan` over the layer axis, as in
    Flax's "scan over layers") holds a kernel `(L, K, N)` while its `in_features` and
    `out_features` are K and N: each step of the scan sees one (K, N) kernel. None when the
    kernel's last two axes are not `(in_features, out_features)`.

    Example:
      >>> linear_stack(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
      ()
    """
    shape = tuple(layer.kernel.shape)
    if len(shape) < 2 or shape[-2:] != (layer.in_features, layer.out_features):
        return None
    return shape[:-2]


def experts_stack(layer: nvfp4_nnx.Experts) -> tuple[int, ...] | None:
    """The leading layer axes of an `Experts` kernel `(*stack, G, K, N)`: `()` for (G, K, N).

    None when the kernel's last three axes are not `(num_experts, in_features, out_features)`.
    """
    shape = tuple(layer.kernel.shape)
    if len(shape) < 3 or shape[-3:] != (layer.num_experts, layer.in_features, layer.out_features):
        return None
    return shape[:-3]


def experts_problem(layer: nvfp4_nnx.Experts) -> str:
    """Why an `nvfp4_jax.nnx.Experts` layer cannot compute in NVFP4 ("" if it can).

    Each expert's (K, N) matrix is one GEMM's weight: K and N must be multiples of 16. Frozen
    experts (`Experts.from_quantized`) cannot (`frozen_problem`).

    Example:
      >>> experts_problem(nvfp4_nnx.Experts(4, 24, 16, recipe=None, rngs=nnx.Rngs(0)))
      'in_features=24 and out_features=16 must be multiples of 16'
    """
    problem = frozen_problem(layer)
    if problem:
        return problem
    if type(layer) is not nvfp4_nnx.Experts:
        return f"a subclass of Experts ({type(layer).__name__}) computes its own way"
    if experts_stack(layer) is None:
        return (
            f"its kernel {tuple(layer.kernel.shape)} is not a stack of ({layer.num_experts}, "
            f"{layer.in_features}, {layer.out_features}) expert matrices"
        )
    return weight_problem(tuple(layer.kernel.shape)[-2:])


def layer_stack(layer) -> tuple[int, ...]:
    """The leading layer axes of a stacked layer's kernel (`()` for a plain one)."""
    if isinstance(layer, nnx.Linear):
        return linear_stack(layer) or ()
    if isinstance(layer, nvfp4_nnx.Experts):
        return experts_stack(layer) or ()
    return ()


def linear_shape_problem(layer: nnx.Linear) -> str:
    """Why an `nnx.Linear`'s kernel cannot be an NVFP4 weight, plain or stacked ("" if it can)."""
    shape = tuple(layer.kernel.shape)
    if linear_stack(layer) is None:
        return (
            f"its kernel {shape} is neither an (in, out) = ({layer.in_features}, "
            f"{layer.out_features}) matrix nor a stack of them"
        )
    return weight_problem(shape[-2:])


def linear_problem(layer: nnx.Linear) -> str:
    """Why the `nnx.Linear` `layer` cannot compute in NVFP4 ("" if it can).

    It cannot when it is a subclass (its own `__call__` would be lost), a frozen quantized
    layer (`Linear.from_quantized`), or its sizes are not multiples of 16. A stacked layer
    (kernel `(L, K, N)`, see `linear_stack`) can: each of its (K, N) slices is one GEMM.

    Example:
      >>> linear_problem(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
      ''
    """
    return frozen_problem(layer) or linear_kind_problem(layer) or linear_shape_problem(layer)


def einsum_problem(layer: nnx.Einsum) -> str:
    """Why an `nnx.Einsum` cannot compute in NVFP4 (`einsum_plan`; "" if it can)."""
    if type(layer) is not nnx.Einsum:
        return f"a subclass of nnx.Einsum ({type(layer).__name__}) computes its own way"
    if layer.einsum_str is None:
        return "its einsum_str is given at call time"
    try:
        einsum_plan(layer.einsum_str, tuple(layer.kernel.shape))
    except ValueError as error:
        return f"{layer.einsum_str!r}: {error}"
    return ""
