"""The settings of one export: `export_hf_checkpoint`'s keywords, checked once, frozen.

`ExportOptions.from_keywords` takes the entry point's arguments as the caller gave them,
checks each (the algorithm, the flags, the Four Over Six setting, the shard size) and turns
them into the forms the stages use: an absolute directory, a `NameMap`, tuples, a size in
bytes. Every stage of the export then reads this one value.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from nvfp4_jax._src.core import checks
from nvfp4_jax._src.io.hf.format import KV_CACHE_ALGOS, QuantAlgo
from nvfp4_jax._src.io.hf.names import NameMap, as_name_map

# `four_over_six="model"`: quantize each kernel as the training recipe did.
FOLLOW_MODEL = "model"

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """What `export_hf_checkpoint` was asked to do (its keywords, checked and normalized).

    Attributes:
      directory: the checkpoint directory, absolute.
      name_map: the `NameMap` (the default `llama_name_map()` filled in).
      quant_algo: "NVFP4" or "W4A16_NVFP4".
      input_amax: `{Flax path or HF module: amax}` overriding the model's, or None.
      exclude: fnmatch patterns of HF modules kept in high precision.
      config: the caller's model config, or None (then the directory's `config.json`).
      fused_groups: names of sibling linears engines fuse, one tuple per group.
      block_2d: quantize weights in 16x16 blocks.
      four_over_six: "model", None, "mae" or "mse".
      four_over_six_e4m3_max: M of Four Over Six.
      dtype: the dtype of the float tensors (None: each leaf's).
      max_size: bytes per safetensors file.
      skip: regexes of Flax paths left out.
      force: replace the weights a directory holds.
      implementation: the backend of `quantize` and `tensor_amax`.
      rules: the `QuantizeReport` or `Rule`s deciding each linear's precision, or None.
      tokenizer: None or "bytes".
      kv_cache_quant_algo: the KV cache's quantization the checkpoint declares ("NVFP4"),
        or None: no KV-cache scales are written.
      kv_cache_amax: `{attention path: (k_amax, v_amax)}` to write as KV-cache scales, or
        None.
    """

    directory: str
    name_map: NameMap
    quant_algo: str
    input_amax: Mapping[str, Any] | None
    exclude: tuple[str, ...]
    config: Mapping[str, Any] | None
    fused_groups: tuple[tuple[str, ...], ...]
    block_2d: bool
    four_over_six: str | None
    four_over_six_e4m3_max: int
    dtype: Any
    max_size: int
    skip: tuple[str, ...]
    force: bool
    implementation: str | None
    rules: Any
    tokenizer: str | None
    kv_cache_quant_algo: str | None = None
    kv_cache_amax: Mapping[str, Any] | None = None

    @property
    def w4a4(self) -> bool:
        """Whether activations are quantized too ("NVFP4"), so input scales are written."""
        return self.quant_algo == "NVFP4"

    @classmethod
    def from_keywords(
        cls,
        directory: str | os.PathLike,
        *,
        name_map,
        quant_algo: str,
        input_amax: Mapping[str, Any] | None,
        exclude: Sequence[str],
        config: Mapping[str, Any] | None,
        fused_groups: Sequence[Sequence[str]],
        block_2d: bool,
        four_over_six: str | None,
        four_over_six_e4m3_max: int,
        dtype,
        max_shard_size: int | str,
        skip: Sequence[str],
        force: bool,
        implementation: str | None,
        rules: Any,
        tokenizer: str | None,
        kv_cache_quant_algo: str | None = None,
        kv_cache_amax: Mapping[str, Any] | None = None,
    ) -> ExportOptions:
        """The options of `export_hf_checkpoint(directory, params, **keywords)`, checked.

        Raises:
          ValueError: an unknown `quant_algo`, `input_amax` with weight-only, a `block_2d`
            that is not a bool, a bad Four Over Six setting, a bad `max_shard_size`, an
            unknown `kv_cache_quant_algo`.
          TypeError: a `kv_cache_amax` that is not a dict.
        """
        checks.check_choice("export_hf_checkpoint: quant_algo", quant_algo, QuantAlgo)
        if input_amax and quant_algo != "NVFP4":
            raise ValueError(
                "export_hf_checkpoint: input_amax is for quant_algo='NVFP4' (W4A4) only"
            )
        block_2d = checks.check_flag(block_2d, "export_hf_checkpoint", "block_2d")
        if four_over_six != FOLLOW_MODEL:
            checks.check_four_over_six(
                four_over_six, four_over_six_e4m3_max, "export_hf_checkpoint"
            )
        directory = os.path.abspath(os.fspath(directory))
        max_size = parse_size(max_shard_size)
        kv_cache_quant_algo = _check_kv_cache(kv_cache_quant_algo, kv_cache_amax)
        return cls(
            directory=directory,
            name_map=as_name_map(name_map),
            quant_algo=quant_algo,
            input_amax=input_amax,
            exclude=tuple(exclude),
            config=config,
            fused_groups=tuple(map(tuple, fused_groups)),
            block_2d=block_2d,
            four_over_six=four_over_six,
            four_over_six_e4m3_max=four_over_six_e4m3_max,
            dtype=dtype,
            max_size=max_size,
            skip=tuple(skip),
            force=force,
            implementation=implementation,
            rules=rules,
            tokenizer=tokenizer,
            kv_cache_quant_algo=kv_cache_quant_algo,
            kv_cache_amax=kv_cache_amax,
        )


def _check_kv_cache(algo, amaxes) -> str | None:
    """The KV cache's algorithm: as given, or "NVFP4" for calibrated amaxes without one."""
    if amaxes is not None and not isinstance(amaxes, Mapping):
        raise TypeError(
            "export_hf_checkpoint: kv_cache_amax must be a dict {attention path: (k_amax, "
            f"v_amax)}}, got {type(amaxes).__name__}"
        )
    if algo is None and amaxes:
        return "NVFP4"
    if algo is not None and algo not in KV_CACHE_ALGOS:
        raise ValueError(
            f"export_hf_checkpoint: kv_cache_quant_algo must be None or one of "
            f"{KV_CACHE_ALGOS}, got {algo!r}"
        )
    return algo


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size such as "5GB" or "500MiB"; a ValueError otherwise."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if match and match.group(2).upper() in _SIZE_UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    raise ValueError(
        f"export_hf_checkpoint: max_shard_size must be bytes or e.g. '5GB', got {size!r}"
    )
