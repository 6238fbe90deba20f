"""The weight-only (W4A16) GEMM: activations times a frozen NVFP4 weight, and its ragged form.

A frozen layer keeps its weight quantized and multiplies it by activations in their own
dtype: `x @ dequantize(q, x.dtype)`. On the CPU with the native library the weight is
decoded in registers (`_gemm.weight_only_matmul`), never dequantized into memory; elsewhere the
dequantized weight and XLA's matmul. `weight_only_ragged_dot` is the same for a stack of
experts' weights (`jax.lax.ragged_dot`), and `lax_ragged_dot` is `jax.lax.ragged_dot` that
also runs under Explicit mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax._src.core import backends, ops, primal_types
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.backends import (  # the registry's constant, here for nvfp4_jax.gemm
    WEIGHT_ONLY_MAX_ROWS as WEIGHT_ONLY_MAX_ROWS,
)
from nvfp4_jax._src.core.backends import Implementation
from nvfp4_jax._src.core.interception import opaque
from nvfp4_jax._src.core.kernels._gemm import weight_only_matmul as native_weight_only_matmul


def uses_native_weight_only(
    x_shape, x_dtype, q: NVFP4Array, implementation: Implementation | None = None
) -> bool:
    """True when `weight_only_matmul` runs the native CPU kernel (`nvfp4_w4a16`).

    The backend registry's answer (`backends.runs_natively("weight_only_gemm", ...)`): the
    CPU with the "ffi" implementation, a 2-D `(in, out)` weight quantized along `in` without
    the RHT, activations in bf16 or f16, and at most `WEIGHT_ONLY_MAX_ROWS` rows; never for
    "reference".
    """
    return backends.runs_natively(
        "weight_only_gemm", implementation, x_shape=x_shape, x_dtype=x_dtype, q=q
    )


@opaque
def weight_only_matmul(
    x: jax.Array,
    q: NVFP4Array,
    *,
    preferred_element_type=None,
    implementation: Implementation | None = None,
) -> jax.Array:
    """`jnp.matmul(x, dequantize(q, x.dtype), preferred_element_type=...)` for a frozen weight.

    `q` is the `(in, out)` weight quantized along `in` (a frozen layer's kernel). On the CPU
    with the native library (`uses_native_weight_only`) the weight is decoded in registers,
    never dequantized into memory (`_gemm.weight_only_matmul`): each weight element is the value
    `dequantize` gives it in `x.dtype`, the products and their sum are f32 in the kernel's
    fixed order (docs/NUMERICS.md section 9), then cast to `preferred_element_type` (default
    `x.dtype`). Elsewhere, the dequantized weight and XLA's matmul, as before.

    Derivatives (forward and reverse mode) are those of the XLA expression on every path, bit
    for bit (`_native_product`); the frozen weight `q` has none.
    """
    if preferred_element_type is not None and not jnp.issubdtype(
        jnp.dtype(preferred_element_type), jnp.floating
    ):
        native = False
    else:
        native = uses_native_weight_only(jnp.shape(x), jnp.result_type(x), q, implementation)
    product = _native_product if native else _dequantized_product
    return product(x, q, None, preferred_element_type, implementation)


def expert_weight(q: NVFP4Array, g: int) -> NVFP4Array:
    """Expert g of a stacked `(G, in, out)` weight: its `(in, out)` NVFP4Array."""

    def pick(leaf):
        return None if leaf is None else (leaf[g] if jnp.ndim(leaf) else leaf)

    return dataclasses.replace(
        q,
        codes=q.codes[g],
        scales=q.scales[g],
        amax=pick(q.amax),
        decode_scale=pick(q.decode_scale),
    )


@opaque
def weight_only_ragged_dot(
    x: jax.Array,
    q: NVFP4Array,
    group_sizes: jax.Array,
    *,
    implementation: Implementation | None = None,
) -> jax.Array:
    """`jax.lax.ragged_dot(x, dequantize(q, x.dtype), group_sizes)` for frozen expert weights.

    `q` is the `(G, in, out)` stack of G experts' weights quantized along `in` (stored
    `(G, out, in)`), with one tensor amax (and decode factor) per expert, `(G,)`, or one for
    all; `x` is `(M, in)`, its rows sorted by expert, `group_sizes` `(G,)` integers. Row i of
    group g is `x[i] @ dequantize(W_g, x.dtype)` and rows past `sum(group_sizes)` are zeros,
    in `x.dtype`. Where `weight_only_matmul` runs its native kernel for M rows (decode
    batches on the CPU), each expert's weight is decoded in registers: every expert's product
    is computed for all M rows and each row keeps its own expert's, each row bit for bit
    `weight_only_matmul` of that row (the kernel sums every output element on its own).
    Elsewhere, the dequantized experts and `jax.lax.ragged_dot`. Derivatives are those of
    `jax.lax.ragged_dot` of the dequantized experts on every path, bit for bit; `q` has none.
    """
    if len(q.shape) != 3 or q.axis != -2:
        raise ValueError(
            "weight_only_ragged_dot: q must be a (G, in, out) NVFP4Array quantized along in, "
            f"got {q!r}"
        )
    g, k, _ = q.shape
    if jnp.ndim(x) != 2 or jnp.shape(x)[1] != k:
        raise ValueError(
            f"weight_only_ragged_dot: x must be (tokens, {k}) for a (G, {k}, out) weight, got "
            f"shape {jnp.shape(x)}"
        )
    sizes_dtype = jnp.result_type(group_sizes)
    if jnp.shape(group_sizes) != (g,) or not jnp.issubdtype(sizes_dtype, jnp.integer):
        raise ValueError(
            f"weight_only_ragged_dot: group_sizes must be ({g},) integers, one per expert, got "
            f"{sizes_dtype} of shape {jnp.shape(group_sizes)}"
        )
    native = uses_native_weight_only(
        jnp.shape(x), jnp.result_type(x), expert_weight(q, 0), implementation
    )
    product = _native_product if native else _dequantized_product
    return product(x, q, group_sizes, None, implementation)


def _dequantized_product(x, q, group_sizes, preferred_element_type, implementation):
    """The XLA path: `x @ dequantize(q, x.dtype)`, or per group `ragged_dot` with sizes.

    The weight is frozen: no derivative flows into `q` (a stop_gradient), on this path as on
    the native one.
    """
    weight = ops.dequantize(
        jax.lax.stop_gradient(q), jnp.result_type(x), implementation=implementation
    )
    if group_sizes is None:
        return jnp.matmul(x, weight, preferred_element_type=preferred_element_type)
    return lax_ragged_dot(x, weight, group_sizes)


def lax_ragged_dot(x, w, group_sizes, precision=None) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes, precision)`, under Explicit mesh axes too.

    JAX infers no sharding for a ragged dot under Explicit axes: there the operands are
    gathered (the groups are rows of the whole x) and the result sharded along M as x is.
    """
    mesh = primal_types.mesh_of(x, w, group_sizes)
    if mesh is None or not mesh.explicit_axes:
        return jax.lax.ragged_dot(x, w, group_sizes, precision=precision)
    gathered = [primal_types.replicated(a) for a in (x, w, group_sizes)]
    out_sharding = NamedSharding(mesh, P())
    y = jax.lax.ragged_dot(*gathered, precision=precision, out_sharding=out_sharding)
    return primal_types.leading_axis_like(y, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _native_product(x, q, group_sizes, preferred_element_type, implementation):
    """`_dequantized_product` with the weight decoded in registers (`_gemm.weight_only_matmul`).

    Its derivative is `_dequantized_product`'s: the product is linear in x, and its JVP is
    the XLA expression applied to the tangent of x, so reverse mode transposes that very
    expression (the gradient in x is the XLA path's, bit for bit, at every row count).
    """
    if group_sizes is None:
        k, n = q.shape
        out = native_weight_only_matmul(jnp.reshape(x, (-1, k)), q.codes, q.scales, q.global_scale)
        dtype = jnp.result_type(x) if preferred_element_type is None else preferred_element_type
        return jnp.reshape(out, (*jnp.shape(x)[:-1], n)).astype(dtype)
    ends = jnp.cumsum(jnp.asarray(group_sizes).astype(jnp.int32))
    rows = jnp.arange(jnp.shape(x)[0], dtype=jnp.int32)
    row_group = jnp.sum(rows[:, None] >= ends[None, :], axis=1)  # G past the last group
    out = jnp.zeros((jnp.shape(x)[0], q.shape[-1]), jnp.result_type(x))
    for e in range(q.shape[0]):
        y = _native_product(x, expert_weight(q, e), None, None, implementation)
        out = jnp.where((row_group == e)[:, None], y, out)
    return out


@_native_product.defjvp
@opaque
def _native_product_jvp(preferred_element_type, implementation, primals, tangents):
    x, q, group_sizes = primals
    y = _native_product(x, q, group_sizes, preferred_element_type, implementation)
    # The tangents of the frozen weight (and of group_sizes) are dropped: it has none.
    dy = _dequantized_product(tangents[0], q, group_sizes, preferred_element_type, implementation)
    return y, dy
