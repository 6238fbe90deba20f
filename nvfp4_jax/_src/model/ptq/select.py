"""Which layers `quantize_for_export` freezes: the rules, what can be frozen, fused groups."""

from __future__ import annotations

from collections.abc import Iterable

from flax import nnx

from nvfp4_jax._src.flax.layer_info import layer_stack, linear_problem
from nvfp4_jax._src.flax.walk import replace_layers
from nvfp4_jax._src.model.convert.rules import match_layer
from nvfp4_jax._src.model.ptq.settings import OP, Settings


def _layer_problem(layer) -> str:
    """Why a layer a rule puts in NVFP4 cannot be frozen here ("" if it can)."""
    if not isinstance(layer, nnx.Linear):
        return (
            f"an {type(layer).__name__} layer: {OP} freezes nnx.Linear layers only (it stays "
            "as it is)"
        )
    problem = linear_problem(layer)
    if problem:
        return problem
    if layer_stack(layer):
        return (
            f"a stacked layer (kernel {tuple(layer.kernel.shape)}, run under nnx.scan/vmap): "
            f"{OP} freezes 2-D (in, out) kernels only"
        )
    return ""


def groups(paths: Iterable[str], fused_groups) -> dict[tuple[str, int], list[str]]:
    """Linears by fused group: same parent module, names in one group of `fused_groups`."""
    groups: dict[tuple[str, int], list[str]] = {}
    for path in paths:
        parent, _, name = path.rpartition("/")
        for index, group in enumerate(fused_groups):
            if name in group:
                groups.setdefault((parent, index), []).append(path)
                break
    return groups


def decide(frozen: nnx.Module, found: dict, settings: Settings) -> dict[str, tuple[str, str]]:
    """Per layer path, (action, reason): the rules, what can be frozen, whole fused groups."""
    decided: dict[str, tuple[str, str]] = {}
    for path, (layer, paths) in found.items():
        match = match_layer(settings.rules, paths, OP)
        if match is None:
            decided[path] = ("unmatched", "")
        elif match[1].recipe is None:
            decided[path] = ("high_precision", "")
        else:
            problem = _layer_problem(layer)
            decided[path] = ("skipped", problem) if problem else ("nvfp4", "")
    selected = [p for p, (action, _) in decided.items() if action == "nvfp4"]
    # Replacing a layer by itself finds the ones that cannot be replaced (held in a tuple).
    reasons = replace_layers(frozen, [(found[p][0], found[p][0]) for p in selected])
    for path, reason in zip(selected, reasons, strict=True):
        if reason:
            decided[path] = ("skipped", reason)
    for members in groups(found, settings.fused_groups).values():
        kept = [p for p in members if decided[p][0] != "nvfp4"]
        for path in members:
            if kept and decided[path][0] == "nvfp4":
                decided[path] = (
                    "high_precision",
                    f"its fused sibling {kept[0]} is not quantized ({decided[kept[0]][0]}); "
                    "engines load a fused group all quantized or all not",
                )
    if not any(action == "nvfp4" for action, _ in decided.values()):
        listing = "; ".join(f"{p}: {a}{f' ({r})' if r else ''}" for p, (a, r) in decided.items())
        raise ValueError(
            f"{OP}: the model has no linear layer to quantize (rules select none, or none "
            f"can be frozen): {listing or 'it holds no linear layer'}"
        )
    return decided
