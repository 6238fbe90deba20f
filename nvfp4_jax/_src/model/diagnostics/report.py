"""The report of `inspect_model`: per-layer `LayerStats`, tables, plots and suggested rules."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from nvfp4_jax._src.model.convert.rules import Rule
from nvfp4_jax._src.model.diagnostics.numbers import OPERANDS, LayerStats
from nvfp4_jax._src.training.recipe import NVFP4Recipe

# The operands' names in the table: the wgrad ones are transposed (quantized along M).
SHORT_NAMES = {"x": "x", "w": "W", "dy": "dy", "x_wgrad": "xᵀ", "dy_wgrad": "dyᵀ"}
SCORES = ("wgrad_angle", "error")


_CAPTION = (
    "x, W, dy: relative error of the fprop/dgrad operands; xᵀ, dyᵀ: of the wgrad operands "
    "(along the tokens M, RHT). uflow, sat: the largest share of underflowing blocks and of "
    "saturated values over the operands (and which). ∠dW: angle between the NVFP4 and the "
    "exact weight gradient; dx: relative error of dgrad; each with stochastic rounding (SR) "
    "or round-to-nearest (RTN) of dy."
)


def _exact(path: str) -> str:
    return f"^{re.escape(path)}$"


def _percent(value: float, digits: int = 2) -> str:
    return f"{100 * value:.{digits}f}"


def _worst(stats: LayerStats, field: str) -> str:
    name, value = max(
        ((name, getattr(s, field)) for name, s in stats.operands.items()), key=lambda kv: kv[1]
    )
    return f"{_percent(value)} {SHORT_NAMES[name]}" if value > 0 else "0"


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """What `inspect_model` found: per-layer `LayerStats`, and the layers it left out.

    Attributes:
      layers: the analyzed layers, in path order.
      loss: the loss of the pass.
      high_precision: linear layers that compute (or, under the rules, would compute) in
        high precision: not analyzed.
      skipped: linear layers a rule puts in NVFP4 that cannot be (path -> why).
      rules: the rules the model was inspected under, or None.
    """

    layers: tuple[LayerStats, ...]
    loss: float
    high_precision: tuple[str, ...] = ()
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    rules: tuple[Rule, ...] | None = None

    def __getitem__(self, path: str) -> LayerStats:
        for stats in self.layers:
            if stats.path == path:
                return stats
        raise KeyError(path)

    # -- serialization

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`json.dumps` takes it as is)."""
        return {
            "loss": self.loss,
            "layers": [stats.to_dict() for stats in self.layers],
            "high_precision": list(self.high_precision),
            "skipped": dict(self.skipped),
            "rules": None if self.rules is None else [rule.to_dict() for rule in self.rules],
        }

    def to_json(self, **kwargs) -> str:
        """`json.dumps(self.to_dict(), **kwargs)`."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelReport:
        """The inverse of `to_dict`."""
        rules = data.get("rules")
        return cls(
            layers=tuple(LayerStats.from_dict(layer) for layer in data["layers"]),
            loss=float(data["loss"]),
            high_precision=tuple(data.get("high_precision", ())),
            skipped=dict(data.get("skipped", {})),
            rules=None if rules is None else tuple(Rule.from_dict(rule) for rule in rules),
        )

    @classmethod
    def from_json(cls, text: str) -> ModelReport:
        """The inverse of `to_json`."""
        return cls.from_dict(json.loads(text))

    # -- scores and suggestions

    def scores(self, score: str | Callable[[LayerStats], float] = "wgrad_angle") -> dict:
        """Maps path -> score (larger is worse), for every analyzed layer.

        Args:
          score: "wgrad_angle" (the default: the angle between the recipe's NVFP4 weight
            gradient and the exact one, what the optimizer sees; the NVFP4 paper finds it
            largest in the last blocks), "error" (the summed relative error of the five
            operands), or a function of a `LayerStats`.
        """
        if callable(score):
            return {stats.path: float(score(stats)) for stats in self.layers}
        if score not in SCORES:
            raise ValueError(
                f"ModelReport: score must be one of {SCORES} or callable, got {score!r}"
            )
        field = "summed_error" if score == "error" else "wgrad_angle"
        return {stats.path: float(getattr(stats, field)) for stats in self.layers}

    def suggest_rules(
        self, share: float = 0.1, *, score: str | Callable[[LayerStats], float] = "wgrad_angle"
    ) -> list[Rule]:
        """Rules keeping the worst `share` of the analyzed layers in high precision as well.

        Args:
          share: the share of the analyzed layers (GEMMs) to keep in high precision, in
            [0, 1]; the count is rounded up.
          score: how layers are ranked (`scores`); the worst come first.

        Returns:
          One exact-path rule (`^path$`, recipe None) per kept layer, worst first (a slice
          of a stacked layer keeps the whole stacked layer: one rule for its module path,
          which rules match; the share counts the slices, each a GEMM), followed
          by the rules the model was inspected under (which end with their catch-all), or,
          for a model inspected as it is, by exact-path rules for the layers in high
          precision and for those whose recipe is not the most common one, and a catch-all
          `Rule(".*", most common recipe)`. Pass them to `quantize_model`.
        """
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"suggest_rules: share must be a number in [0, 1], got {share!r}")
        scores = self.scores(score)
        ranked = sorted(scores, key=lambda path: -scores[path])
        count = math.ceil(share * len(ranked) - 1e-9)
        keep = [Rule(_exact(self[path].rule_path), None) for path in ranked[:count]]
        rest = self.rules if self.rules is not None else self._current_rules()
        return [*dict.fromkeys(keep), *rest]

    def _current_rules(self) -> list[Rule]:
        """Rules reproducing the inspected model: its high-precision layers, its recipes."""
        counts = collections.Counter(stats.recipe for stats in self.layers)
        common = counts.most_common(1)[0][0] if counts else NVFP4Recipe()
        rules = [Rule(_exact(path), None) for path in self.high_precision]
        rules += [Rule(_exact(s.rule_path), s.recipe) for s in self.layers if s.recipe != common]
        return [*dict.fromkeys(rules), Rule(".*", common)]

    # -- presentation

    def table(self) -> Table:
        """A `rich` table, one row per layer (the caption explains the columns)."""
        table = Table(title=self._title(), caption=_CAPTION, box=box.SIMPLE_HEAD)
        table.add_column("layer", no_wrap=True)
        headers = ["K×N", *(f"{SHORT_NAMES[n]}\n%" for n in OPERANDS), "uflow\n%", "sat\n%"]
        for header in [*headers, "∠dW°\nSR/RTN", "dx %\nSR/RTN"]:
            table.add_column(header, justify="right", no_wrap=True)
        for s in self.layers:
            table.add_row(
                s.path,
                f"{s.in_features}×{s.out_features}",
                *(_percent(s.operands[name].rel_error, 1) for name in OPERANDS),
                _worst(s, "underflow"),
                _worst(s, "saturated"),
                f"{s.wgrad_angle_sr:.1f}/{s.wgrad_angle_rtn:.1f}",
                f"{_percent(s.dgrad_error_sr, 1)}/{_percent(s.dgrad_error_rtn, 1)}",
            )
        return table

    def _title(self) -> str:
        tokens = sorted({stats.tokens for stats in self.layers})
        span = (
            ""
            if not tokens
            else f"{tokens[0]}"
            if len(tokens) == 1
            else f"{tokens[0]}-{tokens[-1]}"
        )
        count = f", {span} tokens" if span else ""
        return f"NVFP4 diagnostics: {len(self.layers)} layers{count}, loss {self.loss:.4g}"

    def print(self, console: Console | None = None) -> None:
        """Prints `table()` (to `console`, default a new `rich` Console)."""
        (console or Console()).print(self.table())

    def plot(self, path: str) -> str:
        """Draws the per-layer errors and weight-gradient angles into the image file `path`.

        Needs matplotlib (the `examples` extra). Returns `path`.
        """
        from matplotlib.figure import Figure  # noqa: PLC0415  (optional, only needed here)

        names = [stats.path for stats in self.layers]
        positions = list(range(len(names)))
        fig = Figure(figsize=(max(6.0, 0.45 * len(names) + 2), 7), layout="constrained")
        errors, angles = fig.subplots(2, 1, sharex=True)
        for name in OPERANDS:
            values = [100 * stats.operands[name].rel_error for stats in self.layers]
            errors.plot(positions, values, marker="o", label=name)
        errors.set_ylabel("relative error (%)")
        errors.set_title("NVFP4 quantization error of the GEMM operands", pad=24)
        errors.legend(
            ncols=len(OPERANDS), fontsize="small", loc="lower left", bbox_to_anchor=(0, 1.0)
        )
        for offset, label in ((-0.2, "SR"), (0.2, "RTN")):
            field = f"wgrad_angle_{label.lower()}"
            values = [getattr(stats, field) for stats in self.layers]
            angles.bar([p + offset for p in positions], values, 0.4, label=label)
        angles.set_xlim(-0.6, len(names) - 0.4)
        angles.set_ylabel("wgrad angle (degrees)")
        angles.set_title("angle between the NVFP4 and the exact weight gradient")
        angles.legend(fontsize="small")
        angles.set_xticks(positions, names, rotation=60, ha="right", fontsize="small")
        fig.savefig(path, dpi=100)
        return path
