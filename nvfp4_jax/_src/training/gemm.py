"""The NVFP4 GEMM: exact emulation anywhere, or `jax.nn.scaled_matmul` on Blackwell.

Shape letters: an operand is quantized along the contraction axis K and held in its stored
layout `(rows, K)` (or a batch `(B, rows, K)`), G = K / 16. The product of two operands is
(docs/NUMERICS.md section 9)

    alpha * sum_k (q_a * s_a)(q_b * s_b),    alpha = D_a * D_b,  D = amax * RCP2688

with f32 accumulation: what Blackwell's block-scaled tensor cores compute. Two backends:

* `"emulated"`: each operand as `value(code) * s_b` (at most 6 significant bits, exact in
  bf16) in the GEMM dtype, `lax.dot_general` with f32 accumulation, times alpha. Runs on
  any platform and equals the hardware result up to f32 summation order. On the CPU with
  the native library and the "ffi" implementation (the default there), the operands stay
  packed (`NativeBlocks`) and the exact native GEMM `kernels.gemm` computes the same
  numbers with integer block dot products, summed over K in ascending block order
  (docs/NUMERICS.md section 9); `implementation="reference"` stays pure jnp.
* `"scaled_matmul"`: `jax.nn.scaled_matmul` (cuDNN) on the packed operands, `float4_e2m1fn`
  data and `float8_e4m3fn` scales in the plain row-major layout (XLA swizzles them for cuDNN
  itself); it knows nothing of the tensor scale, so alpha is applied outside. Needs a CUDA
  GPU of compute capability 10 or newer.

`resolve_gemm_backend` picks the backend. `Operand` is one side of a GEMM in the form its
backend takes; `quantize_operand` and `array_operand` build it, `matmul` multiplies two.
`dot_general` and `scaled_matmul` are built from these three. The operands of
`jax.nn.scaled_matmul` are `training.scaled_matmul`'s; the weight-only GEMM of a frozen
layer is `training.weight_only`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax._src.core import backends, checks, formats, layout, ops, primal_types
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.core.backends import (  # the registry's constant, here for nvfp4_jax.gemm
    SCALED_MATMUL_MIN_CAPABILITY as SCALED_MATMUL_MIN_CAPABILITY,
)
from nvfp4_jax._src.core.backends import Implementation
from nvfp4_jax._src.core.interception import opaque
from nvfp4_jax._src.core.kernels._gemm import gemm as native_gemm
from nvfp4_jax._src.core.spec import QuantSpec, spec_of_call
from nvfp4_jax._src.core.sr_seed import SRSeed
from nvfp4_jax._src.training.recipe import GemmBackend
from nvfp4_jax._src.training.scaled_matmul import to_scaled_matmul_operands

_F32 = jnp.float32


def scaled_matmul_unsupported_reason() -> str | None:
    """Returns why `jax.nn.scaled_matmul` cannot run NVFP4 here, or None if it can.

    `backends.scaled_matmul_unsupported_reason`: the registry answers it.
    """
    return backends.scaled_matmul_unsupported_reason()


def resolve_gemm_backend(backend: GemmBackend | None, op: str = "scaled_matmul") -> GemmBackend:
    """Returns the GEMM backend to use: None picks "scaled_matmul" on Blackwell, else emulated.

    Raises:
      ValueError: for an unknown backend, or "scaled_matmul" where it cannot run.
    """
    checks.check_choice(f"{op}: gemm backend", backend, GemmBackend, allow_none=True)
    if backend == "emulated":
        return "emulated"
    reason = scaled_matmul_unsupported_reason()
    if backend is None:
        return "emulated" if reason else "scaled_matmul"
    if reason:
        raise ValueError(
            f"{op}: gemm backend 'scaled_matmul' (jax.nn.scaled_matmul) was requested, but "
            f"{reason}. Use 'emulated' (the same numbers, computed in bf16) or None."
        )
    return "scaled_matmul"


def uses_native_gemm(backend: GemmBackend, implementation: Implementation | None) -> bool:
    """True when the emulated GEMM runs as the native CPU kernel (`kernels.gemm`).

    That is the "emulated" backend where the backend registry runs the GEMM natively
    (`backends.runs_natively("gemm", implementation)`: the "ffi" implementation on the CPU
    with AVX2 or AVX-512 kernels); never for "reference", which stays pure jnp.
    """
    return backend == "emulated" and backends.runs_natively("gemm", implementation)


@dataclasses.dataclass(frozen=True)
class NativeBlocks:
    """An operand of the native CPU GEMM: a packed `NVFP4Array` quantized along its last axis.

    `dtype` is the GEMM dtype its values take where an emulated GEMM needs them. `.T` is the
    transposed operand of a 2-D tensor with 16x16 blocks (the dgrad's weight): the same
    tile values contracted over the other axis, `transpose_2d_blocks`.
    """

    q: NVFP4Array
    dtype: jnp.dtype = jnp.dtype(jnp.bfloat16)

    @property
    def T(self) -> NativeBlocks:
        """The operand transposed: only for 16x16 blocks, whose values transpose exactly."""
        return NativeBlocks(transpose_2d_blocks(self.q), self.dtype)

    def values(self) -> jax.Array:
        """`value(code) * s_b` in `dtype`: the emulated GEMM's operand."""
        return ops.block_values(self.q, self.dtype)


class Operand(NamedTuple):
    """One GEMM operand, quantized along K, in the stored layout `(..., rows, K)`.

    Attributes:
      data: for the emulated backend, `value(code) * s_b` in the GEMM dtype, or
        `NativeBlocks` where the native CPU GEMM runs it; for "scaled_matmul", the packed
        `NVFP4Array`.
      decode: the f32 tensor decode factor `D = amax * RCP2688`.
    """

    data: jax.Array | NVFP4Array | NativeBlocks
    decode: jax.Array


def quantize_operand(
    x: jax.Array,
    spec: QuantSpec | None = None,
    *,
    key: jax.Array | SRSeed | None = None,
    backend: GemmBackend,
    dtype=jnp.bfloat16,
    implementation: Implementation | None = None,
    rotation: jax.Array | None = None,
    **options,
) -> Operand:
    """Quantizes `x` along its contraction axis `spec.axis` into a GEMM operand (stored layout).

    The emulated backend never packs: `fake_quantize(global_scale=False)` gives the block
    values directly, with the tensor amax computed once for both them and `D`. That amax is
    data (NaN for a NaN/inf `x`): the operand is NaN eagerly as under `jit`, never an error.
    Under Four Over Six (`spec.four_over_six`) the blocks are Four Over Six's and
    `D = amax * f32(1/(6M))`, `M = spec.e4m3_max` (docs/NUMERICS.md section 13). What
    `dot_general` runs, with the specs of `NVFP4Recipe.spec`.

    Args:
      x: the operand, bf16, f16 or f32.
      spec: how it is quantized (`QuantSpec`; its axis is the contraction axis K).
      key: the stochastic rounding's key (a PRNG key or an `SRSeed`) when the spec rounds
        stochastically.
      backend: the resolved GEMM backend, "emulated" or "scaled_matmul".
      dtype: the emulated GEMM's operand dtype.
      implementation: as in `nvfp4_jax.quantize`.
      rotation: MS-EDEN's rotation (`spec.ms_eden`): a PRNG key or its uint32 (4,) words;
        the decode factor is then MS-EDEN's `D = amax * f32(1/C)`.
      **options: `nvfp4_jax.quantize`'s options as keywords instead of `spec` (deprecated).

    Returns:
      The `Operand`, in the stored layout `(..., rows, K)`.
    """
    spec = spec_of_call(spec, options, "quantize_operand", deprecated=True).replace(op="quantize")
    quantized = dict(key=key, implementation=implementation, rotation=rotation)
    if backend == "scaled_matmul":
        q = ops.quantize_with_spec(x, spec, **quantized)
        return Operand(q, q.global_scale)
    rotation_key = rotation if spec.ms_eden else None
    amax = ops.tensor_amax(
        x, axis=spec.axis, rht=spec.rht, implementation=implementation, rotation_key=rotation_key
    )
    decode = spec.decode_scale(amax)
    if uses_native_gemm(backend, implementation):
        q = ops.quantize_with_data_amax(x, amax, spec, **quantized)
        return Operand(NativeBlocks(q, jnp.dtype(dtype)), decode)
    fake = spec.replace(global_scale=False, dtype=dtype, op="fake_quantize")
    values = ops.fake_quantize_with_data_amax(x, amax, fake, **quantized)
    return Operand(jnp.moveaxis(values, spec.axis, -1), decode)


def array_operand(
    q: NVFP4Array,
    *,
    backend: GemmBackend,
    dtype=jnp.bfloat16,
    implementation: Implementation | None = None,
) -> Operand:
    """A quantized tensor (quantized along K, its stored layout `(..., rows, K)`) as an operand."""
    if backend == "scaled_matmul":
        return Operand(q, q.global_scale)
    if uses_native_gemm(backend, implementation):
        return Operand(NativeBlocks(q, jnp.dtype(dtype)), q.global_scale)
    return Operand(ops.block_values(q, dtype, implementation=implementation), q.global_scale)


def transpose_2d_blocks(q: NVFP4Array) -> NVFP4Array:
    """A 16x16-block quantized `(N, K)` stored as `(K, N)`: the same codes and tile scales.

    Every element of a tile has the tile's scale, so the transposed tensor quantized along
    the other axis has exactly these values (docs/NUMERICS.md section 4).
    """
    if not q.block_2d or q.codes.ndim != 2:
        raise ValueError(
            f"transpose_2d_blocks: needs a 2-D NVFP4Array with 16x16 blocks, got {q!r}"
        )
    codes = formats.pack_nibbles(formats.unpack_nibbles(q.codes).T)
    tiles = q.scales[:: formats.BLOCK_SIZE].T  # (K/16, N/16): one scale per tile
    # Each tile row 16 times: a broadcast and a merge of leading dims, which keep a sharding
    # of the tile rows in the type (`jnp.repeat` needs its result's sharding spelled out).
    k_tiles, n_tiles = tiles.shape
    scales = jnp.broadcast_to(tiles[:, None, :], (k_tiles, formats.BLOCK_SIZE, n_tiles))
    scales = scales.reshape(k_tiles * formats.BLOCK_SIZE, n_tiles)
    # The logical (K, N) is the same; the quantized axis flips between its two dims.
    return dataclasses.replace(q, codes=codes, scales=scales, axis=-3 - q.axis)


def matmul(a: Operand, b: Operand) -> jax.Array:
    """`alpha * a @ b^T` in f32: `(..., M, K) x (..., N, K) -> (..., M, N)`."""
    if isinstance(a.data, NativeBlocks) and isinstance(b.data, NativeBlocks):
        # The same `product * alpha`, the product summed in the kernel's fixed order.
        qa, qb = a.data.q, b.data.q
        return native_gemm(qa.codes, qa.scales, qb.codes, qb.scales, a.decode, b.decode)
    # The barrier keeps XLA from reassociating the product with the constant inside each
    # `D = amax * RCP2688`, which it does where a factor is broadcast (under `vmap`).
    d_a, d_b = jax.lax.optimization_barrier((a.decode, b.decode))
    alpha = d_a * d_b
    a_data, b_data = (d.values() if isinstance(d, NativeBlocks) else d for d in (a.data, b.data))
    if isinstance(a_data, NVFP4Array):
        product = _cudnn_product(a_data, b_data)
    else:
        a_data, b_data = _whole_contraction(a_data, b_data)
        batch = tuple(range(a_data.ndim - 2))
        dims = (((a_data.ndim - 1,), (b_data.ndim - 1,)), (batch, batch))
        product = jax.lax.dot_general(a_data, b_data, dims, preferred_element_type=_F32)
    return product * alpha


def _whole_contraction(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`a (..., M, K)` and `b (..., N, K)` with whole rows (all of K) on every device.

    So that each product is summed over K in one device's order, as on one device. Under
    Explicit mesh axes, where the types hold the shardings, K is gathered (b's batch dims
    follow a's, and N gives up an axis M already uses); under `jax.set_mesh` with Auto axes
    K is constrained to be unsharded and XLA picks the rest. Without a mesh in the context
    XLA's partitioner decides, and may split K (f32 sums in another order).
    """
    sharding = primal_types.explicit_spec(jax.typeof(a)) or primal_types.explicit_spec(
        jax.typeof(b)
    )
    if sharding is None:
        mesh = primal_types.mesh_of(a, b)
        if mesh is None or not mesh.auto_axes:
            return a, b
        return tuple(
            jax.lax.with_sharding_constraint(
                x, NamedSharding(mesh, P(*[P.UNCONSTRAINED] * (x.ndim - 1), None))
            )
            for x in (a, b)
        )
    spec_a, spec_b = (primal_types.spec_entries(x) for x in (a, b))
    spec_a[-1] = spec_b[-1] = None
    spec_b[:-2] = spec_a[:-2]
    if set(primal_types.axis_names(spec_a[-2])) & set(primal_types.axis_names(spec_b[-2])):
        spec_b[-2] = None
    return (
        jax.sharding.reshard(a, NamedSharding(sharding.mesh, P(*spec_a))),
        jax.sharding.reshard(b, NamedSharding(sharding.mesh, P(*spec_b))),
    )


def _cudnn_product(lhs: NVFP4Array, rhs: NVFP4Array) -> jax.Array:
    """`jax.nn.scaled_matmul` of two packed operands, K zero-padded to the GEMM alignment."""
    operands = []
    for q in (lhs, rhs):
        data, scales, _ = to_scaled_matmul_operands(q)
        shape = data.shape if data.ndim == 3 else (1, *data.shape)
        data = data.reshape(shape)
        scales = scales.reshape(*shape[:2], shape[2] // formats.BLOCK_SIZE)
        # Zero codes with zero scales add nothing: pad K for the FP4 kernels.
        pad = -shape[2] % layout.GEMM_ALIGNMENT
        if pad:
            data = jnp.pad(data, ((0, 0), (0, 0), (0, pad)))
            scales = jnp.pad(scales, ((0, 0), (0, 0), (0, pad // formats.BLOCK_SIZE)))
        operands.append((data, scales))
    (a, sa), (b, sb) = operands
    product = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=_F32)
    return product if lhs.codes.ndim == 3 else product[0]


def _check_operand(q, name: str) -> tuple[int, ...]:
    if not isinstance(q, NVFP4Array) or q.codes.ndim not in (2, 3) or q.amax.ndim:
        raise ValueError(
            f"scaled_matmul: {name} must be one 2-D or 3-D NVFP4Array (stored (M, K) or "
            f"(B, M, K)), got {q!r}"
        )
    return q.stored_shape


@opaque
def scaled_matmul(
    lhs: NVFP4Array,
    rhs: NVFP4Array,
    *,
    preferred_element_type=jnp.float32,
    backend: GemmBackend | None = None,
    gemm_dtype=jnp.bfloat16,
) -> jax.Array:
    """The NVFP4 GEMM `alpha * sum_k (q_a s_a)(q_b s_b)` of two operands quantized along K.

    Args:
      lhs: stored layout `(M, K)` or `(B, M, K)`.
      rhs: stored layout `(N, K)` or `(B, N, K)`, quantized along K as well, and with the RHT
        exactly when `lhs` is (the rotations cancel only in pairs).
      preferred_element_type: the result dtype (a float dtype); accumulation is f32.
      backend: "scaled_matmul" (`jax.nn.scaled_matmul`, Blackwell), "emulated" (any
        platform) or None (the first where it runs).
      gemm_dtype: the dtype of the emulated operands: bf16, f16 or f32 (all hold the block
        values exactly).

    Returns:
      `(M, N)` or `(B, M, N)`.

    Example:
      >>> import jax.numpy as jnp, nvfp4_jax
      >>> a = nvfp4_jax.quantize(jnp.ones((32, 64)))
      >>> nvfp4_jax.scaled_matmul(a, a, backend="emulated").shape
      (32, 32)
    """
    op = "scaled_matmul"
    backend = resolve_gemm_backend(backend, op)
    lhs_shape, rhs_shape = _check_operand(lhs, "lhs"), _check_operand(rhs, "rhs")
    if (
        len(lhs_shape) != len(rhs_shape)
        or lhs_shape[:-2] != rhs_shape[:-2]
        or (lhs_shape[-1] != rhs_shape[-1])
    ):
        raise ValueError(
            f"{op}: lhs stored as {lhs_shape} and rhs stored as {rhs_shape} need the same batch "
            "and K (the last axis)"
        )
    if lhs.rht != rhs.rht:
        raise ValueError(
            f"{op}: lhs (rht={lhs.rht}) and rhs (rht={rhs.rht}) must both or neither be "
            "quantized with the RHT: a product of one rotated operand is not the GEMM"
        )
    gemm_dtype = checks.check_dtype(gemm_dtype, op, "gemm_dtype")
    out = jnp.dtype(_F32 if preferred_element_type is None else preferred_element_type)
    if not jnp.issubdtype(out, jnp.floating):
        raise TypeError(f"{op}: preferred_element_type must be a float dtype, got {out}")
    a = array_operand(lhs, backend=backend, dtype=gemm_dtype)
    b = array_operand(rhs, backend=backend, dtype=gemm_dtype)
    return matmul(a, b).astype(out)
