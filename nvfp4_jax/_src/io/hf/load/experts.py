"""Import: mixture-of-experts layers, E linears in the file, one stacked array in Flax.

The experts of one projection are gathered into a `Stack` (`add_expert`), checked complete
and alike (`check_stack`: every expert 0..E-1, one storage, equal shapes) and read as one
(E, in, out) array, an `NVFP4Array` with one decode scale per expert or floats
(`load_stack`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core.array import NVFP4Array, validate_nvfp4_array
from nvfp4_jax._src.io.hf.load.files import (
    check_block_scales,
    entry_of,
    read_scalar,
)
from nvfp4_jax._src.io.hf.load.place import reader
from nvfp4_jax._src.io.hf.names import expert_block
from nvfp4_jax._src.io.hf.safetensors_files import ST_NAMES


@dataclasses.dataclass
class Stack:
    """The experts of one stacked Flax kernel as found: expert -> (HF module, tensors, NVFP4).

    The tensors are a quantized expert's `{suffix: tensor name}`, or `{"weight": name}` for
    one stored in high precision.
    """

    path: str
    block: str
    experts: dict[int, tuple[str, dict[str, str], bool]] = dataclasses.field(default_factory=dict)


def add_expert(stacks, name_map, path, expert, module, parts, quantized) -> str:
    """Files expert `expert` of the stack at `path`; returns the stack's HF block name."""
    if path not in stacks:
        stacks[path] = Stack(path, expert_block(name_map.to_hf(path)[0]))
    stacks[path].experts[expert] = (module, parts, quantized)
    return stacks[path].block


def _first_missing(present: dict, expected: int, limit: int = 10) -> list[int]:
    """Up to `limit` indices below `expected` not in `present` (a bounded search)."""
    missing = []
    for e in range(expected):  # at most len(present) + limit steps
        if e not in present:
            missing.append(e)
            if len(missing) == limit:
                break
    return missing


def check_stack(stack: Stack, owner, count: int | None) -> tuple[int, bool]:
    """(E, quantized) of a stack: experts 0..E-1 all there, all stored alike, equal shapes."""
    found = sorted(stack.experts)
    expected = count if count is not None else found[-1] + 1
    missing = _first_missing(stack.experts, expected)
    extra = [e for e in found if e >= expected]
    example = stack.experts[found[0]][0]
    if missing or extra:
        source = "the config says" if count is not None else "the highest index found implies"
        absent = expected - (len(found) - len(extra))
        more = f" ({absent} in all)" if absent > len(missing) else ""
        problems = [f"experts {missing} are missing{more}"] if missing else []
        problems += [f"experts {extra} lie beyond them"] if extra else []
        raise ValueError(
            f"load_hf_checkpoint: the experts of {stack.path} (HF {stack.block}) are "
            f"incomplete: {source} {expected} experts, and {' and '.join(problems)} (found "
            f"e.g. {example}); a checkpoint must hold every expert of every MoE layer"
        )
    nvfp4 = [e for e in found if stack.experts[e][2]]
    if nvfp4 and len(nvfp4) != len(found):
        raise ValueError(
            f"load_hf_checkpoint: the experts of {stack.path} (HF {stack.block}) are stored "
            f"partly in NVFP4 (experts {nvfp4}) and partly not; engines load an MoE layer "
            "all quantized or all not"
        )
    first_module, first, _ = stack.experts[0]
    for e in range(1, expected):
        module, parts, _ = stack.experts[e]
        if set(parts) != set(first):
            raise ValueError(
                f"load_hf_checkpoint: {first_module} holds {sorted(first)}, {module} holds "
                f"{sorted(parts)}; every expert of {stack.path} must hold the same tensors"
            )
        for suffix in ("weight", "weight_scale"):
            if suffix not in parts:
                continue
            a, b = (entry_of(owner, p[suffix]) for p in (first, parts))
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"load_hf_checkpoint: the experts of {stack.path} disagree: "
                    f"{first[suffix]} is {ST_NAMES[a.dtype]} {a.shape}, "
                    f"{parts[suffix]} is {ST_NAMES[b.dtype]} {b.shape}; one MoE layer's "
                    "experts must have equal shapes"
                )
    return expected, bool(nvfp4)


def _stacked_reader(readers: list[Callable], shape: tuple[int, ...], dtype) -> Callable:
    """`read(index)` of the stack (E, *shape) from one reader per expert."""

    def read(index):
        if index is None:
            return np.stack([reader(None) for reader in readers])
        first, rest = index[0], tuple(index[1:])
        chosen = [readers[e] for e in range(len(readers))[first]]
        if not chosen:
            sizes = (len(range(n)[part]) for n, part in zip(shape, rest, strict=False))
            return np.empty((0, *sizes), dtype)
        return np.stack([reader(rest) for reader in chosen])

    return read


def _vector(values: np.ndarray) -> Callable:
    return lambda index: values if index is None else values[tuple(index)]


def load_stack(stack: Stack, owner, count, quantized, kernel_dtype, dtype, place) -> dict:
    """One stacked array (E, in, out) from its experts' tensors: an NVFP4Array or floats."""
    experts = [stack.experts[e][1] for e in range(count)]
    if not quantized:
        names = [parts["weight"] for parts in experts]
        entry = entry_of(owner, names[0])
        target = np.dtype(dtype) if dtype is not None else entry.dtype
        shape = entry.shape[::-1]
        readers = [reader(owner, n, transpose=True, dtype=target) for n in names]
        read = _stacked_reader(readers, shape, target)
        return {stack.path: place(stack.path, (count, *shape), target, read)}
    kernel, parent = stack.path, stack.path.rpartition("/")[0]
    f32 = np.dtype(np.float32)
    arrays = {}
    for suffix, leaf in (("weight", "codes"), ("weight_scale", "scales")):
        names = [parts[suffix] for parts in experts]
        entry = entry_of(owner, names[0])
        readers = [
            reader(owner, n, check=check_block_scales(n, owner[n].path))
            if suffix == "weight_scale"
            else reader(owner, n)
            for n in names
        ]
        read = _stacked_reader(readers, entry.shape, entry.dtype)
        shape = (count, *entry.shape)
        arrays[leaf] = place(f"{kernel}/{leaf}", shape, entry.dtype, read, transposed=True)
    ws2 = np.array([read_scalar(owner, parts["weight_scale_2"]) for parts in experts], f32)
    d = place(f"{kernel}/decode_scale", (count,), f32, _vector(ws2))
    amax = place(f"{kernel}/amax", (count,), f32, _vector(ws2 * np.float32(2688)))
    dtype = jnp.dtype(kernel_dtype)
    q = NVFP4Array(arrays["codes"], arrays["scales"], amax, dtype, -2, False, False, d)
    out = {kernel: validate_nvfp4_array(q, f"load_hf_checkpoint: {stack.block} ({kernel})")}
    if "input_scale" in experts[0]:
        scales = np.array([read_scalar(owner, parts["input_scale"]) for parts in experts], f32)
        path = f"{parent}/input_scale"
        out[path] = place(path, (count,), f32, _vector(scales))
    return out
