"""Import: the safetensors files of a checkpoint and the tensors of each NVFP4 linear.

`open_checkpoint` opens every top-level safetensors file and checks them against the index;
`split_tensors` sorts the tensors into NVFP4 linears, KV-cache scales and the others;
`check_quantized` checks one linear's tensors (all there, dtypes, shapes, scale values)
before anything is read from them, and `check_block_scales` its block scales as they are
read.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

import numpy as np

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.io.hf.format import (
    FIRST_BAD_SCALE_BYTE,
    INDEX_NAME,
    KV_SUFFIXES,
    QUANT_OPTIONAL,
    QUANT_SCALARS,
    QUANT_SUFFIXES,
    QUANT_TENSORS,
    read_json,
    short,
)
from nvfp4_jax._src.io.hf.load.config import (
    Quant,
    json_field,
)
from nvfp4_jax._src.io.hf.names import engine_ignores
from nvfp4_jax._src.io.hf.safetensors_files import ST_NAMES, Entry, SafetensorsFile, is_float


def open_checkpoint(directory: str) -> dict[str, SafetensorsFile]:
    """`{tensor name: its file}` over every top-level safetensors file (as engines load)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"load_hf_checkpoint: {directory} holds no *.safetensors file")
    owner: dict[str, SafetensorsFile] = {}
    for name in names:
        file = SafetensorsFile(os.path.join(directory, name))
        for tensor in file.entries:
            if tensor in owner:
                raise ValueError(
                    f"load_hf_checkpoint: {tensor} is in {owner[tensor].path} and {name}"
                )
            owner[tensor] = file
    _check_index(directory, owner)
    return owner


def _check_index(directory: str, owner: dict[str, SafetensorsFile]) -> None:
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(path):
        return
    weight_map = json_field(read_json(path).get("weight_map"), dict, path, "weight_map")
    for name, file in weight_map.items():
        json_field(file, str, path, f"weight_map[{name!r}]")
        if file in ("", ".", "..") or os.path.basename(file) != file or re.search(r"[/\\]", file):
            raise ValueError(
                f"load_hf_checkpoint: {path}: weight_map[{name!r}] is {short(file)}, not a "
                "file name in the checkpoint's directory (no path separators, no '..')"
            )
    found = {name: os.path.basename(file.path) for name, file in owner.items()}
    if weight_map != found:
        diff = sorted(set(weight_map.items()) ^ set(found.items()))[:3]
        raise ValueError(f"load_hf_checkpoint: {INDEX_NAME} disagrees with the files: {diff}")


def split_tensors(owner: dict, quant: Quant | None) -> tuple[dict, list, list]:
    """Quantized modules (`{module: {suffix: name}}`), KV-cache scales and other tensors."""
    names = sorted(owner)
    quantized = {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}
    if quantized and quant is None:
        raise ValueError(
            "load_hf_checkpoint: NVFP4 tensors (weight_scale) but no quantization config"
        )
    modules: dict[str, dict[str, str]] = {m: {} for m in sorted(quantized)}
    kv, plain = [], []
    for name in names:
        module, _, suffix = name.rpartition(".")
        if module in modules and suffix in QUANT_SUFFIXES:
            modules[module][suffix] = name
        elif suffix in QUANT_SCALARS:
            raise ValueError(
                f"load_hf_checkpoint: {name} belongs to no NVFP4 linear (no {module}.weight_scale)"
            )
        elif suffix in KV_SUFFIXES:
            kv.append(name)
        else:
            plain.append(name)
    return modules, kv, plain


def entry_of(owner, name) -> Entry:
    return owner[name].entries[name]


def check_quantized(module: str, parts: dict, owner: dict, quant: Quant) -> None:
    """The tensors of one NVFP4 linear: all there, with the dtypes and shapes that fit."""
    required = set(QUANT_TENSORS) - set(QUANT_OPTIONAL)
    missing = sorted(required - set(parts) | (set(QUANT_OPTIONAL) - set(parts) - quant.optional))
    if missing:
        raise ValueError(
            f"load_hf_checkpoint: the NVFP4 linear {module} lacks {missing} ({quant.algo})"
        )
    if engine_ignores(module, quant.ignore):
        raise ValueError(f"load_hf_checkpoint: {module} is stored in NVFP4 but listed in ignore")
    for suffix, name in parts.items():
        entry = entry_of(owner, name)
        scalar = suffix in QUANT_SCALARS
        rank_ok = math.prod(entry.shape) == 1 if scalar else len(entry.shape) == 2
        if ST_NAMES[entry.dtype] != QUANT_TENSORS[suffix] or not rank_ok:
            raise ValueError(
                f"load_hf_checkpoint: {name} is {ST_NAMES[entry.dtype]} {entry.shape}; "
                f"expected {QUANT_TENSORS[suffix]} {'()' if scalar else '2-D'}"
            )
    weight, scales = (entry_of(owner, parts[k]).shape for k in ("weight", "weight_scale"))
    if (2 * weight[1]) % formats.BLOCK_SIZE or scales != (weight[0], 2 * weight[1] // 16):
        raise ValueError(
            f"load_hf_checkpoint: {module}: weight {weight} and weight_scale {scales} disagree "
            "(need (out, in/2) and (out, in/16))"
        )
    # The exporter's rules: weight_scale_2 = amax / 2688 (0 for an all-zero kernel), and a
    # positive input_scale (engines divide by it).
    checked_scalar(owner, parts["weight_scale_2"], zero_ok=True)
    if "input_scale" in parts:
        checked_scalar(owner, parts["input_scale"], zero_ok=False)


class BadTensor(ValueError):
    """A tensor whose values a checkpoint must not hold (raised while reading it)."""


def checked_scalar(owner, name, *, zero_ok: bool) -> np.ndarray:
    """The float scalar `name` (one element), finite and > 0 (>= 0 with `zero_ok`)."""
    entry, path = entry_of(owner, name), owner[name].path
    if not is_float(entry.dtype) or math.prod(entry.shape) != 1:
        raise ValueError(
            f"load_hf_checkpoint: {name} ({path}) is {ST_NAMES[entry.dtype]} {entry.shape}; "
            "expected a float scalar with one element"
        )
    value = read_scalar(owner, name)
    if not np.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(
            f"load_hf_checkpoint: {name} ({path}) is {value}; it must be finite and "
            f"{'>= 0' if zero_ok else '> 0'}"
        )
    return value


def read_scalar(owner, name) -> np.ndarray:
    return owner[name].read(name).astype(np.float32).reshape(())


def check_block_scales(name: str, path: str) -> Callable[[np.ndarray], None]:
    """A check of E4M3 block scales as read: no NaN (0x7F, 0xFF), no sign bit.

    ModelOpt's scales are amaxes (>= +0); one comparison per byte, on the bytes read anyway.
    """

    def check(array: np.ndarray) -> None:
        if array.size and np.ascontiguousarray(array).view(np.uint8).max() >= FIRST_BAD_SCALE_BYTE:
            raise BadTensor(
                f"load_hf_checkpoint: {name} ({path}) holds NaN or negative block scales "
                "(E4M3 bytes 0x7F and above); ModelOpt writes none"
            )

    return check
