"""The report of `quantize_model` and `quantize_linen`: per module path, what became of a layer.

`QuantizeReport` maps each path to a `LayerDecision`: the action ("nvfp4", "high_precision",
"unmatched" or "skipped"), the rule that decided it, the recipe, and why a layer was skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from nvfp4_jax._src.model.convert.rules import Rule, recipe_to_dict
from nvfp4_jax._src.training.recipe import NVFP4Recipe

Action = Literal["nvfp4", "high_precision", "unmatched", "skipped"]


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    """What `quantize_model` (or the linen interceptor) did with one layer.

    Attributes:
      path: the "/"-joined module path.
      layer: the layer's class name (`Linear`, `Einsum`, `Dense`, `DenseGeneral`).
      action: "nvfp4" (computes in NVFP4), "high_precision" (a rule with recipe None),
        "unmatched" (no rule matched: left as it was) or "skipped" (an NVFP4 rule matched
        but the layer cannot be quantized: left as it was, see `reason`).
      rule: the index of the matching rule, or None.
      pattern: the matching rule's pattern, or None.
      recipe: the recipe the layer computes with ("nvfp4" only).
      reason: why a layer was skipped.
      aliases: the other paths of a layer held at several paths (a tied head), for which
        this decision holds too (`report[alias]` gives it).
      stack: the leading layer axes of a stacked layer (a kernel (L, K, N) made under
        `nnx.vmap` and run under `nnx.scan`: `(L,)`); `()` for a plain one.
    """

    path: str
    layer: str
    action: Action
    rule: int | None = None
    pattern: str | None = None
    recipe: NVFP4Recipe | None = None
    reason: str = ""
    aliases: tuple[str, ...] = ()
    stack: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        fields = dataclasses.asdict(self)
        fields["recipe"] = recipe_to_dict(self.recipe)
        return fields


@dataclasses.dataclass
class QuantizeReport:
    """Per module path, what became of each linear layer (a `LayerDecision`).

    Index it by path (`report["layers/0/mlp/up_proj"]`); `paths(action)` lists the paths of
    one action. A layer held at several paths has one entry, at its first path, listing the
    others as its `aliases`; indexing by an alias gives that entry.
    """

    layers: dict[str, LayerDecision] = dataclasses.field(default_factory=dict)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    def __getitem__(self, path: str) -> LayerDecision:
        return self.layers[self.aliases.get(path, path)]

    def __contains__(self, path: object) -> bool:
        return path in self.layers or path in self.aliases

    def __len__(self) -> int:
        return len(self.layers)

    def paths(self, action: Action) -> list[str]:
        """The paths of the layers whose action is `action`, in path order."""
        return [path for path, entry in self.layers.items() if entry.action == action]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A JSON-ready dict: path -> `LayerDecision.to_dict()`."""
        return {path: entry.to_dict() for path, entry in self.layers.items()}

    def __str__(self) -> str:
        width = max((len(path) for path in self.layers), default=4)
        lines = []
        for path, entry in self.layers.items():
            rule = "-" if entry.rule is None else f"rules[{entry.rule}] {entry.pattern!r}"
            notes = [f"also at {', '.join(entry.aliases)}"] if entry.aliases else []
            if entry.stack:
                notes.append(f"stacked {'x'.join(map(str, entry.stack))}")
            if entry.reason:
                notes.append(entry.reason)
            detail = f" ({'; '.join(notes)})" if notes else ""
            lines.append(f"{path:<{width}}  {entry.layer:<12} {entry.action:<14} {rule}{detail}")
        return "\n".join(lines)


def record(
    report: QuantizeReport,
    path: str,
    layer: str,
    action: Action,
    found: tuple[int, Rule] | None,
    reason: str = "",
    *,
    aliases: Sequence[str] = (),
    stack: Sequence[int] = (),
) -> None:
    """Enters what became of the layer at `path` into `report`, decided by `found`.

    Args:
      report: the report to fill.
      path: the layer's (first) module path.
      layer: the layer's class name.
      action: what became of it.
      found: the matching rule with its index (`match_rule`), or None.
      reason: why it was skipped.
      aliases: the layer's other paths; `report[alias]` gives the same entry.
      stack: the leading layer axes of a stacked layer.
    """
    index, rule = found if found is not None else (None, None)
    report.layers[path] = LayerDecision(
        path=path,
        layer=layer,
        action=action,
        rule=index,
        pattern=None if rule is None else rule.pattern,
        recipe=None if rule is None or action != "nvfp4" else rule.recipe,
        reason=reason,
        aliases=tuple(aliases),
        stack=tuple(stack),
    )
    for alias in aliases:
        report.aliases[alias] = path
