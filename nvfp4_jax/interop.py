"""Interop: `jax.nn.scaled_matmul` operands, the block-scaled GEMM, sharded master weights.

Shape letters: a GEMM operand is an `NVFP4Array` whose stored layout is `(M, K)` (or a batch
`(B, M, K)`), K the contraction axis (the quantized axis, stored last), G = K / 16.

`jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales)` on Blackwell (cuDNN, NVFP4 mode)
takes `lhs (B, M, K)` and `rhs (B, N, K)` as `float4_e2m1fn`, and the scales `(B, M, G)`,
`(B, N, G)` as `float8_e4m3fn` in the plain row-major layout (XLA pads and swizzles them for
cuDNN itself), and returns `sum_k (q_a s_a)(q_b s_b)` in f32. It knows nothing of the tensor
scale: as in `jax.nn.scaled_dot_general`'s NVFP4 mode, the product is multiplied by the two
global decode factors outside, `alpha = D_a * D_b` with `D = A * RCP2688` (NUMERICS 3, 9).
It has no CPU lowering; `scaled_matmul(..., backend="emulated")` computes the same numbers
(up to f32 summation order) anywhere.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nvfp4_jax import dispatch, distributed, formats
from nvfp4_jax.array import NVFP4Array
from nvfp4_jax.quantize import block_values, global_decode_scale, quantize

GemmBackend = Literal["emulated", "scaled_matmul"]
# The first compute capability whose tensor cores run block-scaled FP4 (Blackwell, sm_100).
SCALED_MATMUL_MIN_CAPABILITY = 10.0


class ScaledMatmulOperands(NamedTuple):
    """One operand of `jax.nn.scaled_matmul`, in the stored layout `(..., K)`.

    Attributes:
      data: float4_e2m1fn `(..., K)`, one E2M1 value per element.
      scales: float8_e4m3fn `(..., K / 16)`, row-major (not swizzled).
      global_scale: f32 scalar `D = amax * RCP2688`, to multiply the GEMM result by.
    """

    data: jax.Array
    scales: jax.Array
    global_scale: jax.Array


def to_scaled_matmul_operands(q: NVFP4Array) -> ScaledMatmulOperands:
    """Returns `q`'s codes as float4_e2m1fn, its scales and its global decode factor.

    The packed byte `b` at `(..., i)` holds element `2i` in its low nibble and `2i + 1` in its
    high nibble; XLA's bitcast of uint8 to float4_e2m1fn uses the same order, so this is a
    bitcast, exact. With `q.rht` the values are in the rotated basis (a GEMM of two operands
    rotated along K needs no inverse).

    Example:
      >>> ops = to_scaled_matmul_operands(quantize(jnp.ones((4, 32))))
      >>> ops.data.dtype, ops.data.shape, ops.scales.shape
      (dtype(float4_e2m1fn), (4, 32), (4, 2))

    """
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"to_scaled_matmul_operands: expected an NVFP4Array, got {type(q)}")
    data = jax.lax.bitcast_convert_type(q.codes, jnp.float4_e2m1fn)  # (..., K/2, 2)
    data = data.reshape(*q.codes.shape[:-1], -1)
    return ScaledMatmulOperands(data, q.scales, global_decode_scale(q.amax))


def from_scaled_matmul_operands(
    data: jax.Array,
    scales: jax.Array,
    amax: jax.Array,
    *,
    dtype=jnp.bfloat16,
    axis: int = -1,
    block_2d: bool = False,
    rht: bool = False,
) -> NVFP4Array:
    """Packs float4_e2m1fn values, E4M3 scales and the tensor amax into an `NVFP4Array`.

    Inverse of `to_scaled_matmul_operands` (the amax is passed, not the decode factor: `A`
    cannot be recovered exactly from `A * RCP2688`). `data` is in the stored layout; `dtype`,
    `axis`, `block_2d`, `rht` are the metadata of the array it came from.
    """
    data, scales = jnp.asarray(data), jnp.asarray(scales)
    if data.dtype != jnp.float4_e2m1fn or scales.dtype != jnp.float8_e4m3fn:
        raise TypeError(
            "from_scaled_matmul_operands: data must be float4_e2m1fn and scales float8_e4m3fn, "
            f"got {data.dtype} and {scales.dtype}"
        )
    if (
        data.ndim < 1
        or data.shape[-1] % formats.BLOCK_SIZE
        or scales.shape != (*data.shape[:-1], data.shape[-1] // formats.BLOCK_SIZE)
    ):
        raise ValueError(
            f"from_scaled_matmul_operands: data {data.shape} needs a last axis that is a multiple "
            f"of {formats.BLOCK_SIZE} and scales of shape (..., K/16), got scales {scales.shape}"
        )
    if not -data.ndim <= axis < 0:
        raise ValueError(f"from_scaled_matmul_operands: axis must be negative, got {axis}")
    pairs = data.reshape(*data.shape[:-1], -1, 2)
    codes = jax.lax.bitcast_convert_type(pairs, jnp.uint8)
    return NVFP4Array(
        codes=codes,
        scales=scales,
        amax=jnp.asarray(amax, jnp.float32),
        dtype=jnp.dtype(dtype),
        axis=axis,
        block_2d=bool(block_2d),
        rht=bool(rht),
    )


def scaled_matmul_unsupported_reason() -> str | None:
    """Returns why `jax.nn.scaled_matmul` cannot run NVFP4 here, or None if it can."""
    platform = dispatch.current_platform()
    if platform != "cuda":
        return f"the default platform is {platform!r}, not a CUDA GPU"
    device = jax.devices()[0]
    capability = float(getattr(device, "compute_capability", 0) or 0)
    if capability < SCALED_MATMUL_MIN_CAPABILITY:
        return (
            f"{device.device_kind} has compute capability {capability}; NVFP4 block-scaled "
            f"GEMMs need {SCALED_MATMUL_MIN_CAPABILITY} or newer (Blackwell)"
        )
    return None


def resolve_gemm_backend(backend: GemmBackend | None, op: str = "scaled_matmul") -> GemmBackend:
    """Returns the GEMM backend to use: None picks "scaled_matmul" on Blackwell, else emulated.

    Raises:
      ValueError: for an unknown backend, or "scaled_matmul" where it cannot run.
    """
    if backend not in (None, "emulated", "scaled_matmul"):
        raise ValueError(
            f"{op}: gemm backend must be None, 'emulated' or 'scaled_matmul', got {backend!r}"
        )
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
      rhs: stored layout `(N, K)` or `(B, N, K)`, quantized along K as well.
      preferred_element_type: the result dtype; accumulation is f32.
      backend: "scaled_matmul" (`jax.nn.scaled_matmul`, Blackwell), "emulated" (NUMERICS
        section 9 on any platform: operands as `value * s_b` in `gemm_dtype`, f32
        accumulation) or None (the first where it runs).
      gemm_dtype: the dtype of the emulated operands (bf16 holds them exactly).

    Returns:
      `(M, N)` or `(B, M, N)`.
    """
    backend = resolve_gemm_backend(backend)
    lhs3, rhs3 = _as_batched(lhs, "lhs"), _as_batched(rhs, "rhs")
    if lhs3[0] != rhs3[0] or lhs3[2] != rhs3[2]:
        raise ValueError(
            f"scaled_matmul: lhs stored as {lhs.stored_shape} and rhs stored as "
            f"{rhs.stored_shape} need the same batch and K (the last axis)"
        )
    alpha = global_decode_scale(lhs.amax) * global_decode_scale(rhs.amax)
    if backend == "emulated":
        a, b = block_values(lhs, gemm_dtype), block_values(rhs, gemm_dtype)
        dims = (((a.ndim - 1,), (b.ndim - 1,)), ((0,), (0,)) if a.ndim == 3 else ((), ()))
        product = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    else:
        product = _cudnn_product(lhs, rhs, lhs3, rhs3)
        if lhs.codes.ndim == 2:
            product = product[0]
    return (product * alpha).astype(preferred_element_type)


def _as_batched(q: NVFP4Array, name: str) -> tuple[int, int, int]:
    if not isinstance(q, NVFP4Array) or q.codes.ndim not in (2, 3) or q.amax.ndim:
        raise ValueError(
            f"scaled_matmul: {name} must be one 2-D or 3-D NVFP4Array (stored (M, K) or "
            f"(B, M, K)), got {q!r}"
        )
    shape = q.stored_shape
    return (1, *shape) if len(shape) == 2 else shape


def _cudnn_product(lhs, rhs, lhs3, rhs3):
    """`jax.nn.scaled_matmul` of two packed operands, K zero-padded to the GEMM alignment."""
    operands = []
    for q, shape in ((lhs, lhs3), (rhs, rhs3)):
        data, scales, _ = to_scaled_matmul_operands(q)
        data, scales = data.reshape(shape), scales.reshape(*shape[:2], -1)
        # Zero codes with zero scales add nothing: pad K to 32 elements for the FP4 kernels.
        pad = -shape[2] % 32
        if pad:
            data = jnp.pad(data, ((0, 0), (0, 0), (0, pad)))
            scales = jnp.pad(scales, ((0, 0), (0, 0), (0, pad // formats.BLOCK_SIZE)))
        operands.append((data, scales))
    (a, sa), (b, sb) = operands
    return jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)


def quantize_master_weights(
    weights: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    mesh: Mesh | None = None,
    spec: PartitionSpec | None = None,
    implementation: str | None = None,
) -> NVFP4Array:
    """Quantizes a sharded f32 master weight (FSDP style) with one global amax, shard by shard.

    Each device quantizes its own shard with the amax of the whole tensor (the max over
    shards, one `pmax`), so the result equals `quantize` of the gathered tensor bit for bit,
    and its codes and scales stay sharded like the weight (the quantized axis stored last).
    Round to nearest, no RHT: the recipe for weights.

    Args:
      weights: the global array, bf16/f16/f32, sharded along any axes. Shards along the
        quantized axis (and, with `block_2d`, along the stored row axis) must hold multiples
        of 16 elements.
      axis: the quantized axis.
      block_2d: 16x16 blocks.
      mesh: the device mesh; default `weights.sharding.mesh` (pass it, with `spec`, under
        `jax.jit`).
      spec: the `PartitionSpec` of `weights`; default `weights.sharding.spec`.
      implementation: as in `quantize` (each shard is quantized on its own device).

    Returns:
      An `NVFP4Array` whose codes and scales are sharded as `spec` with `axis` moved last.
    """
    weights = formats.as_float_array(weights, "quantize_master_weights")
    mesh, spec = _mesh_and_spec(weights, mesh, spec)
    axis = _negative_axis(axis, weights.ndim)
    entries = list(spec) + [None] * (weights.ndim - len(spec))
    stored_entries = [e for i, e in enumerate(entries) if i != axis % weights.ndim]
    stored_spec = PartitionSpec(*stored_entries, entries[axis])
    _check_shards(weights.shape, entries, mesh, axis, block_2d)
    sharded = tuple(name for e in entries for name in ((e,) if isinstance(e, str) else e or ()))

    def local(shard):
        amax = distributed.global_amax(shard, sharded, axis=axis, implementation=implementation)
        q = quantize(shard, axis=axis, block_2d=block_2d, amax=amax, implementation=implementation)
        return q.codes, q.scales, q.amax

    weights = jax.reshard(weights, NamedSharding(mesh, PartitionSpec(*entries)))
    codes, scales, amax = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=PartitionSpec(*entries),
        out_specs=(stored_spec, stored_spec, PartitionSpec()),
    )(weights)
    return NVFP4Array(
        codes=codes,
        scales=scales,
        amax=amax,
        dtype=jnp.dtype(weights.dtype),
        axis=axis,
        block_2d=bool(block_2d),
        rht=False,
    )


def _mesh_and_spec(weights, mesh, spec):
    if mesh is None or spec is None:
        sharding = getattr(weights, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                "quantize_master_weights: pass mesh= and spec=, or a jax.Array with a "
                f"NamedSharding; got sharding {sharding!r}"
            )
        mesh = sharding.mesh if mesh is None else mesh
        spec = sharding.spec if spec is None else spec
    return mesh, spec


def _negative_axis(axis, ndim):
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"quantize_master_weights: axis={axis!r} out of range for {ndim} dims")
    return axis - ndim if axis >= 0 else axis


def _check_shards(shape, entries, mesh, axis, block_2d):
    """Every shard must split the tensor on block boundaries (multiples of 16)."""
    ndim = len(shape)
    blocked = {axis % ndim}
    if block_2d:
        rows = [d for d in range(ndim) if d != axis % ndim][-1:]
        blocked.update(rows)
    for dim in blocked:
        names = entries[dim]
        names = (names,) if isinstance(names, str) else tuple(names or ())
        count = 1
        for name in names:
            count *= mesh.shape[name]
        if shape[dim] % (count * formats.BLOCK_SIZE):
            raise ValueError(
                f"quantize_master_weights: axis {dim} of shape {tuple(shape)} is split into "
                f"{count} shards, which must each hold a multiple of {formats.BLOCK_SIZE} "
                "elements (blocks may not straddle devices)"
            )
