"""The grouped GEMMs: `jax.lax.ragged_dot_general` with f32 accumulation, under `vmap` too.

`ragged_gemm` gives the forms `ragged_dot` runs (rows kept, or contracted into one result
per group), on the block values (times each group's `group_alpha`) or, where the recipe
puts a GEMM in high precision, on the unquantized operands (`high_precision`, and the
backward GEMMs autodiff would run). Under `vmap` every element is its own call, bit for bit:
the GEMMs broadcast what is shared (JAX batches `ragged_dot_general` only with every operand
batched).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax._src.core import primal_types

_F32 = jnp.float32


def ragged_gemm(lhs_contract: int, rhs_contract: int, rhs_group: int | None, batch: int = 0):
    """`jax.lax.ragged_dot_general` with the rows (axis 0) of lhs ragged, f32 accumulation.

    One cached function per form and per kind of mesh the operands' types are on: under
    Explicit axes the result's sharding must be stated (JAX infers none for a ragged dot;
    `ragged_dot` gathers the operands there).
    """

    def call(lhs, rhs, group_sizes):
        mesh = primal_types.mesh_of(lhs, rhs, group_sizes)
        explicit = mesh if mesh is not None and mesh.explicit_axes else None
        form = _cached_ragged_gemm(lhs_contract, rhs_contract, rhs_group, batch, explicit)
        return form(lhs, rhs, group_sizes)

    return call


@functools.cache
def _cached_ragged_gemm(
    lhs_contract: int, rhs_contract: int, rhs_group: int | None, batch: int, explicit
):
    """`ragged_gemm`'s function; `explicit`: the Explicit-axis mesh of the operands, or None.

    With `rhs_group` the rows stay (each group times its slice of rhs along `rhs_group`);
    None contracts them (wgrad's form: the result (G, ...)). The dims are the unbatched
    operands'; `batch` leading dims of all three operands are batch dims, first in the result.

    Under `vmap` JAX's own rule takes only operands that are all batched; this one broadcasts
    the others (a per-sequence MoE's shared experts) and adds the batch as a leading batch dim
    of the dot, whose every element is the unbatched GEMM.
    """
    b = tuple(range(batch))
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((batch + lhs_contract,), (batch + rhs_contract,)), (b, b)),
        lhs_ragged_dimensions=[batch],
        rhs_group_dimensions=[] if rhs_group is None else [batch + rhs_group],
    )

    @custom_vmap
    def gemm(lhs, rhs, group_sizes):
        sharding = {} if explicit is None else {"out_sharding": NamedSharding(explicit, P())}
        out = jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, dims, preferred_element_type=_F32, **sharding
        )
        return jnp.moveaxis(out, 0, batch) if rhs_group is None and batch else out

    @gemm.def_vmap
    def _vmap_rule(axis_size, in_batched, *operands):
        operands = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip(operands, in_batched, strict=True)
        ]
        return ragged_gemm(lhs_contract, rhs_contract, rhs_group, batch + 1)(*operands), True

    return gemm


def group_alpha(d_a, d_b):
    """Each group's `alpha = D_a * D_b` (G,), from the two decode factors as they are.

    The barrier keeps XLA from reassociating the product with the constant inside each
    `D = A * RCP2688`, which it does where a factor is broadcast (under `vmap`): other bits.
    """
    d_a, d_b = jax.lax.optimization_barrier((d_a, d_b))
    return d_a * d_b


def high_precision(x, w, sizes, out_dtype):
    """`jax.lax.ragged_dot` on the unquantized operands, f32 accumulation, in `out_dtype`.

    `sizes` are the clamped group sizes (`Groups.sizes`: none negative, summing to at most
    M), so the rows in no group are zero, as in the NVFP4 GEMMs.
    """
    return ragged_gemm(1, 1, 0)(x, w, sizes).astype(out_dtype)


# The backward ones are the GEMMs JAX's transpose rule of `high_precision` runs (the
# cotangent in f32, the result cast to the operand's dtype), written out: `vmap` of a
# transpose would bind JAX's ragged_dot_general without `ragged_gemm`'s batching rule.


def high_precision_dgrad(dy, w, sizes, x_dtype):
    """The high-precision dx (M, K): row i of group g is `dy[i] @ W[g]^T`, as autodiff has it."""
    return ragged_gemm(1, 2, 0)(dy.astype(_F32), w, sizes).astype(x_dtype)


def high_precision_wgrad(x, dy, sizes, w_dtype):
    """The high-precision dW (G, K, N): `x_g^T dy_g` of every group g, as autodiff has it."""
    return ragged_gemm(0, 0, None)(x, dy.astype(_F32), sizes).astype(w_dtype)
