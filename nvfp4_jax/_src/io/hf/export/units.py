"""Export: the units written, one per module (one expert): specs first, bytes on demand.

A quantized linear's unit holds `.weight`, `.weight_scale`, `.weight_scale_2` (and, for
W4A4, `.input_scale`), quantized when written; any other tensor's holds its (transposed,
cast) array. Nothing is computed until the writer asks, one unit at a time.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.array import is_nvfp4_array
from nvfp4_jax._src.core.multihost import to_host
from nvfp4_jax._src.core.ops import dequantize, quantize
from nvfp4_jax._src.io.hf.export.tensors import Tensor
from nvfp4_jax._src.io.hf.format import QUANT_OPTIONAL, QUANT_TENSORS
from nvfp4_jax._src.io.hf.safetensors_files import ST_NAMES, Unit, is_float


def _quantized_unit(t: Tensor, amax, input_scale, flags: dict, implementation) -> Unit:
    """The unit of a quantized linear; `flags`: `quantize`'s block_2d and 4/6 arguments."""
    rows, cols = t.shape[::-1]  # the stored (out, in) of an (in, out) kernel
    shapes = {"weight": (rows, cols // 2), "weight_scale": (rows, cols // formats.BLOCK_SIZE)}
    specs = [
        (f"{t.module}.{suffix}", dtype, shapes.get(suffix, ()))  # the others are scalars
        for suffix, dtype in QUANT_TENSORS.items()
        if input_scale is not None or suffix not in QUANT_OPTIONAL
    ]

    def produce() -> dict[str, np.ndarray]:
        q = t.kernel
        if amax is not None:
            q = quantize(q, axis=0, amax=jnp.float32(amax), implementation=implementation, **flags)
        arrays = [q.codes, q.scales, np.float32(to_host(q.global_scale)), input_scale]
        return {name: to_host(a) for (name, _, _), a in zip(specs, arrays, strict=False)}

    return Unit(tuple(specs), produce)


def _dense_unit(t: Tensor, dtype) -> Unit:
    transposed = t.kind in ("linear", "experts", "router")
    if is_nvfp4_array(t.value) and not t.linear:
        raise TypeError(f"export_hf_checkpoint: {t.where} is an NVFP4Array but no linear kernel")
    shape = t.shape
    if transposed:
        if len(shape) != 2:
            raise ValueError(f"export_hf_checkpoint: the kernel at {t.where} is not 2-D: {shape}")
        shape = shape[::-1]
    source = np.dtype(t.value.dtype)
    if not is_float(source) and t.kind != "plain":
        raise TypeError(
            f"export_hf_checkpoint: {t.where} (Flax path {t.path!r}, HF {t.hf}, a {t.kind}) "
            f"has dtype {source}; load_hf_checkpoint and engines read a {t.kind} as floats "
            "only (a tensor of another dtype needs a name map rule of kind 'plain')"
        )
    target = np.dtype(dtype) if dtype is not None and is_float(source) else source
    if target not in ST_NAMES:
        raise TypeError(
            f"export_hf_checkpoint: {t.where} has dtype {target}, which safetensors lacks"
        )

    def produce() -> dict[str, np.ndarray]:
        kernel = t.kernel
        value = dequantize(kernel, jnp.float32) if is_nvfp4_array(kernel) else kernel
        array = to_host(value).astype(target, copy=False)
        return {t.hf: array.T if transposed else array}

    return Unit(((t.hf, ST_NAMES[target], shape),), produce)


def make_units(tensors, amaxes, input_scales, flags_of, dtype, implementation) -> list[Unit]:
    """The units of every tensor; `flags_of(t)`: `quantize`'s flags for a quantized kernel."""
    units = []
    for t in tensors:
        if t.quantized:
            scale = input_scales.get(t.module)
            flags = flags_of(t)
            units.append(_quantized_unit(t, amaxes[t.module], scale, flags, implementation))
        else:
            units.append(_dense_unit(t, dtype))
    owners: dict[str, str] = {}
    for t, unit in zip(tensors, units, strict=True):
        for name, _, _ in unit.specs:
            if name in owners:
                raise ValueError(
                    f"export_hf_checkpoint: the leaves at {owners[name]} and {t.where} both "
                    f"write the tensor {name!r}"
                )
            owners[name] = t.where
    return units
