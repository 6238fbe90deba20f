"""Export: which linears are quantized and which kept in high precision, checked.

`plan_modules` marks each linear: excluded (`exclude=`, routers always), kept because the
model computed it in high precision (a `decide` function, see `precision`), and
checks that engines can load the result: a fused group (q/k/v, gate/up) and a
mixture-of-experts block are quantized whole or kept whole, every quantized kernel can be
quantized, and no quantized module looks excluded to an engine reading the `ignore` list.
It also holds the groupings the scales share (`groups_of`, `blocks_of`, `quantized_sets`)
and `compact`, which folds module names for messages.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.array import is_nvfp4_array, validate_nvfp4_array
from nvfp4_jax._src.io.hf.export.tensors import Tensor
from nvfp4_jax._src.io.hf.names import engine_ignores, group_of


def plan_modules(tensors, exclude, fused_groups, block_2d, decide=None) -> list[str]:
    """Marks excluded linears and fused groups; checks them; returns the `ignore` list.

    `decide(t)`, where given, tells whether the model computed the linear `t` in NVFP4 (None:
    it cannot tell); a linear it computed in high precision is kept so, with the whole fused
    group (and mixture-of-experts block) it belongs to. Routers are always kept in high
    precision and listed.
    """
    for t in tensors:
        if t.linear:
            t.group = group_of(t.module, fused_groups)
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
            if any(engine_ignores(name, sorted(ignore)) for name in names):
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
    for members in [*groups_of(linears).values(), *blocks_of(linears).values()]:
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


def _check_groups(tensors) -> None:
    for members in groups_of(tensors).values():
        excluded = [t.module for t in members if t.excluded]
        if excluded and len(excluded) != len(members):
            kept = [t.module for t in members if not t.excluded]
            raise ValueError(
                f"export_hf_checkpoint: the fused group {[t.module for t in members]} is half "
                f"excluded ({excluded} excluded, {kept} not); engines fuse it into one "
                "layer, so exclude it whole or not at all"
            )
    for block, members in blocks_of(tensors).items():
        excluded = [t.module for t in members if t.excluded]
        if excluded and len(excluded) != len(members):
            kept = [t.module for t in members if not t.excluded]
            raise ValueError(
                f"export_hf_checkpoint: the experts of {block} are half excluded "
                f"({compact(excluded)} excluded, {compact(kept)} not); engines build one "
                f"fused MoE layer of them, so exclude the block whole (exclude=[{block!r}]) "
                "or not at all"
            )


def _check_quantizable(t: Tensor, block_2d: bool) -> None:
    value = t.value
    stacked = t.expert is not None
    if is_nvfp4_array(value):
        validate_nvfp4_array(value, f"export_hf_checkpoint: the kernel of {t.module} ({t.where})")
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


def groups_of(tensors) -> dict[tuple[str, int], list[Tensor]]:
    groups: dict[tuple[str, int], list[Tensor]] = {}
    for t in tensors:
        if t.group is not None:
            groups.setdefault(t.group, []).append(t)
    return groups


def blocks_of(tensors) -> dict[str, list[Tensor]]:
    """The experts of every MoE block (all projections, all experts), by block name."""
    blocks: dict[str, list[Tensor]] = {}
    for t in tensors:
        if t.block:
            blocks.setdefault(t.block, []).append(t)
    return blocks


def quantized_sets(tensors) -> list[list[Tensor]]:
    """Quantized linears in sets that share their scales: each fused group, each other one."""
    groups = groups_of([t for t in tensors if t.quantized])
    alone = [[t] for t in tensors if t.quantized and t.group is None]
    return list(groups.values()) + alone


def compact(modules: Sequence[str]) -> list[str]:
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
