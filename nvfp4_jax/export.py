"""Export of dense weights to an NVFP4 safetensors checkpoint that inference engines read.

Convention: the NVIDIA ModelOpt ("TensorRT Model Optimizer") unified Hugging Face NVFP4
checkpoint, which vLLM (`ModelOptNvFp4Config`), SGLang and TensorRT-LLM load. Followed from
ModelOpt's `modelopt/torch/quantization/qtensor/nvfp4_tensor.py` (`NVFP4QTensor.quantize` /
`dequantize`: packing `(q[..., 1::2] << 4) | q[..., 0::2]`, `weight_scale_2 = amax / (6 *
448)`, block scales `float8_e4m3fn` of shape `(N, K / 16)`, dequantization `value(code) *
(f32(weight_scale) * weight_scale_2)`) and vLLM's ModelOpt NVFP4 linear method (parameters
`weight` uint8 `(N, K / 2)`, `weight_scale` `(N, K / 16)` row-major, swizzled by the engine
after loading, `weight_scale_2` and `input_scale` f32, `alpha = input_scale *
weight_scale_2`). For every quantized Dense/Linear layer `<name>` (Flax kernel `(K, N)`, K =
in_features; the file holds PyTorch's `(out_features, in_features)` orientation):

* `<name>.weight`: uint8 (U8) `(N, K / 2)`, E2M1 codes, element 2i in the low nibble and
  2i+1 in the high nibble (bit 3 of a code is its sign);
* `<name>.weight_scale`: F8_E4M3 `(N, K / 16)`, the block scales, row-major;
* `<name>.weight_scale_2`: F32 `()`, `D = amax * RCP2688` (docs/NUMERICS.md section 3);
* `<name>.input_scale`: F32 `()`, only with `input_amax`: `amax_x * RCP2688`;
* `<name>.weight_scale_swizzled`: F8_E4M3, flat, only with `swizzled_scales`
  (docs/NUMERICS.md section 11).

Every other leaf is written as it is, named by its path joined with "."; kernels that cannot
be quantized (not 2-D, or a dim not a multiple of 16) are written transposed as
`<name>.weight` in their own dtype and listed in `exclude_modules`. A `hf_quant_config.json`
beside the weights (`{"producer": ..., "quantization": {"quant_algo": "NVFP4", "group_size":
16, "exclude_modules": [...]}}`) is what those engines look for.

What is verified (tests/test_interop.py): the file read back with `safetensors` and decoded
with the ModelOpt formula above equals `nvfp4_jax.dequantize` bit for bit (our
`weight_scale_2` is `amax * RCP2688`, the factor our dequantizer multiplies by; ModelOpt
writes `amax / 2688`, at most one f32 ulp away). Not verified here: loading in a real engine.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nvfp4_jax import formats
from nvfp4_jax._version import __version__
from nvfp4_jax.array import is_nvfp4_array
from nvfp4_jax.layout import swizzle_scales
from nvfp4_jax.ops import quantize
from nvfp4_jax.reference import decode_scale as global_decode_scale

WEIGHTS_FILE = "model.safetensors"
QUANT_CONFIG_FILE = "hf_quant_config.json"
# Path components that name the weight of a Flax Dense/Linear, and Variable wrappers to drop.
_KERNEL_NAMES = ("kernel",)
_WRAPPER_NAMES = ("value", "raw_value")
_SAFETENSORS_DTYPES = {
    "U8": np.uint8,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F32": np.float32,
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "I32": np.int32,
    "I64": np.int64,
}


def _safetensors():
    try:
        import safetensors.numpy  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            "nvfp4_jax.export needs the 'safetensors' package: pip install 'nvfp4_jax[export]' "
            "(or pip install safetensors)"
        ) from error
    return safetensors


def export_nvfp4_safetensors(
    directory: str | os.PathLike,
    params: Any,
    *,
    block_2d: bool = True,
    input_amax: dict[str, float] | None = None,
    swizzled_scales: bool = False,
    implementation: str | None = None,
) -> dict[str, str]:
    """Writes `params`' dense kernels as NVFP4 (ModelOpt convention) to `directory`.

    Args:
      directory: created if needed; receives `model.safetensors` and `hf_quant_config.json`.
      params: a pytree of arrays (Flax params, an nnx state); a leaf whose last path
        component is `kernel` and that is 2-D with both dims multiples of 16 is quantized.
      block_2d: 16x16 weight blocks (the training recipe's; the forward pass of a model
        trained with `NVFP4Recipe()` sees exactly these values); False for 1x16 (lower error).
      input_amax: optional `{name: activation amax}` for W4A4 engines: `<name>.input_scale`.
      swizzled_scales: also write `<name>.weight_scale_swizzled` (cuBLAS layout).
      implementation: as in `quantize`.

    Returns:
      `{tensor name: "nvfp4" | "excluded" | "array"}` for every layer or tensor written.
    """
    safetensors = _safetensors()
    tensors, kinds, excluded = {}, {}, []
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_nvfp4_array)
    for path, leaf in flat:
        names = [_key_name(k) for k in path if _key_name(k) not in _WRAPPER_NAMES]
        if is_nvfp4_array(leaf):
            raise TypeError(f"export: {'.'.join(names)} is already quantized; pass float weights")
        leaf = jnp.asarray(leaf)
        if not names or names[-1] not in _KERNEL_NAMES:
            name = ".".join(names)
            tensors[name], kinds[name] = np.asarray(leaf), "array"
            continue
        name = ".".join(names[:-1])
        if _quantizable(leaf):
            tensors.update(_nvfp4_tensors(name, leaf, block_2d, swizzled_scales, implementation))
            kinds[name] = "nvfp4"
        else:
            tensors[f"{name}.weight"] = np.asarray(leaf.T if leaf.ndim == 2 else leaf)
            kinds[name] = "excluded"
            excluded.append(name)
    for name, amax in (input_amax or {}).items():
        if kinds.get(name) != "nvfp4":
            raise ValueError(f"export: input_amax names {name!r}, which is not a quantized layer")
        tensors[f"{name}.input_scale"] = np.asarray(global_decode_scale(jnp.float32(amax)))
    os.makedirs(directory, exist_ok=True)
    metadata = {"format": "pt", "producer": "nvfp4_jax", "quant_algo": "NVFP4"}
    safetensors.numpy.save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata)
    with open(os.path.join(directory, QUANT_CONFIG_FILE), "w") as file:
        json.dump(_quant_config(excluded), file, indent=2)
    return kinds


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a safetensors file into NumPy arrays, float8_e4m3fn included.

    `safetensors.numpy.load_file` cannot (NumPy has no float8 dtype), so this reads the raw
    bytes with `safetensors.deserialize` and views them through `ml_dtypes`.
    """
    safetensors = _safetensors()
    with open(path, "rb") as file:
        entries = safetensors.deserialize(file.read())
    out = {}
    for name, entry in entries:
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise TypeError(f"read_safetensors: {name} has unsupported dtype {entry['dtype']}")
        data = np.frombuffer(bytes(entry["data"]), _SAFETENSORS_DTYPES[entry["dtype"]])
        out[name] = data.reshape(entry["shape"])
    return out


def _quantizable(kernel) -> bool:
    return (
        kernel.ndim == 2
        and jnp.dtype(kernel.dtype) in formats.SUPPORTED_DTYPES
        and all(d % formats.BLOCK_SIZE == 0 for d in kernel.shape)
    )


def _nvfp4_tensors(name, kernel, block_2d, swizzled, implementation) -> dict[str, np.ndarray]:
    # Quantized along K (axis 0): stored (N, K), the engines' (out, in) orientation.
    q = quantize(kernel, axis=0, block_2d=block_2d, implementation=implementation)
    tensors = {
        f"{name}.weight": np.asarray(q.codes),
        f"{name}.weight_scale": np.asarray(q.scales),
        f"{name}.weight_scale_2": np.asarray(global_decode_scale(q.amax)),
    }
    if swizzled:
        tensors[f"{name}.weight_scale_swizzled"] = np.asarray(swizzle_scales(q.scales))
    return tensors


def _quant_config(excluded) -> dict:
    return {
        "producer": {"name": "nvfp4_jax", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": formats.BLOCK_SIZE,
            "exclude_modules": sorted(excluded),
        },
    }


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
