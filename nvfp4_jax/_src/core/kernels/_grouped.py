"""`nvfp4_grouped_quantize`: the grouped quantization of `ragged_dot`, on the CPU.

Native twin: `GroupedQuantizeImpl` in ffi/cpu/grouped.cc (CPU only: on other platforms
`ragged_dot` quantizes with its jnp block math). x (R, C) in its stored layout is quantized
along C in 1x16 blocks, every group as a tensor of its own, with its own stored amax and
stochastic-rounding key words, its elements numbered from its own first one
(docs/NUMERICS.md section 12): in rows mode group g is rows `[start, start + size)`, in
columns mode it is columns `[start, start + size)` of every row (multiples of 16: the
grouped padded layout). What no group covers gets codes 0 and scales +0; a group whose
amax is NaN gets codes 0 and E4M3 NaN scales. No sharding rule: under a sharding XLA
gathers the operands and runs it whole (the groups' bounds are data). Under `vmap` the
kernel runs once per batch element (`vmap_method="sequential"`), each call the unbatched one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core.kernels import _library

_BLOCK = 16


def grouped_quantize(x, bounds, amax, keys, *, columns: bool, stochastic_rounding: bool):
    """(codes uint8 (R, C/2), scales float8_e4m3fn (R, C/16)) of the groups of x (R, C).

    Args:
      x: bf16, f16 or f32 (R, C), C a multiple of 16.
      bounds: int32 (G, 2), each group's (start, size) along the rows or the columns.
      amax: f32 (G,), each group's stored amax (NaN for a non-finite group).
      keys: uint32 (G, 2), each group's stochastic-rounding key words (k0, k1).
      columns: the groups are column ranges (else row ranges).
      stochastic_rounding: round stochastically with each group's key.
    """
    _library.require("nvfp4_grouped_quantize")
    if _library.current_platform() != "cpu":
        raise ValueError(
            "nvfp4_grouped_quantize: the native grouped quantize runs on the CPU only, not "
            f"{_library.current_platform()!r}"
        )
    rows, cols = x.shape
    call = jax.ffi.ffi_call(
        "nvfp4_grouped_quantize",
        (
            jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8),
            jax.ShapeDtypeStruct((rows, cols // _BLOCK), jnp.float8_e4m3fn),
        ),
        vmap_method="sequential",
    )
    return call(
        x,
        jnp.asarray(bounds, jnp.int32),
        jnp.asarray(amax, jnp.float32),
        jnp.asarray(keys, jnp.uint32),
        columns=bool(columns),
        stochastic_rounding=bool(stochastic_rounding),
    )
