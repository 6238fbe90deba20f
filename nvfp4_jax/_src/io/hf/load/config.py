"""Import: what a checkpoint's configs say: its quantization, expert count and dtype.

The quantization comes from config.json's `quantization_config` or from ModelOpt's legacy
`hf_quant_config.json`; every field read is checked for its JSON type (`json_field`), and
errors name the file and the field.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.io.hf.format import (
    CONFIG_NAME,
    QUANT_ALGOS,
    QUANT_CONFIG_NAME,
    QUANT_OPTIONAL,
    read_json,
    short,
)


@dataclasses.dataclass(frozen=True)
class Quant:
    """What a checkpoint's quantization config says."""

    algo: str
    weight_only: bool
    ignore: tuple[str, ...]

    @property
    def optional(self) -> set[str]:
        """Tensors a quantized linear may lack: `input_scale` when weight-only."""
        return set(QUANT_OPTIONAL) if self.weight_only else set()


def read_quant_config(directory: str, config: dict) -> Quant | None:
    """The checkpoint's quantization, from config.json or hf_quant_config.json; None if none.

    Every field read is checked for its JSON type; errors name the file and the field.
    """
    raw = config.get("quantization_config")
    source, prefix = os.path.join(directory, CONFIG_NAME), "quantization_config"
    legacy_path = os.path.join(directory, QUANT_CONFIG_NAME)
    if raw is None and os.path.isfile(legacy_path):
        raw = {"quant_method": "modelopt", **read_json(legacy_path)}
        source, prefix = legacy_path, ""
    if raw is None:
        return None
    json_field(raw, dict, source, prefix or "the file")
    method = json_field(raw.get("quant_method", ""), str, source, _join(prefix, "quant_method"))
    if not method.lower().startswith("modelopt"):
        raise ValueError(
            f"load_hf_checkpoint: {source} has quant_method {method!r}; only NVIDIA "
            "ModelOpt NVFP4 checkpoints (quant_method 'modelopt') are read"
        )
    if "quantization" in raw:
        prefix = _join(prefix, "quantization")
        inner = json_field(raw["quantization"], dict, source, prefix)
    else:
        inner = raw
    name = inner.get("quant_algo", "")
    algo = json_field(name, str, source, _join(prefix, "quant_algo")).upper()
    if algo not in QUANT_ALGOS:
        raise ValueError(
            f"load_hf_checkpoint: {source} has quant_algo {name!r}; only {QUANT_ALGOS} are read"
        )
    groups = json_field(
        inner.get("config_groups") or {}, dict, source, _join(prefix, "config_groups")
    )
    for key, group in groups.items():
        where = _join(prefix, f"config_groups.{key}")
        json_field(group, dict, source, where)
        for part in ("weights", "input_activations"):
            json_field(group.get(part) or {}, dict, source, f"{where}.{part}")
    _check_group_size(source, prefix, inner)
    no_inputs = bool(groups) and all(g.get("input_activations") is None for g in groups.values())
    key = "ignore" if "ignore" in inner else "exclude_modules"
    ignore = inner.get(key) or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ValueError(
            f"load_hf_checkpoint: {source}: {_join(prefix, key)} must be a list of module "
            f"names (strings), got {short(ignore)}"
        )
    return Quant(algo, algo == "W4A16_NVFP4" or no_inputs, tuple(ignore))


_JSON_KINDS = {dict: "a JSON object", list: "a JSON list", str: "a string"}


def json_field(value, kind: type, source: str, field: str):
    """`value` if it is of JSON type `kind`; else a ValueError naming the file and field."""
    if not isinstance(value, kind):
        raise ValueError(
            f"load_hf_checkpoint: {source}: {field} must be {_JSON_KINDS[kind]}, got {short(value)}"
        )
    return value


def _join(prefix: str, field: str) -> str:
    return f"{prefix}.{field}" if prefix else field


def _check_group_size(source: str, prefix: str, inner: dict) -> None:
    sizes = [("group_size", inner.get("group_size"))]
    for key, group in (inner.get("config_groups") or {}).items():
        for part in ("weights", "input_activations"):
            field = f"config_groups.{key}.{part}.group_size"
            sizes.append((field, (group.get(part) or {}).get("group_size")))
    for field, size in sizes:
        if size is not None and (type(size) is not int or size != formats.BLOCK_SIZE):
            raise ValueError(
                f"load_hf_checkpoint: {source}: {_join(prefix, field)} is {short(size)}; "
                f"NVFP4 needs {formats.BLOCK_SIZE}"
            )


def expert_count(config: dict) -> int | None:
    """The config's expert count (`num_experts`, or `num_local_experts`), None if it has none."""
    for key in ("num_experts", "num_local_experts"):
        if key in config:
            value = config[key]
            if type(value) is not int or value < 1:
                raise ValueError(
                    f"load_hf_checkpoint: {CONFIG_NAME}: {key} must be a positive integer (the "
                    f"experts per MoE layer), got {short(value)}"
                )
            return value
    return None


def config_dtype(config: dict):
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    try:
        return jnp.dtype(str(name).removeprefix("torch."))
    except TypeError:
        return jnp.dtype(jnp.bfloat16)
