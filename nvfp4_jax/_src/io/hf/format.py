"""What the modules of `nvfp4_jax.hf` share: the format's file names and constants, strict JSON.

JSON files (`config.json`, `hf_quant_config.json`, the index, a safetensors header) are parsed
strictly (UTF-8, no duplicate keys, no NaN or Infinity, bounded nesting: a hostile file gets a
ValueError naming it, never a crash) and written with an fsync.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Literal, get_args

from nvfp4_jax._src.io.durable import fsync_fd
from nvfp4_jax._version import __version__

CONFIG_NAME = "config.json"
QUANT_CONFIG_NAME = "hf_quant_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# The checkpoint formats written: NVFP4 weights and activations, or NVFP4 weights only.
QuantAlgo = Literal["NVFP4", "W4A16_NVFP4"]
QUANT_ALGOS = get_args(QuantAlgo)
# What an engine needs beyond the weights (heads and layers cannot be read off the tensors).
REQUIRED_CONFIG_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
)
# The producer of config.json's quantization_config (read by no engine: any name works), and
# the one of the legacy hf_quant_config.json, which vLLM reads only under ModelOpt's name:
# the file is ModelOpt's format, written as ModelOpt 0.47 writes it.
PRODUCER = {"name": "nvfp4_jax", "version": __version__}
LEGACY_PRODUCER = {
    "name": "modelopt",
    "version": "0.47.0",
    "exported_by": {"name": "nvfp4_jax", "version": __version__},
}
# The ModelOpt tensor table of one NVFP4 linear: `<module>.<suffix>` -> its safetensors
# dtype, in the order an export writes them (export_units), a load checks them (load_files)
# and the MaxText side finds them (integrations/maxtext_plan): `weight` the E2M1 codes
# (out, in/2), `weight_scale` the E4M3 block scales (out, in/16), `weight_scale_2` the decode
# scale D = amax / 2688 (), and `input_scale` the activation's amax / 2688 () (W4A4 only).
QUANT_TENSORS = {
    "weight": "U8",
    "weight_scale": "F8_E4M3",
    "weight_scale_2": "F32",
    "input_scale": "F32",
}
QUANT_SUFFIXES = tuple(QUANT_TENSORS)
# The scalars (shape ()) among them; the others are 2-D.
QUANT_SCALARS = ("weight_scale_2", "input_scale")
# The one a linear may lack: the activation's scale of a weight-only ("W4A16_NVFP4") export.
QUANT_OPTIONAL = ("input_scale",)
# KV-cache scales (`k_proj.k_scale`).
KV_SUFFIXES = ("k_scale", "v_scale")
# The KV-cache quantizations an export declares (`kv_cache_quant_algo`; ModelOpt's names).
KV_CACHE_ALGOS = ("NVFP4",)
MAX_HEADER = 100 * 2**20
# E4M3 block scale bytes from 0x7F up are NaN (0x7F, 0xFF) or carry the sign bit: ModelOpt's
# block scales are amaxes (>= +0), so the import refuses them and the export never writes them.
FIRST_BAD_SCALE_BYTE = 0x7F


# --- strict JSON ------------------------------------------------------------------------------


def short(value, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (a hostile file's values can be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A JSON string (escapes included), and every byte but brackets: to measure nesting.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
MAX_JSON_DEPTH = 64


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _DuplicateKey(twice)
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads(path: str, blob: bytes, what: str):
    """Strict JSON from UTF-8 `blob`: no duplicate keys, no NaN/Infinity, bounded nesting.

    Raises a ValueError naming `path` for anything else; the nesting is measured before the
    parser runs (without recursion), so a hostile file cannot exhaust the stack.
    """
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: {what} is not UTF-8 ({error})") from None
    # Removing the innermost bracket pairs once per level: what is left after the limit
    # nests deeper than it, or its brackets do not match.
    brackets = _JSON_STRING.sub(b"", blob).translate(None, _NOT_BRACKETS)
    for _ in range(MAX_JSON_DEPTH):
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == brackets:
            break
        brackets = shorter
    if brackets:
        raise ValueError(
            f"{path}: {what} is not valid JSON: its brackets nest deeper than "
            f"{MAX_JSON_DEPTH} levels or do not match"
        )
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _DuplicateKey as error:
        raise ValueError(f"{path}: {what} holds the key {error.args[0]!r} twice") from None
    except (ValueError, RecursionError, MemoryError) as error:
        raise ValueError(f"{path}: {what} is not valid JSON: {short(error, 200)}") from None


def read_json(path: str) -> dict:
    """The JSON object in `path` (strict JSON, as `loads`); a ValueError naming it otherwise."""
    size = os.path.getsize(path)
    if size > MAX_HEADER:
        raise ValueError(f"{path}: {size} bytes; a JSON config holds at most {MAX_HEADER}")
    with open(path, "rb") as file:
        value = loads(path, file.read(), "the file")
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value


def json_text(value) -> str:
    """`value` as the JSON text `write_json` writes (ValueError for NaN or infinity)."""
    return json.dumps(value, indent=2, allow_nan=False) + "\n"


def write_json(path: str, value) -> None:
    text = json_text(value)
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        fsync_fd(file.fileno())
