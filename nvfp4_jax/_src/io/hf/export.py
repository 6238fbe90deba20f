"""Export: a Flax model as a ModelOpt NVFP4 Hugging Face checkpoint (`export_hf_checkpoint`).

The leaves are sorted and mapped to HF names (a stacked (E, in, out) experts kernel to E
linears, one per expert), each linear's precision decided (`exclude=`, the layers the model
computed in NVFP4, `rules=`) and checked with its fused group and its mixture-of-experts
block, the scales computed, and the tensors converted, quantized and written one module (one
expert) at a time into a temporary directory, moved into place when complete.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.array import is_nvfp4_array
from nvfp4_jax._src.core.ops import dequantize, quantize, tensor_amax
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.io.hf.common import (
    _KV_SUFFIXES,
    CONFIG_NAME,
    INDEX_NAME,
    LEGACY_PRODUCER,
    PRODUCER,
    QUANT_ALGOS,
    QUANT_CONFIG_NAME,
    REQUIRED_CONFIG_KEYS,
    WEIGHTS_NAME,
    _read_json,
    _write_json,
)
from nvfp4_jax._src.io.hf.names import (
    DEFAULT_EXCLUDE,
    DEFAULT_FUSED_GROUPS,
    NameMap,
    _as_name_map,
    _engine_ignores,
    _expert_block,
    _group_of,
)
from nvfp4_jax._src.io.hf.st_io import _ST_NAMES, _is_float, _Unit, _write_safetensors
from nvfp4_jax._src.io.storage import collective, fsync_path, is_key_array, key_name, to_host

_WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


# --- export: the leaves -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What `export_hf_checkpoint` wrote.

    Attributes:
      directory: the checkpoint directory.
      quant_algo: "NVFP4" or "W4A16_NVFP4".
      quantized: HF names of the linears written in NVFP4.
      excluded: the modules kept in high precision (config.json's `ignore`).
      files: the safetensors files, in order.
      total_size: bytes of tensor data in them.
      skipped: Flax paths of leaves that are not weights (rng state, `skip=` matches).
      followed: where the precision of each linear came from: "rules" (`rules=`), "model"
        (the layers of an nnx model or state: `nvfp4_jax.nnx.Linear`s and
        `nvfp4_jax.nnx.Experts` with a recipe in NVFP4, others in high precision) or ""
        (none: every linear not excluded is quantized).
      trained_high_precision: HF names of the linears kept in high precision because the
        model computed them so (a plain `nnx.Linear`, an `Experts` with recipe None, a rule
        with recipe None); for experts, one name per expert.
      group_high_precision: HF names of linears the model computed in NVFP4 but written in
        high precision because another member of their fused group (q/k/v, gate/up) or of
        their mixture-of-experts block (gate, up, down of all experts) was trained in high
        precision: engines load a fused group, and an MoE block, all quantized or all not.
    """

    directory: str
    quant_algo: str
    quantized: tuple[str, ...]
    excluded: tuple[str, ...]
    files: tuple[str, ...]
    total_size: int
    skipped: tuple[str, ...]
    followed: str = ""
    trained_high_precision: tuple[str, ...] = ()
    group_high_precision: tuple[str, ...] = ()


@dataclasses.dataclass
class _Leaves:
    weights: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_amax: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    input_scale: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    # Flax module paths holding the variables of an `nvfp4_jax.nnx.Linear`.
    nvfp4: set[str] = dataclasses.field(default_factory=set)


# The variables only an `nvfp4_jax.nnx.Linear` holds: they mark a layer that computes in NVFP4.
_NVFP4_VARIABLES = (nvfp4_nnx.InputAmax, nvfp4_nnx.InputScale, nvfp4_nnx.QuantizedKernel)


def _is_leaf(value) -> bool:
    return isinstance(value, nnx.Variable) or is_nvfp4_array(value)


def _collect_leaves(params, skip: Sequence[str]) -> _Leaves:
    """Sorts the leaves: weights, recorded input amaxes or scales, and what is skipped.

    Weights are the plain leaves of a pytree, or the `nnx.Param`s (and variables holding an
    `NVFP4Array`) of an nnx state; other nnx variables (rng streams, ...) and PRNG keys are
    not. A leaf named `input_amax` (or `input_scale`, as `load_hf_checkpoint` returns it)
    belongs to the module above it.
    """
    leaves = _Leaves()
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


def _sort_leaf(leaves: _Leaves, path, where, value, is_weight, skip) -> None:
    parent, _, last = path.rpartition("/")
    if any(re.fullmatch(pattern, path) for pattern in skip):
        leaves.skipped.append(path)
    elif last in ("input_amax", "input_scale"):
        getattr(leaves, last)[parent] = (where, value)
    elif not is_weight or last in _KV_SUFFIXES or is_key_array(value):
        leaves.skipped.append(path)
    elif path in leaves.weights:
        raise ValueError(
            f"export_hf_checkpoint: the leaves at {leaves.weights[path][0]} and {where} have "
            f"the same path {path!r}"
        )
    else:
        leaves.weights[path] = (where, value)


# --- export: the modules ------------------------------------------------------------------


@dataclasses.dataclass
class _Tensor:
    """A weight leaf and where it goes: Flax path, HF name, kind, and for linears the module.

    A stacked experts kernel (E, in, out) becomes E `_Tensor`s of kind "experts", one per
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


def _map_tensors(leaves: _Leaves, name_map: NameMap) -> list[_Tensor]:
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
            block = _expert_block(hf)
            found = [
                _Tensor(path, f"{where}[{e}]", name, kind, value, expert=e, block=block)
                for e, name in enumerate(names)
            ]
        else:
            found = [_Tensor(path, where, hf, kind, value)]
        for t in found:
            if t.hf in owners:
                raise ValueError(
                    f"export_hf_checkpoint: the leaves at {owners[t.hf]} and {t.where} both "
                    f"map to the HF tensor {t.hf!r}"
                )
            owners[t.hf] = t.where
        tensors.extend(found)
    return tensors


def _plan_modules(tensors, exclude, fused_groups, block_2d, decide=None) -> list[str]:
    """Marks excluded linears and fused groups; checks them; returns the `ignore` list.

    `decide(t)`, where given, tells whether the model computed the linear `t` in NVFP4 (None:
    it cannot tell); a linear it computed in high precision is kept so, with the whole fused
    group (and mixture-of-experts block) it belongs to. Routers are always kept in high
    precision and listed.
    """
    for t in tensors:
        if t.linear:
            t.group = _group_of(t.module, fused_groups)
        if t.kind == "router" and is_nvfp4_array(t.value):
            raise ValueError(
                f"export_hf_checkpoint: the router {t.module} ({t.where}) is an NVFP4Array; "
                "engines serve an MoE router in high precision only (vLLM reads it as an "
                "unquantized linear, SGLang builds it without quantization): pass its float "
                "kernel (e.g. nvfp4_jax.dequantize(q))"
            )
    if decide is not None:
        _follow_decisions(tensors, decide)
    ignore = _exclude(tensors, exclude)
    _check_groups(tensors)
    for t in tensors:
        if t.quantized:
            _check_quantizable(t, block_2d)
            names = [t.module, t.block] if t.block else [t.module]
            if any(_engine_ignores(name, sorted(ignore)) for name in names):
                raise ValueError(
                    f"export_hf_checkpoint: {t.module} is quantized, but an engine reading the "
                    f"ignore list {sorted(ignore)} would take it for excluded"
                )
    return sorted(ignore)


def _exclude(tensors, exclude) -> set[str]:
    """Marks the linears and embeddings `exclude` matches; returns every module excluded.

    An expert matches by its own module name or its block's (`model.layers.0.mlp.experts`);
    an excluded MoE block is listed once, by its block name, which is what engines match
    their fused MoE layer against. Routers are always excluded and listed.
    """
    ignore = set()
    for t in tensors:
        if t.kind == "router":
            t.excluded = True
            ignore.add(t.module)
        elif t.kind in ("linear", "embedding", "experts"):
            names = [t.module, t.block] if t.block else [t.module]
            if any(n == p or fnmatch.fnmatchcase(n, p) for n in names for p in exclude):
                t.excluded = True
            if t.excluded:
                ignore.add(t.block or t.module)
    return ignore


# --- export: the model's own decisions ---------------------------------------------------

# `four_over_six="model"`: quantize each kernel as the training recipe did.
FOLLOW_MODEL = "model"


def _experts_recipes(model: nnx.Module) -> dict[str, bool]:
    """`{Flax path: computes in NVFP4}` of every `nvfp4_jax.nnx.Experts` layer of `model`.

    An `Experts` layer holds an `input_amax` whether it has a recipe or not, and its recipe
    is no state: only the model itself tells.
    """
    return {
        "/".join(str(key) for key in path): node.recipe is not None
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nvfp4_nnx.Experts)
    }


def _model_four_over_six(model: nnx.Module) -> dict[str, tuple[str | None, int]]:
    """`{Flax path: (weight_four_over_six, four_over_six_e4m3_max)}` of the NVFP4 layers.

    Every `nvfp4_jax.nnx.Linear` and `Experts` of `model` with a recipe.
    """
    out = {}
    for path, node in nnx.iter_graph(model):
        recipe = getattr(node, "recipe", None)
        if isinstance(node, (nvfp4_nnx.Linear, nvfp4_nnx.Experts)) and recipe is not None:
            out["/".join(str(key) for key in path)] = (
                recipe.weight_four_over_six,
                recipe.four_over_six_e4m3_max,
            )
    return out


def _rules_four_over_six(rules, t: _Tensor) -> tuple[str | None, int] | None:
    """The weight Four Over Six `rules` (a QuantizeReport or Rules) give `t`'s layer, or None."""
    recipe = None
    decisions = getattr(rules, "layers", None)
    if isinstance(decisions, Mapping):
        recipe = getattr(decisions.get(t.flax_module), "recipe", None)
    else:
        for rule in rules:
            if re.search(rule.pattern, t.flax_module):
                recipe = rule.recipe
                break
    if recipe is None:
        return None
    return recipe.weight_four_over_six, recipe.four_over_six_e4m3_max


def _four_over_six_of(four_over_six, e4m3_max, model_fos, rules, tensors) -> Callable:
    """`fos(t)`: (mode, M) of a quantized kernel, the argument's or the training recipe's.

    With `four_over_six="model"`: `rules` first, else the model's layers, else plain NVFP4.
    The members of a fused group must agree: they share one amax and are one layer to engines.
    """
    if four_over_six != FOLLOW_MODEL:
        mode, m = formats.check_four_over_six(four_over_six, e4m3_max, "export_hf_checkpoint")
        return lambda t: (mode, m)

    def own(t: _Tensor) -> tuple[str | None, int]:
        found = _rules_four_over_six(rules, t) if rules is not None else None
        plain = (None, formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX)  # (M is ignored when plain)
        found = found or model_fos.get(t.flax_module) or plain
        return found if found[0] is not None else plain

    chosen = {t.module: own(t) for t in tensors if t.quantized}
    for members in _quantized_sets(tensors):
        kinds = {chosen[t.module] for t in members}
        if len(kinds) > 1:
            raise ValueError(
                f"export_hf_checkpoint: the fused group {[t.module for t in members]} was "
                f"trained with different weight Four Over Six settings {sorted(kinds, key=str)}; "
                "engines decode it as one layer: pass four_over_six= to choose one"
            )
    return lambda t: chosen[t.module]


def _held_by_model(leaves: _Leaves, experts: Mapping[str, bool]) -> Callable[[_Tensor], bool]:
    """`held(t)`: whether the model computed the linear `t` in NVFP4, as its layers say."""

    def held(t: _Tensor) -> bool:
        if t.kind != "experts":
            return t.flax_module in leaves.nvfp4
        if t.flax_module in experts:
            return experts[t.flax_module]
        if t.flax_module in leaves.nvfp4:
            raise ValueError(
                f"export_hf_checkpoint: {t.flax_module} holds an input_amax, as an "
                "nvfp4_jax.nnx.Experts layer does, but a state does not record whether the "
                "layer computed in NVFP4 or in high precision (recipe None): pass the model "
                "itself, or rules= (the QuantizeReport of nvfp4_jax.quantize_model, or its rules)"
            )
        return False  # a stacked kernel of some other module: computed in high precision

    return held


def _decider(rules, leaves: _Leaves, experts: Mapping[str, bool]) -> tuple[str, Callable | None]:
    """(where the linears' precisions come from, `decide(t)`), or ("", None): quantize all.

    `rules` (a `QuantizeReport`, or `Rule`s, duck-typed: hf may not import rules) decides;
    else the state itself: where it holds `nvfp4_jax.nnx.Linear` layers (or `Experts` with a
    recipe, `experts` as `_experts_recipes` gives), the linears it holds otherwise (plain
    `nnx.Linear`, `Experts` with recipe None) computed in high precision.
    """
    held = _held_by_model(leaves, experts)
    if rules is None:
        nvfp4 = any(experts.get(path, True) for path in leaves.nvfp4) or any(experts.values())
        return ("model", held) if nvfp4 else ("", None)
    decisions = getattr(rules, "layers", None)
    if isinstance(decisions, Mapping):  # a QuantizeReport: path -> LayerDecision
        return "rules", _report_decider(decisions, held)
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Iterable):
        rules = None
    else:
        rules = tuple(rules)
    if rules is None or not all(hasattr(r, "pattern") and hasattr(r, "recipe") for r in rules):
        raise TypeError(
            "export_hf_checkpoint: rules must be the QuantizeReport nvfp4_jax.quantize_model "
            "returned or a sequence of Rule (the ones it was given)"
        )

    def from_rules(t: _Tensor) -> bool:
        for rule in rules:  # first match wins, re.search on the module path (Rule.matches)
            if re.search(rule.pattern, t.flax_module):
                # quantize_model leaves a kernel it cannot quantize in high precision.
                return rule.recipe is not None and _quantizable(t)
        return held(t)  # no rule: the layer was left as it was

    return "rules", from_rules


def _report_decider(decisions: Mapping, held: Callable) -> Callable:
    def from_report(t: _Tensor) -> bool | None:
        if t.flax_module not in decisions:
            return None
        action = getattr(decisions[t.flax_module], "action", None)
        # "unmatched": the layer was left as it was; "skipped": it stayed high precision.
        return True if action == "nvfp4" else held(t) if action == "unmatched" else False

    return from_report


def _quantizable(t: _Tensor) -> bool:
    """Whether `quantize_model` turns a kernel into NVFP4: its (in, out) multiples of 16."""
    if is_nvfp4_array(t.value):
        return True
    shape = tuple(np.shape(t.value))
    rank = 3 if t.kind == "experts" else 2
    return len(shape) == rank and not any(n % formats.BLOCK_SIZE for n in shape[-2:])


def _follow_decisions(tensors, decide) -> None:
    """Keeps in high precision the linears the model computed so, and their groups.

    Their fused groups and MoE blocks go with them; a router computed in NVFP4 is refused.
    """
    linears = [t for t in tensors if t.linear]
    unknown = list(dict.fromkeys(t.flax_module for t in linears if decide(t) is None))
    if unknown:
        raise ValueError(
            f"export_hf_checkpoint: the QuantizeReport has no decision for {unknown}: pass "
            "the report quantize_model returned for this very model, or its rules"
        )
    _check_routers(tensors, decide)
    decided = {}
    for t in linears:
        if t.flax_module not in decided:
            decided[t.flax_module] = bool(decide(t))
        if not decided[t.flax_module]:
            t.excluded, t.why = True, "trained"
    for members in [*_groups_of(linears).values(), *_blocks_of(linears).values()]:
        if any(t.why == "trained" for t in members):
            for t in members:
                if not t.excluded:
                    t.excluded, t.why = True, "group"


def _check_routers(tensors, decide) -> None:
    for t in tensors:
        if t.kind == "router" and decide(t):
            raise ValueError(
                f"export_hf_checkpoint: the router {t.module} ({t.flax_module}) computed in "
                "NVFP4 (so say rules= or the model's layer), but engines serve an MoE router "
                "in high precision only: keep it in high precision, with a rule with "
                "recipe=None for it (nvfp4_jax.default_rules keeps 'gate' and 'router' so)"
            )


def _compact(modules: Sequence[str]) -> list[str]:
    """Module names, siblings and blocks folded: `['m.layers.{0-3}.mlp.{gate,up}_proj']`."""
    by_parent: dict[str, list[str]] = {}
    for module in modules:
        parent, _, child = module.rpartition(".")
        by_parent.setdefault(parent, []).append(child)
    blocks: dict[tuple[str, str], list[str]] = {}
    for parent, children in by_parent.items():
        tail = _braces(children)
        match = re.search(r"(?:^|\.)(\d+)(?=\.|$)", parent)
        if match is None:
            blocks.setdefault((parent, tail), [])
            continue
        template = parent[: match.start(1)] + "{#}" + parent[match.end(1) :]
        blocks.setdefault((template, tail), []).append(match.group(1))
    out = []
    for (template, tail), numbers in blocks.items():
        parent = template.replace("{#}", _numbers(numbers)) if numbers else template
        out.append(f"{parent}.{tail}" if parent else tail)
    return out


def _braces(items: Sequence[str]) -> str:
    """`["q_proj", "k_proj"]` -> "{q,k}_proj"; one item as it is."""
    if len(items) == 1:
        return items[0]
    prefix = os.path.commonprefix(list(items))
    suffix = os.path.commonprefix([i[len(prefix) :][::-1] for i in items])[::-1]
    middles = [i[len(prefix) : len(i) - len(suffix)] for i in items]
    if not all(middles):
        prefix, suffix, middles = "", "", list(items)
    return f"{prefix}{{{','.join(middles)}}}{suffix}"


def _numbers(numbers: Sequence[str]) -> str:
    """`["0", "1", "2", "5"]` -> "{0-2,5}"; one number as it is."""
    if len(numbers) == 1:
        return numbers[0]
    values = sorted(int(n) for n in numbers)
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs]
    return "{" + ",".join(parts) + "}"


def _groups_of(tensors) -> dict[tuple[str, int], list[_Tensor]]:
    groups: dict[tuple[str, int], list[_Tensor]] = {}
    for t in tensors:
        if t.group is not None:
            groups.setdefault(t.group, []).append(t)
    return groups


def _blocks_of(tensors) -> dict[str, list[_Tensor]]:
    """The experts of every MoE block (all projections, all experts), by block name."""
    blocks: dict[str, list[_Tensor]] = {}
    for t in tensors:
        if t.block:
            blocks.setdefault(t.block, []).append(t)
    return blocks


def _check_groups(tensors) -> None:
    for members in _groups_of(tensors).values():
        excluded = [t.module for t in members if t.excluded]
        if excluded and len(excluded) != len(members):
            kept = [t.module for t in members if not t.excluded]
            raise ValueError(
                f"export_hf_checkpoint: the fused group {[t.module for t in members]} is half "
                f"excluded ({excluded} excluded, {kept} not); engines fuse it into one "
                "layer, so exclude it whole or not at all"
            )
    for block, members in _blocks_of(tensors).items():
        excluded = [t.module for t in members if t.excluded]
        if excluded and len(excluded) != len(members):
            kept = [t.module for t in members if not t.excluded]
            raise ValueError(
                f"export_hf_checkpoint: the experts of {block} are half excluded "
                f"({_compact(excluded)} excluded, {_compact(kept)} not); engines build one "
                f"fused MoE layer of them, so exclude the block whole (exclude=[{block!r}]) "
                "or not at all"
            )


def _check_quantizable(t: _Tensor, block_2d: bool) -> None:
    value = t.value
    stacked = t.expert is not None
    if is_nvfp4_array(value):
        rank = 3 if stacked else 2
        amax_ok = tuple(value.amax.shape) == (tuple(value.shape[:1]) if stacked else ())
        if len(value.shape) != rank or value.axis != -2 or value.rht or not amax_ok:
            what = "an (E, in, out) stack of" if stacked else "a 2-D"
            raise ValueError(
                f"export_hf_checkpoint: {t.where} is an NVFP4Array {value!r}; engines need "
                f"{what} kernel quantized along in (axis=0{', under vmap' if stacked else ''}) "
                "without the RHT" + (", one amax per expert" if stacked else "")
            )
        return
    shape, dtype = t.shape, jnp.dtype(getattr(value, "dtype", np.float32))
    rows_ok = not block_2d or (len(shape) == 2 and shape[1] % formats.BLOCK_SIZE == 0)
    if len(shape) != 2 or shape[0] % formats.BLOCK_SIZE or not rows_ok:
        hint = ""
        if len(shape) == 3:
            hint = (
                " (a stacked (E, in, out) experts kernel needs a name map with an experts "
                "rule: nvfp4_jax.hf.qwen3_moe_name_map() or mixtral_name_map())"
            )
        raise ValueError(
            f"export_hf_checkpoint: the linear {t.module} ({t.where}) has kernel shape {shape}; "
            "NVFP4 needs a 2-D (in, out) kernel with in a multiple of 16 (and out too with "
            f"block_2d); add it to exclude= to keep it in high precision{hint}"
        )
    if dtype not in formats.SUPPORTED_DTYPES:
        raise TypeError(f"export_hf_checkpoint: the kernel of {t.module} has dtype {dtype}")


# --- export: the scales ---------------------------------------------------------------------


def _input_scales(tensors, leaves: _Leaves, input_amax) -> dict[str, np.float32]:
    """The `input_scale` of every quantized linear (W4A4); members of a set share the max.

    Sources: `input_scale` leaves (written as they are: a layer built from a checkpoint keeps
    its scale bit for bit), else `input_amax` leaves (times f32(1/2688)); the `input_amax`
    argument wins over both. Excluded linears' are ignored. A stacked experts layer's source
    is a scalar or one value per expert, (E,) (`nvfp4_jax.nnx.Experts.input_amax`, the
    `input_scale` `load_hf_checkpoint` gives); `input_amax=` may also name one expert by its
    HF module name. The sets (`_scale_sets`): each fused group; each projection kind of an
    MoE block over all its experts (gate and up together, M4); each other linear alone.
    """
    plain = [t for t in tensors if t.kind in ("linear", "router")]
    by_name = {t.module: t.module for t in plain} | {t.flax_module: t.module for t in plain}
    stacks: dict[str, list[_Tensor]] = {}
    for t in tensors:
        if t.kind == "experts":
            stacks.setdefault(t.flax_module, []).append(t)
            by_name[t.module] = t.module
    quantized = {t.module for t in tensors if t.quantized}
    found: dict[str, tuple[str, Any, str]] = {}
    for kind, values in (("input_scale", leaves.input_scale), ("input_amax", leaves.input_amax)):
        for path, (where, value) in values.items():
            module = path if path in stacks else _module_for(by_name, path, where)
            found.setdefault(module, (kind, value, where))  # an input_scale leaf comes first
    for key, amax in (input_amax or {}).items():
        module = key if key in stacks else _module_for(by_name, key, f"input_amax[{key!r}]")
        found[module] = ("input_amax", amax, f"input_amax[{key!r}]")
    scales = {}
    for path, members in stacks.items():
        if path in found:
            per_expert = _to_expert_scales(*found[path], len(members))
            scales.update({t.module: per_expert[t.expert] for t in members})
    for module, (kind, value, where) in found.items():
        if module in quantized:
            scales[module] = _to_input_scale(value, kind, where)
    return _share_in_groups(tensors, {m: v for m, v in scales.items() if m in quantized})


def _module_for(by_name: dict, key: str, where: str) -> str:
    if key not in by_name:
        raise ValueError(
            f"export_hf_checkpoint: {where} names {key!r}, which is no linear of the model "
            "(give a Flax module path such as 'layers/0/self_attn/q_proj' or "
            "'layers/0/mlp/experts/up_proj', or an HF module name)"
        )
    return by_name[key]


def _to_expert_scales(kind: str, value, where, experts: int) -> np.ndarray:
    """(E,) f32 input scales of a stacked layer from a scalar or (E,) amax or scale."""
    value = to_host(value).astype(np.float32)
    if value.size == 1:
        value = np.full((experts,), value.reshape(()), np.float32)
    if value.shape != (experts,):
        raise ValueError(
            f"export_hf_checkpoint: {kind} of {where} must be a scalar or one value per "
            f"expert, shape ({experts},), got {value.shape}"
        )
    return value * formats.RCP2688 if kind == "input_amax" else value


def _to_input_scale(value, kind: str, where) -> np.float32:
    """`f32(amax) * f32(1/2688)` for an amax; an `input_scale` as it is (checked later)."""
    value = to_host(value).astype(np.float32)
    if value.size != 1:
        raise ValueError(
            f"export_hf_checkpoint: {kind} of {where} must be a scalar, got {value.shape}"
        )
    scale = value.reshape(()) * formats.RCP2688 if kind == "input_amax" else value.reshape(())
    return np.float32(scale)


def _share_in_groups(tensors, scales: dict) -> dict[str, np.float32]:
    """Each set's max scale for all its members; one error naming every module lacking one.

    A scale must be positive and finite; an expert's may be 0 (an expert calibration sent no
    token to) as long as its set's maximum is positive, since that maximum is what engines
    quantize every expert's activations with.
    """
    sets = _scale_sets(tensors)
    order = [t.module for t in tensors if t.quantized]
    missing = [m for m in order if m not in scales]
    experts = {t.module for t in tensors if t.quantized and t.expert is not None}
    bad = [
        m
        for m in order
        if m in scales
        and not (np.isfinite(scales[m]) and (scales[m] >= 0 if m in experts else scales[m] > 0))
    ]
    for members in sets:  # experts: the set's maximum must be positive
        values = [scales.get(t.module) for t in members]
        if members[0].expert is not None and None not in values and np.all(np.isfinite(values)):
            if max(values) == 0:
                bad.extend(t.module for t in members)
    if missing or bad:
        problems = [f"no input amax for {_compact(missing)}"] if missing else []
        if bad:
            values = sorted({float(scales[m]) * 2688 for m in bad})
            problems.append(
                f"an input amax of {values[:3]} (not positive and finite; 0: never calibrated) "
                f"for {_compact(bad)}"
            )
        raise ValueError(
            f"export_hf_checkpoint: {'; and '.join(problems)}. W4A4 (quant_algo='NVFP4') needs "
            "a positive, finite activation amax on every quantized linear (engines produce "
            "NaN without it): run nvfp4_jax.nnx.calibrate(model), a few batches through the "
            "model and nvfp4_jax.nnx.calibrate(model, False) before exporting, or pass "
            "input_amax={module: amax}, or export quant_algo='W4A16_NVFP4' (weight-only)"
        )
    out = {}
    for members in sets:
        out.update({t.module: max(scales[t.module] for t in members) for t in members})
    return out


def _scale_sets(tensors) -> list[list[_Tensor]]:
    """Quantized linears in sets that share their input scale.

    Each fused group; for the experts of an MoE block, one set per fused group (gate and up)
    or projection (down) over all experts (M4: one input quantizer per projection kind); each
    other linear alone.
    """
    sets: dict[tuple, list[_Tensor]] = {}
    for t in tensors:
        if not t.quantized:
            continue
        if t.block:
            kind = t.group[1] if t.group is not None else t.module.rpartition(".")[2]
            key: tuple = ("experts", t.block, kind)
        else:
            key = ("group", t.group) if t.group is not None else ("alone", t.module)
        sets.setdefault(key, []).append(t)
    return list(sets.values())


def _quantized_sets(tensors) -> list[list[_Tensor]]:
    """Quantized linears in sets that share their scales: each fused group, each other one."""
    groups = _groups_of([t for t in tensors if t.quantized])
    alone = [[t] for t in tensors if t.quantized and t.group is None]
    return list(groups.values()) + alone


def _weight_amaxes(tensors, implementation) -> dict[str, np.float32 | None]:
    """The amax each float kernel is quantized with: its group's max (None: already NVFP4)."""
    out = {}
    for members in _quantized_sets(tensors):
        kinds = {is_nvfp4_array(t.value) for t in members}
        if kinds == {True}:
            _check_equal_scales(members)
            out.update({t.module: None for t in members})
            continue
        if len(kinds) > 1:
            raise ValueError(
                f"export_hf_checkpoint: the fused group {[t.module for t in members]} mixes "
                "NVFP4Arrays and float kernels; pass all of them in one form"
            )
        amax = max(_kernel_amax(t, implementation) for t in members)
        out.update({t.module: amax for t in members})
    return out


def _kernel_amax(t: _Tensor, implementation) -> np.float32:
    amax = np.float32(to_host(tensor_amax(t.kernel, axis=0, implementation=implementation)))
    if not np.isfinite(amax):
        raise ValueError(
            f"export_hf_checkpoint: the kernel of {t.module} ({t.where}) holds NaN or inf"
        )
    return amax


def _decode_scale(t: _Tensor) -> np.float32:
    """The decode scale D of an NVFP4 kernel (of one expert's, without slicing the codes)."""
    scale = t.value.global_scale
    return np.float32(to_host(scale if t.expert is None else scale[t.expert]))


def _check_equal_scales(members) -> None:
    scales = {_decode_scale(t).tobytes() for t in members}
    if len(scales) > 1:
        raise ValueError(
            f"export_hf_checkpoint: the fused group {[t.module for t in members]} holds "
            "NVFP4Arrays with different decode scales; engines decode the fused layer with one "
            "(the max), so quantize the members with the group's max amax"
        )


# --- export: the units --------------------------------------------------------------------


def _quantized_unit(t: _Tensor, amax, input_scale, flags: dict, implementation) -> _Unit:
    """The unit of a quantized linear; `flags`: `quantize`'s block_2d and 4/6 arguments."""
    rows, cols = t.shape[::-1]  # the stored (out, in) of an (in, out) kernel
    specs = [
        (f"{t.module}.weight", "U8", (rows, cols // 2)),
        (f"{t.module}.weight_scale", "F8_E4M3", (rows, cols // formats.BLOCK_SIZE)),
        (f"{t.module}.weight_scale_2", "F32", ()),
    ]
    if input_scale is not None:
        specs.append((f"{t.module}.input_scale", "F32", ()))

    def produce() -> dict[str, np.ndarray]:
        q = t.kernel
        if amax is not None:
            q = quantize(q, axis=0, amax=jnp.float32(amax), implementation=implementation, **flags)
        arrays = [q.codes, q.scales, np.float32(to_host(q.global_scale)), input_scale]
        return {name: to_host(a) for (name, _, _), a in zip(specs, arrays, strict=False)}

    return _Unit(tuple(specs), produce)


def _dense_unit(t: _Tensor, dtype) -> _Unit:
    transposed = t.kind in ("linear", "experts", "router")
    if is_nvfp4_array(t.value) and not t.linear:
        raise TypeError(f"export_hf_checkpoint: {t.where} is an NVFP4Array but no linear kernel")
    shape = t.shape
    if transposed:
        if len(shape) != 2:
            raise ValueError(f"export_hf_checkpoint: the kernel at {t.where} is not 2-D: {shape}")
        shape = shape[::-1]
    source = np.dtype(t.value.dtype)
    target = np.dtype(dtype) if dtype is not None and _is_float(source) else source
    if target not in _ST_NAMES:
        raise TypeError(
            f"export_hf_checkpoint: {t.where} has dtype {target}, which safetensors lacks"
        )

    def produce() -> dict[str, np.ndarray]:
        kernel = t.kernel
        value = dequantize(kernel, jnp.float32) if is_nvfp4_array(kernel) else kernel
        array = to_host(value).astype(target, copy=False)
        return {t.hf: array.T if transposed else array}

    return _Unit(((t.hf, _ST_NAMES[target], shape),), produce)


def _units(tensors, amaxes, input_scales, flags_of, dtype, implementation) -> list[_Unit]:
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


# --- export: the configs ------------------------------------------------------------------


def _quantization_config(quant_algo: str, ignore: list[str]) -> dict:
    """config.json's `quantization_config`, in the form ModelOpt >= 0.31 writes."""
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
    }


def _legacy_quant_config(quant_algo: str, ignore: list[str]) -> dict:
    """ModelOpt's legacy `hf_quant_config.json` (read by TensorRT-LLM, older engines)."""
    return {
        "producer": dict(LEGACY_PRODUCER),
        "quantization": {
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": None,
            "group_size": formats.BLOCK_SIZE,
            "exclude_modules": list(ignore),
        },
    }


def _model_config(config, directory: str) -> dict:
    """The caller's model config, or the one in `directory`, checked for what engines need."""
    path = os.path.join(directory, CONFIG_NAME)
    if config is None and os.path.isfile(path):
        config = _read_json(path)
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
    return {k: v for k, v in config.items() if k != "quantization_config"}


def _check_config_against(config: dict, tensors, dtype) -> dict:
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


def _check_tokenizer(tokenizer, config: dict) -> None:
    if tokenizer not in (None, "bytes"):
        raise ValueError(
            f"export_hf_checkpoint: tokenizer must be None or 'bytes', got {tokenizer!r} (for "
            "another tokenizer, save_pretrained it into the folder: the export keeps it)"
        )
    vocab = config.get("vocab_size")
    if tokenizer == "bytes" and not (isinstance(vocab, int) and vocab >= 256):
        raise ValueError(
            f"export_hf_checkpoint: tokenizer='bytes' needs vocab_size >= 256 (token i is "
            f"byte i), the config says {vocab}"
        )


def _byte_tokenizer(config: dict) -> dict[str, dict]:
    """A byte-level tokenizer (token i is byte i, no merges, no special tokens) as HF files.

    `tokenizer.json` is a `tokenizers` BPE over GPT-2's byte-to-character table with the
    ByteLevel pre-tokenizer and decoder and no merges, so encoding UTF-8 text gives its bytes
    and decoding bytes gives the text: what `transformers.AutoTokenizer` (and so vLLM, SGLang)
    loads for a model trained on raw bytes.
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    byte_level["use_regex"] = False
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None}
    model |= {"end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False}
    model |= {"ignore_merges": False, "vocab": {chars[b]: b for b in range(256)}, "merges": []}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": []}
    tokenizer |= {"normalizer": None, "pre_tokenizer": byte_level, "post_processor": None}
    tokenizer |= {"decoder": dict(byte_level), "model": model}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    settings |= {"add_bos_token": False, "add_eos_token": False}
    if isinstance(config.get("max_position_embeddings"), int):
        settings["model_max_length"] = config["max_position_embeddings"]
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": settings}


# --- export: the directory ----------------------------------------------------------------


def _parse_size(size) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if match and match.group(2).upper() in _SIZE_UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    raise ValueError(
        f"export_hf_checkpoint: max_shard_size must be bytes or e.g. '5GB', got {size!r}"
    )


def _shards(units: list[_Unit], max_size: int) -> list[list[_Unit]]:
    shards: list[list[_Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes
    return shards


def _write_weights(tmp: str, units: list[_Unit], max_size: int) -> tuple[list[str], int]:
    shards = _shards(units, max_size)
    n = len(shards)
    names = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(os.path.join(tmp, name), shard, {"format": "pt"})
        weight_map.update({spec[0]: name for unit in shard for spec in unit.specs})
    total = sum(unit.nbytes for unit in units)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(os.path.join(tmp, INDEX_NAME), index)
    return names, total


def _check_target(directory: str, force: bool) -> None:
    """A folder holding weights needs `force`; one holding configs and a tokenizer does not."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"export_hf_checkpoint: {directory} exists and is not a directory")
    if not os.path.isdir(directory) or force:
        return
    weights = sorted(n for n in os.listdir(directory) if _replaced(n))
    if weights:
        raise FileExistsError(
            f"export_hf_checkpoint: {directory} is not empty: it holds weights {weights} "
            "(force=True replaces them; its other files, e.g. the tokenizer, are kept)"
        )


def _replaced(name: str) -> bool:
    """Whether an export replaces the file `name` as weights (config.json is merged, not)."""
    return name == QUANT_CONFIG_NAME or name.endswith(_WEIGHT_FILES)


def _carry_over(old: str, new: str) -> None:
    """Copies what `old` holds besides weights and the configs we write (tokenizer, ...)."""
    if not os.path.isdir(old):
        return
    for name in os.listdir(old):
        source, target = os.path.join(old, name), os.path.join(new, name)
        if name == CONFIG_NAME or _replaced(name) or os.path.lexists(target):
            continue  # (what the export wrote itself, e.g. tokenizer="bytes", wins)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True)
        else:
            shutil.copy2(source, target, follow_symlinks=False)


def _move_into_place(tmp: str, directory: str) -> None:
    """Renames the finished `tmp` to `directory`, replacing what was there."""
    parent = os.path.dirname(directory)
    if not os.path.lexists(directory) or not os.listdir(directory):
        os.replace(tmp, directory)  # atomic; replaces an empty directory
    else:
        old = os.path.join(parent, f".{os.path.basename(directory)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(directory, old)
        try:
            os.rename(tmp, directory)
        except BaseException:
            os.rename(old, directory)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(parent)


def _write_directory(directory: str, write: Callable[[str], Any]):
    """Runs `write(tmp)` in a temporary sibling of `directory`, then moves it into place."""
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)  # (not mkdtemp: the checkpoint keeps the umask's permissions)
    try:
        result = write(tmp)
        _carry_over(directory, tmp)
        fsync_path(tmp)
        _move_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _write_once(directory: str, write: Callable[[str], Any], units: list[_Unit]):
    """`_write_directory(directory, write)`, once, in a program of one or several processes.

    With several processes (all calling `export_hf_checkpoint` alike), process 0 writes; the
    others produce every unit in the same order, which takes part in the gathers of sharded
    arrays (collectives). If process 0 fails, it still produces the units it did not reach,
    so the gathers stay in step, and then every process raises its error.
    """
    if jax.process_count() == 1:
        return _write_directory(directory, write)
    produced = [0]
    counted = [_Unit(u.specs, _counting(u.produce, produced)) for u in units]
    done = None
    if jax.process_index() == 0:
        try:
            done = _write_directory(directory, lambda tmp: write(tmp, counted))
        except Exception as error:  # noqa: BLE001  (raised on every process below)
            done = error
    for unit in counted[produced[0] :]:
        unit.produce()
    if isinstance(done, Exception):
        failed = done

        def fail():
            raise failed

        collective(_EXPORT, "writing the checkpoint", fail, primary=True)
    files = collective(_EXPORT, "writing the checkpoint", lambda: done, primary=True)
    return files


def _counting(produce: Callable, produced: list) -> Callable:
    def counted():
        produced[0] += 1
        return produce()

    return counted


_EXPORT = "export_hf_checkpoint"


# --- export -------------------------------------------------------------------------------


def export_hf_checkpoint(
    directory: str | os.PathLike,
    params: Any,
    *,
    name_map: NameMap | Sequence | None = None,
    quant_algo: str = "NVFP4",
    input_amax: Mapping[str, Any] | None = None,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    config: Mapping[str, Any] | None = None,
    fused_groups: Sequence[Sequence[str]] = DEFAULT_FUSED_GROUPS,
    block_2d: bool = True,
    four_over_six: str | None = "model",
    four_over_six_e4m3_max: int = formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
    dtype=jnp.bfloat16,
    max_shard_size: int | str = "5GB",
    skip: Sequence[str] = (),
    force: bool = False,
    implementation: str | None = None,
    rules: Any = None,
    tokenizer: str | None = None,
) -> ExportReport:
    """Writes a Flax model as a ModelOpt NVFP4 Hugging Face checkpoint that engines load.

    Every linear (a `kernel` (in, out) the name map calls "linear") not excluded is quantized
    along `in` (`quantize(kernel, axis=0, block_2d=block_2d, amax=group amax)`) and written as
    `.weight` U8 (out, in/2), `.weight_scale` F8_E4M3 (out, in/16), `.weight_scale_2` F32 ()
    and, for W4A4, `.input_scale` F32 () (`f32(input_amax) * f32(1/2688)`). Members of a fused
    group (same parent module, names in one group of `fused_groups`) use the group's max
    weight amax and max input scale, so their scales are equal, as engines need. A kernel
    that already is an `NVFP4Array` (from `load_hf_checkpoint`, or quantized along axis 0) is
    written as it is, with its decode scale. Everything else is written in `dtype` under its
    HF name; excluded linears as `.weight` (out, in).

    Mixture-of-experts blocks (a name map with "experts" and "router" rules:
    `qwen3_moe_name_map()`, `mixtral_name_map()`) are written as ModelOpt writes them
    (docs/SERVING_FORMATS.md section 5). A stacked kernel (E, in, out) becomes E linears, one
    per expert (`...experts.{e}.gate_proj`), each quantized as a tensor of its own with its
    own weight amax (M1, M3); gate and up of one expert (a fused group: `gate_proj`/`up_proj`,
    Mixtral's `w1`/`w3`) with the larger of their two amaxes (M2). An `NVFP4Array` stack (E,
    in, out) with one amax per expert (`load_hf_checkpoint`'s) is written as it is. W4A4
    writes one `input_scale` per layer and projection kind on every expert: the max over all
    experts of gate and up together, and of down (M4); its source is a scalar or (E,) amax
    per stacked layer (`nvfp4_jax.nnx.Experts.input_amax`, `input_amax=`), where an expert
    may have 0 (no calibration token) if the layer's max is positive. The router stays in
    high precision, `.weight` (E, hidden) in `dtype`, and is listed in `ignore` (M5); an
    `NVFP4Array` router, or one the model computed in NVFP4, is an error. An MoE block is
    quantized whole or kept whole in high precision (listed in `ignore` by its block name,
    e.g. `model.layers.0.mlp.experts`). `config` must hold the expert count
    (`num_experts` or `num_local_experts`), `num_experts_per_tok` and one expert's MLP size
    (`moe_intermediate_size`, Qwen3-MoE; `intermediate_size`, Mixtral), checked against
    the kernels.

    The exporter follows the precision the model was trained in: given the model (or its
    `nnx.state`) holding `nvfp4_jax.nnx.Linear` layers, every other linear (a plain
    `nnx.Linear`, e.g. kept in bf16 by `quantize_model`'s rules) is written in high precision
    and listed in `ignore`; `rules=` (the `QuantizeReport` `quantize_model` returned, or its
    rules) decides instead. An `nvfp4_jax.nnx.Experts` layer follows its recipe (None: high
    precision), which only the model itself records: give the model, not its state, or
    `rules=`. A fused group or MoE block partly trained in high precision is written whole
    in high precision (the safe choice; engines need a group all quantized or all not), and
    reported in `ExportReport.group_high_precision`. A model with no NVFP4 layer (trained in
    bf16), and a plain pytree, are quantized whole (post-training).

    The directory is written into a temporary sibling and moved into place when complete.
    Tensors are converted, quantized and written one module at a time, so host memory stays
    at about one layer.

    Args:
      directory: the checkpoint directory to create (or, with `force`, replace).
      params: the weights: the nnx model itself, the whole `nnx.state(model)` (only
        `nnx.Param`s are weights; a variable named `input_amax` on a linear is its recorded
        activation amax; rng state is skipped), or a pytree of arrays (Flax params,
        `nnx.to_pure_dict`).
      name_map: a `NameMap` or a list of rules; default `llama_name_map()`.
      quant_algo: "NVFP4" (W4A4: weights and activations in NVFP4; needs input amaxes) or
        "W4A16_NVFP4" (weight-only: what Hopper and Ampere serve, through Marlin).
      input_amax: `{Flax module path or HF module name: activation amax}`, overriding what
        `params` holds (`input_amax` or `input_scale` leaves). A stacked experts layer takes
        a scalar or one amax per expert, (E,), by its Flax path
        (`layers/0/mlp/experts/up_proj`), or one expert's by its HF module name. W4A4 only.
      exclude: fnmatch patterns on HF module names kept in high precision and listed in
        `ignore`; a fused group is excluded whole or not at all.
      config: the model's HF config (a dict: architectures, hidden_size, num_attention_heads,
        num_key_value_heads, ...); default: the `config.json` already in `directory`. Its
        `quantization_config` is replaced.
      fused_groups: names of sibling linears engines fuse into one layer.
      block_2d: quantize weights in 16x16 blocks (the training recipe's; the forward pass of a
        model trained with `NVFP4Recipe()` sees these values), else 1x16.
      four_over_six: how the float kernels are quantized: "model" (the default) as the
        training recipe quantized each layer's weight in the forward pass (its
        `weight_four_over_six` and `four_over_six_e4m3_max`, from `rules=` or else from the
        model's `nvfp4_jax.nnx` layers; plain NVFP4 for a state, a pytree or a model trained
        in high precision); None: plain NVFP4; "mae" or "mse": Four Over Six (docs/NUMERICS.md
        section 13) for every kernel, with the global scale's E4M3 maximum
        `four_over_six_e4m3_max` (256 or 448). The files are plain NVFP4 either way
        (`weight_scale_2` is the 4/6 decode scale `amax / (6M)`); engines load them
        unchanged. A fused group shares its amax, hence its decode scale, and must share
        its setting. `NVFP4Array` kernels are written as they are.
      four_over_six_e4m3_max: M for `four_over_six="mae"` or `"mse"`: 256 (the default) or
        448.
      dtype: the dtype of every float tensor not quantized (None keeps each leaf's).
      max_shard_size: bytes (or "5GB", "500MiB") per safetensors file; above it the weights
        are split into `model-0000N-of-0000M.safetensors` with an index.
      skip: regexes of Flax paths to leave out (fullmatch).
      force: replace the weights of a directory that holds some (`*.safetensors`, an index,
        `hf_quant_config.json`, `*.bin`). Not needed for a directory holding only a config
        and tokenizer files (what `save_pretrained` leaves); its files besides weights and
        configs are kept either way, and its `config.json` is the default `config`.
      implementation: as in `quantize`.
      rules: which linears were trained in NVFP4: the `QuantizeReport` of
        `nvfp4_jax.quantize_model` (action "nvfp4": NVFP4; "high_precision", "skipped":
        high precision; "unmatched": as the model holds it), or the `Rule`s it was given
        (first match by module path, e.g. `layers/0/mlp/up_proj`; recipe None: high
        precision; no match: as the model holds it). Default: what `params` holds.
      tokenizer: None (write none; tokenizer files already in the folder are kept) or
        "bytes": write `tokenizer.json` and `tokenizer_config.json` of a byte-level tokenizer
        (token i is byte i, as in examples/lm_model.py), so that engines take text prompts.

    Returns:
      An `ExportReport`.

    Raises:
      ValueError: a leaf no rule maps, two leaves on one HF name, missing input amaxes for
        W4A4 (all named in one message) or ones that are NaN, infinite or negative, a fused
        group or MoE block half excluded by `exclude=`, a kernel that cannot be quantized and
        is not excluded, an experts kernel that is not (E, in, out), a router in NVFP4, a
        model config lacking what engines need (MoE keys included) or disagreeing with the
        kernels, a `QuantizeReport` without a decision for a linear, an nnx state holding
        `Experts` layers without the model or `rules=`.
      TypeError: `rules` is neither a QuantizeReport nor a sequence of Rules.
      FileExistsError: `directory` holds weights and `force` is False.
    """
    if quant_algo not in QUANT_ALGOS:
        raise ValueError(
            f"export_hf_checkpoint: quant_algo must be one of {QUANT_ALGOS}, got {quant_algo!r}"
        )
    if input_amax and quant_algo != "NVFP4":
        raise ValueError("export_hf_checkpoint: input_amax is for quant_algo='NVFP4' (W4A4) only")
    block_2d = formats.check_flag(block_2d, "export_hf_checkpoint", "block_2d")
    if four_over_six != FOLLOW_MODEL:
        formats.check_four_over_six(four_over_six, four_over_six_e4m3_max, "export_hf_checkpoint")
    directory = os.path.abspath(os.fspath(directory))
    max_size = _parse_size(max_shard_size)
    collective(
        _EXPORT, "checking the directory", lambda: _check_target(directory, force), primary=True
    )
    model_config = _model_config(config, directory)
    _check_tokenizer(tokenizer, model_config)
    experts, model_fos = {}, {}
    if isinstance(params, nnx.Module):
        experts = _experts_recipes(params)
        model_fos = _model_four_over_six(params)
        params = nnx.state(params)
    leaves = _collect_leaves(params, tuple(skip))
    tensors = _map_tensors(leaves, _as_name_map(name_map))
    if not tensors:
        raise ValueError("export_hf_checkpoint: params hold no weights")
    followed, decide = _decider(rules, leaves, experts)
    groups = tuple(map(tuple, fused_groups))
    ignore = _plan_modules(tensors, tuple(exclude), groups, block_2d, decide)
    model_config = _check_config_against(model_config, tensors, dtype)
    scales = _input_scales(tensors, leaves, input_amax) if quant_algo == "NVFP4" else {}
    amaxes = _weight_amaxes(tensors, implementation)
    fos = _four_over_six_of(four_over_six, four_over_six_e4m3_max, model_fos, rules, tensors)

    def flags_of(t: _Tensor) -> dict:
        mode, e4m3_max = fos(t)
        return dict(block_2d=block_2d, four_over_six=mode, four_over_six_e4m3_max=e4m3_max)

    units = _units(tensors, amaxes, scales, flags_of, dtype, implementation)
    model_config["quantization_config"] = _quantization_config(quant_algo, ignore)

    def write(tmp: str, units: list[_Unit] = units):
        files, total = _write_weights(tmp, units, max_size)
        _write_json(os.path.join(tmp, CONFIG_NAME), model_config)
        _write_json(os.path.join(tmp, QUANT_CONFIG_NAME), _legacy_quant_config(quant_algo, ignore))
        if tokenizer == "bytes":
            for name, content in _byte_tokenizer(model_config).items():
                _write_json(os.path.join(tmp, name), content)
        return files, total

    files, total = _write_once(directory, write, units)
    quantized = tuple(t.module for t in tensors if t.quantized)
    return ExportReport(
        directory,
        quant_algo,
        quantized,
        tuple(ignore),
        tuple(files),
        total,
        tuple(leaves.skipped),
        followed,
        tuple(t.module for t in tensors if t.why == "trained"),
        tuple(t.module for t in tensors if t.why == "group"),
    )
