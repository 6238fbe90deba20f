"""`nvfp4_threefry2x32`: JAX's threefry2x32 hash as one custom call (CPU only).

Native twin: `Threefry2x32Impl` in ffi/cpu/handlers.cc, whose rounds are `Threefry2x32` in
ffi/include/nvfp4/numerics.h (the ones the SR kernels draw their bits with). Bit for bit
`jax.extend.random.threefry2x32_p`: `(y0, y1) = threefry2x32((k0, k1), (x0, x1))` for every
element, the four uint32 operands broadcast to one shape.

Why: XLA's CPU lowering of that primitive is a rolled loop of its 20 rounds, which costs as
much compile time as dozens of plain ops, and an NVFP4 train step hashes a few times per layer
(the layer's key of the step, then dgrad's and wgrad's SR keys). As one custom call the hash
leaves the XLA program; the keys, and so every stochastic rounding, stay the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.kernels import _library

_U32 = jnp.uint32


def threefry2x32(k0, k1, x0, x1) -> tuple[jax.Array, jax.Array]:
    """`jax.extend.random.threefry2x32_p.bind(k0, k1, x0, x1)` by the native CPU kernel.

    The operands are uint32 arrays, broadcast to a common shape (a scalar key and counter
    arrays, as `jax.random` binds the primitive); returns `(y0, y1)` of that shape. Under
    `vmap` the operands are broadcast to a common batch (the hash is elementwise).
    """
    _library.require("threefry2x32")
    if _library.current_platform() != "cpu":
        raise ValueError("threefry2x32: the native hash runs on the CPU only")
    names, operands = ("k0", "k1", "x0", "x1"), [jnp.asarray(v) for v in (k0, k1, x0, x1)]
    for name, v in zip(names, operands, strict=True):
        if v.dtype != _U32:
            raise TypeError(f"threefry2x32: {name} must be uint32, got {v.dtype}{v.shape}")
    try:
        operands = jnp.broadcast_arrays(*operands)
    except ValueError:
        shapes = ", ".join(f"{n} {v.shape}" for n, v in zip(names, operands, strict=True))
        raise ValueError(f"threefry2x32: the operands do not broadcast: {shapes}") from None
    out = jax.ShapeDtypeStruct(operands[0].shape, _U32)
    call = jax.ffi.ffi_call("nvfp4_threefry2x32", (out, out), vmap_method="broadcast_all")
    y0, y1 = call(*operands)
    return y0, y1
