"""Export: a quantized KV cache's scales, as ModelOpt writes them (`k_scale`, `v_scale`).

An NVFP4 (or FP8) KV cache quantizes each layer's keys and values with one decode scale per
side, which vLLM reads from `<attention>.k_proj.k_scale` and `<attention>.v_proj.v_scale`
(f32 scalars; its loader maps them to the attention layer) and uses as `k_scale`,
`v_scale`: a key block of max `a` gets the E4M3 scale `a / (6 * k_scale)`. A checkpoint
without them makes vLLM fall back to 1.0. The scales come from calibrated amaxes
(`kv_cache_amax=`, ModelOpt's convention `f32(amax / 448)`) or from `k_scale` / `v_scale`
leaves beside the `k_proj` / `v_proj` kernels (what `load_hf_checkpoint` returns), written
as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from nvfp4_jax._src.core.kv_spec import KV_SCALE_DIVISOR
from nvfp4_jax._src.core.multihost import to_host
from nvfp4_jax._src.io.hf.export.tensors import Leaves, Tensor
from nvfp4_jax._src.io.hf.safetensors_files import Unit

# The side's projection and the name of its scale: (k_proj, k_scale), (v_proj, v_scale).
_SIDES = (("k_proj", "k_scale"), ("v_proj", "v_scale"))


def _scalar(value, what: str) -> np.float32:
    """A finite, positive f32 scalar, or a ValueError naming `what`."""
    array = np.asarray(to_host(value))
    if array.size != 1 or array.dtype.kind not in "fiu":
        raise ValueError(
            f"export_hf_checkpoint: {what} must be one number, got {array.dtype} {array.shape}"
        )
    scalar = np.float32(array.reshape(()))
    if not (np.isfinite(scalar) and scalar > 0):
        raise ValueError(
            f"export_hf_checkpoint: {what} is {scalar}; a KV-cache scale must be finite and "
            "positive (vLLM and load_hf_checkpoint refuse 0)"
        )
    return scalar


def _linears(tensors: list[Tensor]) -> dict[str, str]:
    """`{Flax module path: HF module name}` of every linear (e.g. layers/0/self_attn/k_proj)."""
    return {t.flax_module: t.module for t in tensors if t.linear}


def _module_of(path: str, linears: dict[str, str]) -> str:
    """The HF module of the attention whose Flax path or HF name is `path`."""
    for flax_module, hf_module in linears.items():
        parent_flax, parent_hf = flax_module.rpartition("/")[0], hf_module.rpartition(".")[0]
        if path in (parent_flax, parent_hf) and flax_module.endswith("/k_proj"):
            return parent_hf
    raise ValueError(
        f"export_hf_checkpoint: kv_cache_amax names {path!r}, which holds no k_proj linear "
        "(give an attention module's Flax path, e.g. 'layers/0/self_attn', or its HF name)"
    )


def kv_scales(tensors: list[Tensor], leaves: Leaves, amaxes: Mapping | None) -> dict:
    """`{HF tensor name: f32 scale}` of every KV-cache scale to write.

    The `k_scale` / `v_scale` leaves first (beside a k_proj / v_proj kernel), then the scales
    of `amaxes` (`{attention path: (k_amax, v_amax)}`), which replace them.
    """
    linears = _linears(tensors)
    scales: dict[str, np.float32] = {}
    for path, (where, value) in leaves.kv_scale.items():
        module, _, suffix = path.rpartition("/")
        if module not in linears:
            raise ValueError(
                f"export_hf_checkpoint: the KV-cache scale at {where} sits beside no exported "
                f"linear ({module!r})"
            )
        scales[f"{linears[module]}.{suffix}"] = _scalar(value, where)
    for path, pair in (amaxes or {}).items():
        attention = _module_of(path, linears)
        if len(pair) != 2:
            raise ValueError(f"export_hf_checkpoint: kv_cache_amax[{path!r}] must be (k, v)")
        for (proj, suffix), amax in zip(_SIDES, pair, strict=True):
            what = f"kv_cache_amax[{path!r}] ({suffix[0]})"
            scale = _scalar(amax, what) / np.float32(KV_SCALE_DIVISOR)  # a true f32 division
            scales[f"{attention}.{proj}.{suffix}"] = _scalar(scale, what)
    return scales


def kv_units(scales: dict) -> list[Unit]:
    """One unit per scale: an F32 tensor of shape (), as ModelOpt writes it."""
    return [
        Unit(((name, "F32", ()),), lambda name=name, v=value: {name: np.asarray(v, np.float32)})
        for name, value in sorted(scales.items())
    ]
