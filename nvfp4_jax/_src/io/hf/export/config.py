"""Export: `config.json`, its `quantization_config`, ModelOpt's `hf_quant_config.json`.

The model config is checked against the weights: engines read what the weights cannot tell
(heads, layers, the MoE routing) from it, so it must hold those keys, and its sizes must
agree with the embedding, the experts kernels and the routers. It must also be what strict
JSON readers (`load_hf_checkpoint`, engines) read back: no NaN or infinity, no key twice
once keys are strings, bounded nesting.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.io.hf.format import (
    CONFIG_NAME,
    LEGACY_PRODUCER,
    MAX_HEADER,
    MAX_JSON_DEPTH,
    PRODUCER,
    REQUIRED_CONFIG_KEYS,
    json_text,
    read_json,
)


def quantization_config(quant_algo: str, ignore: list[str], kv_cache: str | None = None) -> dict:
    """config.json's `quantization_config`, in the form ModelOpt >= 0.31 writes.

    With a KV-cache quantization, `kv_cache_scheme` names it as ModelOpt's
    `convert_hf_quant_config_format` does for one other than FP8: the algorithm's name.
    """
    nvfp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": formats.BLOCK_SIZE}
    group: dict[str, Any] = {"weights": dict(nvfp4)}
    if quant_algo == "NVFP4":
        group["input_activations"] = dict(nvfp4)
    group["targets"] = ["Linear"]
    return {
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "quant_algo": quant_algo,
        "producer": dict(PRODUCER),
        "quant_method": "modelopt",
    } | ({"kv_cache_scheme": kv_cache} if kv_cache else {})


def legacy_quant_config(quant_algo: str, ignore: list[str], kv_cache: str | None = None) -> dict:
    """ModelOpt's legacy `hf_quant_config.json` (read by TensorRT-LLM, older engines)."""
    return {
        "producer": dict(LEGACY_PRODUCER),
        "quantization": {
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": kv_cache,
            "group_size": formats.BLOCK_SIZE,
            "exclude_modules": list(ignore),
        },
    }


def read_model_config(config, directory: str) -> dict:
    """The caller's model config, or the one in `directory`, checked for what engines need."""
    path = os.path.join(directory, CONFIG_NAME)
    if config is None and os.path.isfile(path):
        config = read_json(path)
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(f"export_hf_checkpoint: config must be a dict, got {type(config).__name__}")
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(
            f"export_hf_checkpoint: the model config lacks {missing}: engines cannot read them "
            "off the weights. Pass config= (the model's Hugging Face config.json as a dict, e.g. "
            "transformers' LlamaConfig(...).to_dict()) or put a config.json in the directory"
        )
    if not isinstance(config["architectures"], list) or not config["architectures"]:
        raise ValueError("export_hf_checkpoint: config['architectures'] must be a non-empty list")
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    _check_strict_json(config)
    return config


def _check_strict_json(config: dict) -> None:
    """Raises for a config that `config.json` cannot hold as strict JSON, naming the field."""
    fault = _json_fault(config, "config", 1)
    if fault is not None:
        raise fault
    size = len(json_text(config).encode())
    if size > MAX_HEADER:
        raise ValueError(
            f"export_hf_checkpoint: config is {size} bytes as JSON; a config.json holds at "
            f"most {MAX_HEADER}"
        )


# What JSON holds besides dicts and lists (a float subclass too: json writes it as a float).
_JSON_SCALARS = (str, int, float, bool, type(None))


def _json_fault(value, where: str, depth: int) -> Exception | None:
    """The first field of `value` strict JSON cannot hold, as the error to raise, or None."""
    prefix = "export_hf_checkpoint:"
    if depth > MAX_JSON_DEPTH:
        return ValueError(
            f"{prefix} {where} nests deeper than {MAX_JSON_DEPTH} levels, more than a strict "
            "JSON reader takes"
        )
    if isinstance(value, float) and not math.isfinite(value):
        return ValueError(f"{prefix} {where} is {value}, which strict JSON cannot hold")
    if isinstance(value, _JSON_SCALARS):
        return None
    if isinstance(value, (list, tuple)):
        children = [(f"{where}[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        children, fault = _json_members(value, where)
        if fault is not None:
            return fault
    else:
        return TypeError(
            f"{prefix} {where} is a {type(value).__name__}, which JSON cannot hold (use "
            "Python's str, int, float, bool, None, list and dict)"
        )
    for name, child in children:
        fault = _json_fault(child, name, depth + 1)
        if fault is not None:
            return fault
    return None


def _json_members(value: dict, where: str) -> tuple[list, Exception | None]:
    """((path, member) of every member, the error of a key JSON cannot hold or holds twice)."""
    seen: set[str] = set()
    for key in value:
        bad_float = isinstance(key, float) and not math.isfinite(key)
        if not isinstance(key, _JSON_SCALARS) or bad_float:
            return [], TypeError(
                f"export_hf_checkpoint: {where} has the key {key!r}, a "
                f"{type(key).__name__}; JSON keys are strings"
            )
        text = next(iter(json.loads(json_text({key: 0}))))  # the key as json writes it
        if text in seen:
            return [], ValueError(
                f"export_hf_checkpoint: {where} holds the key {text!r} twice once written "
                "(JSON keys are strings: 1 and '1' are one key)"
            )
        seen.add(text)
    return [(f"{where}[{key!r}]", member) for key, member in value.items()], None


def check_config_against(config: dict, tensors, dtype) -> dict:
    _check_moe_config(config, tensors)
    for t in tensors:
        if t.kind == "embedding":
            vocab, hidden = tuple(t.value.shape)
            if (config["vocab_size"], config["hidden_size"]) != (vocab, hidden):
                raise ValueError(
                    f"export_hf_checkpoint: the config says vocab_size {config['vocab_size']}, "
                    f"hidden_size {config['hidden_size']}; the embedding {t.hf} is "
                    f"{(vocab, hidden)}"
                )
    if dtype is not None and "dtype" not in config and "torch_dtype" not in config:
        config = {**config, "torch_dtype": np.dtype(dtype).name}
    return config


# The config keys of a mixture of experts (engines read routing from the config, not weights).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


_MOE_SIZE_KEY_TYPES = ("qwen3_moe", "qwen2_moe")


def _check_moe_config(config: dict, tensors) -> None:
    """The MoE keys of the config, as far as the weights' shapes can be checked against them.

    The expert count (`num_experts`, Qwen3-MoE; `num_local_experts`, Mixtral and
    transformers 5's alias) must be the experts kernels' E and the routers' output size;
    `num_experts_per_tok` must lie in 1..E; one expert's MLP size (`moe_intermediate_size`
    where the config has it or the model is a Qwen-MoE, else Mixtral's `intermediate_size`)
    must be the experts kernels' other size beside `hidden_size`.
    """
    stacks = [t for t in tensors if t.kind == "experts" and t.expert == 0]
    routers = [t for t in tensors if t.kind == "router"]
    if not stacks and not routers:
        return
    present = [key for key in _EXPERT_COUNT_KEYS if key in config]
    count = config[present[0]] if present else None
    per_token = config.get("num_experts_per_tok")
    problems = []
    if not _is_count(count):
        problems.append(f"an expert count ({' or '.join(_EXPERT_COUNT_KEYS)}), got {count!r}")
    elif not _is_count(per_token) or per_token > count:
        problems.append(f"num_experts_per_tok from 1 to {count}, got {per_token!r}")
    moe_size = "moe_intermediate_size" in config or config["model_type"] in _MOE_SIZE_KEY_TYPES
    size_key = "moe_intermediate_size" if moe_size else "intermediate_size"
    size = config.get(size_key)
    if stacks and not _is_count(size):
        problems.append(f"{size_key} (one expert's MLP size), got {size!r}")
    if problems:
        raise ValueError(
            f"export_hf_checkpoint: the model holds mixture-of-experts layers, and the model "
            f"config needs {'; '.join(problems)}: engines read the routing from config.json. "
            "Pass config= the model's Hugging Face config (Qwen3MoeConfig(...).to_dict(), "
            "MixtralConfig(...).to_dict())"
        )
    hidden = config["hidden_size"]
    for t in stacks:
        experts, *sizes = (int(n) for n in t.value.shape)
        if experts != count or sorted(sizes) != sorted((hidden, size)):
            raise ValueError(
                f"export_hf_checkpoint: the experts kernel at {t.path} has shape "
                f"{tuple(t.value.shape)}, but the config says {present[0]}={count}, "
                f"hidden_size={hidden}, {size_key}={size}: expected ({count}, {hidden}, {size}) "
                f"or ({count}, {size}, {hidden})"
            )
    for t in routers:
        if tuple(t.value.shape) != (hidden, count):
            raise ValueError(
                f"export_hf_checkpoint: the router {t.module} ({t.where}) has kernel shape "
                f"{tuple(t.value.shape)}; the config says hidden_size={hidden}, "
                f"{present[0]}={count}: expected (hidden, experts) = ({hidden}, {count})"
            )


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
