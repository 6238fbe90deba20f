"""Export: a model's leaves sorted, and mapped to the Hugging Face tensors they become.

`collect_leaves` sorts the leaves of a pytree or an nnx state into weights, recorded input
amaxes (or scales) and what is skipped; `map_tensors` gives every weight its HF name and
kind through the name map. A stacked experts kernel (E, in, out) becomes E `Tensor`s, one
linear per expert (`...experts.{e}.gate_proj`), each slicing the stack when it is written.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from nvfp4_jax._src.core.array import is_nvfp4_array
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.io.durable import is_key_array, key_name
from nvfp4_jax._src.io.hf.format import (
    KV_SUFFIXES,
)
from nvfp4_jax._src.io.hf.names import NameMap, expert_block


@dataclasses.dataclass
class Leaves:
    """The leaves of the exported tree, sorted: `{Flax path: (where, value)}` per kind."""

    weights: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_amax: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_scale: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    # KV-cache scales `{Flax path of the leaf: (where, value)}` (`.../k_proj/k_scale`).
    kv_scale: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    # Flax module paths holding the variables of an `nvfp4_jax.nnx.Linear`.
    nvfp4: set[str] = dataclasses.field(default_factory=set)


# The variables only an `nvfp4_jax.nnx.Linear` holds: they mark a layer that computes in NVFP4.
_NVFP4_VARIABLES = (nvfp4_nnx.InputAmax, nvfp4_nnx.InputScale, nvfp4_nnx.QuantizedKernel)


def _is_leaf(value) -> bool:
    return isinstance(value, nnx.Variable) or is_nvfp4_array(value)


def collect_leaves(params, skip: Sequence[str]) -> Leaves:
    """Sorts the leaves: weights, recorded input amaxes or scales, and what is skipped.

    Weights are the plain leaves of a pytree, or the `nnx.Param`s (and variables holding an
    `NVFP4Array`) of an nnx state; other nnx variables (rng streams, ...) and PRNG keys are
    not. A leaf named `input_amax` (or `input_scale`, as `load_hf_checkpoint` returns it)
    belongs to the module above it, as does a KV-cache scale `k_scale` / `v_scale` (written
    only when the export declares a KV-cache quantization).
    """
    leaves = Leaves()
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_leaf)
    for keypath, leaf in flat:
        names = [key_name(k) for k in keypath]
        while names and names[-1] in ("value", "raw_value"):
            names.pop()
        path, where = "/".join(names), jax.tree_util.keystr(keypath) or "the root"
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        # A frozen NVFP4 kernel (`Linear.from_quantized`) is a weight though not an nnx.Param.
        is_weight = not isinstance(leaf, nnx.Variable) or isinstance(leaf, nnx.Param)
        is_weight = is_weight or is_nvfp4_array(value)
        if isinstance(leaf, _NVFP4_VARIABLES):
            leaves.nvfp4.add(path.rpartition("/")[0])
        _sort_leaf(leaves, path, where, value, is_weight, skip)
    return leaves


def _sort_leaf(leaves: Leaves, path, where, value, is_weight, skip) -> None:
    parent, _, last = path.rpartition("/")
    if any(re.fullmatch(pattern, path) for pattern in skip):
        leaves.skipped.append(path)
    elif last in ("input_amax", "input_scale"):
        getattr(leaves, last)[parent] = (where, value)
    elif last in KV_SUFFIXES:
        leaves.kv_scale[path] = (where, value)
    elif not is_weight or is_key_array(value):
        leaves.skipped.append(path)
    elif path in leaves.weights:
        raise ValueError(
            f"export_hf_checkpoint: the leaves at {leaves.weights[path][0]} and {where} have "
            f"the same path {path!r}"
        )
    else:
        leaves.weights[path] = (where, value)


@dataclasses.dataclass
class Tensor:
    """A weight leaf and where it goes: Flax path, HF name, kind, and for linears the module.

    A stacked experts kernel (E, in, out) becomes E `Tensor`s of kind "experts", one per
    expert: the same `path` and `value` (the whole stack, sliced when used: `kernel`), its
    own `hf` name and `expert` index, and `block`, the HF module of the MoE layer's experts
    (e.g. "model.layers.0.mlp.experts").
    """

    path: str
    where: str
    hf: str
    kind: str
    value: Any
    excluded: bool = False
    group: tuple[str, int] | None = None
    # Why a linear is kept in high precision besides `exclude=`: "trained" (the model computed
    # it so) or "group" (a member of its fused group or MoE block was trained so).
    why: str = ""
    expert: int | None = None
    block: str = ""

    @property
    def module(self) -> str:
        return self.hf.removesuffix(".weight")

    @property
    def flax_module(self) -> str:
        return self.path.rpartition("/")[0]

    @property
    def linear(self) -> bool:
        """A linear engines may quantize: a "linear", or one expert of an "experts" stack."""
        return self.kind in ("linear", "experts")

    @property
    def quantized(self) -> bool:
        return self.linear and not self.excluded

    @property
    def kernel(self):
        """The (in, out) kernel: the leaf, or this expert's slice of the stack."""
        if self.expert is None:
            return self.value
        if is_nvfp4_array(self.value):
            return jax.tree.map(lambda leaf: leaf[self.expert], self.value)
        return self.value[self.expert]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of `kernel` (of one expert's), without slicing."""
        shape = tuple(self.value.shape)
        return shape if self.expert is None else shape[1:]


def map_tensors(leaves: Leaves, name_map: NameMap) -> list[Tensor]:
    tensors, owners = [], {}
    for path, (where, value) in leaves.weights.items():
        mapped = name_map.to_hf(path)
        if mapped is None:
            raise ValueError(
                f"export_hf_checkpoint: the leaf at {where} (Flax path {path!r}) matches no "
                "rule of the name map; pass name_map= with a rule for it, or skip= to leave it out"
            )
        hf, kind = mapped
        if kind == "experts":
            shape = tuple(np.shape(value)) if not is_nvfp4_array(value) else value.shape
            if len(shape) != 3 or shape[0] < 1:
                raise ValueError(
                    f"export_hf_checkpoint: the experts kernel at {where} (Flax path {path!r}) "
                    f"has shape {shape}; an experts rule needs a stacked (E, in, out) kernel, "
                    "expert axis first (nvfp4_jax.nnx.Experts' kernel)"
                )
            names = NameMap.expert_names(hf, shape[0])
            block = expert_block(hf)
            found = [
                Tensor(path, f"{where}[{e}]", name, kind, value, expert=e, block=block)
                for e, name in enumerate(names)
            ]
        else:
            found = [Tensor(path, where, hf, kind, value)]
        for t in found:
            if t.hf in owners:
                raise ValueError(
                    f"export_hf_checkpoint: the leaves at {owners[t.hf]} and {t.where} both "
                    f"map to the HF tensor {t.hf!r}"
                )
            owners[t.hf] = t.where
        tensors.extend(found)
    return tensors
