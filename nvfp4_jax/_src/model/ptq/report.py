"""The report of `quantize_for_export`: per layer what it did, and the errors it made."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table


@dataclasses.dataclass(frozen=True)
class PTQLayer:
    """What `quantize_for_export` did with one layer.

    Errors are relative: `||W_hat - W||^2 / ||W||^2` for the weight (the (in, out) kernel)
    and `||X W_hat - X W||^2 / ||X W||^2` for the output on the calibration inputs X
    (computed from `H = X^T X`: `tr(dW^T H dW) / tr(W^T H W)`); the `max_` ones are those of
    the "max" method (round to nearest with the tensor's or group's max amax), for
    comparison.

    Attributes:
      path: the "/"-joined module path.
      layer: the layer's class name.
      action: "nvfp4" (frozen to NVFP4), "high_precision" (a rule with recipe None, or a
        fused sibling kept so), "unmatched" (no rule matched: left as it was) or "skipped"
        (selected but not quantizable: left as it was, see `reason`).
      method: the method ("nvfp4" only).
      reason: why a layer was skipped or kept in high precision beyond its rule.
      shape: the kernel's (in, out).
      group: the paths sharing the global amax (a fused group), this one included.
      amax: the global amax A the weight was quantized with (c times the group's max for
        "mse"; the group's max otherwise).
      amax_factor: c of "mse" (1.0 for the other methods).
      weight_error, max_weight_error: relative weight errors.
      output_error, max_output_error: relative output errors on the calibration inputs
        (None when the layer saw no input).
      input_amax: the calibrated max |x| of the inputs (the fused group's max for W4A4).
      input_scale: W4A4's static activation scale, `input_amax * f32(1/2688)`.
      damping: GPTQ's damping `lambda` added to diag(H), relative to mean(diag H).
      rows: calibration rows (tokens) the layer saw.
      aliases: the other paths of a layer held at several paths.
    """

    path: str
    layer: str
    action: str
    method: str | None = None
    reason: str = ""
    shape: tuple[int, ...] = ()
    group: tuple[str, ...] = ()
    amax: float | None = None
    amax_factor: float | None = None
    weight_error: float | None = None
    max_weight_error: float | None = None
    output_error: float | None = None
    max_output_error: float | None = None
    input_amax: float | None = None
    input_scale: float | None = None
    damping: float | None = None
    rows: int = 0
    aliases: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PTQReport:
    """Per module path, what `quantize_for_export` did (a `PTQLayer`), and the settings.

    Index it by path (`report["layers/0/mlp/up_proj"]`, an alias works too); `paths(action)`
    lists the paths of one action; `quant_algo` is what to pass to `export_hf_checkpoint`.
    With `quantize_for_export(..., kv_cache=True)`, `kv_cache_amax` maps each attention
    module's path (the parent of a `k_proj` and a `v_proj`) to the calibrated (k_amax,
    v_amax): `export_hf_checkpoint`'s `kv_cache_amax`.
    """

    method: str
    activations: str
    block_2d: bool
    layers: dict[str, PTQLayer] = dataclasses.field(default_factory=dict)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    kv_cache_amax: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    @property
    def quant_algo(self) -> str:
        """`export_hf_checkpoint`'s `quant_algo`: "NVFP4" (W4A4) or "W4A16_NVFP4" (W4A16)."""
        return "NVFP4" if self.activations == "nvfp4" else "W4A16_NVFP4"

    def __getitem__(self, path: str) -> PTQLayer:
        return self.layers[self.aliases.get(path, path)]

    def __contains__(self, path: object) -> bool:
        return path in self.layers or path in self.aliases

    def __len__(self) -> int:
        return len(self.layers)

    def paths(self, action: str) -> list[str]:
        """The paths of the layers whose action is `action`, in path order."""
        return [path for path, entry in self.layers.items() if entry.action == action]

    def mean(self, field: str) -> float | None:
        """The mean of a `PTQLayer` error field over the quantized layers (None if none)."""
        values = [getattr(self.layers[p], field) for p in self.paths("nvfp4")]
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the settings and path -> `PTQLayer.to_dict()`."""
        return {
            "method": self.method,
            "activations": self.activations,
            "block_2d": self.block_2d,
            "quant_algo": self.quant_algo,
            "layers": {path: entry.to_dict() for path, entry in self.layers.items()},
            "kv_cache_amax": {path: list(pair) for path, pair in self.kv_cache_amax.items()},
        }

    def to_json(self, **kwargs) -> str:
        """`to_dict()` as JSON (`kwargs` go to `json.dumps`, default `indent=1`)."""
        return json.dumps(self.to_dict(), **{"indent": 1, **kwargs})

    def table(self) -> Table:
        """A rich table: one row per layer, errors in percent."""
        table = Table(
            title=f"quantize_for_export: {self.method}, "
            f"{'W4A4' if self.activations == 'nvfp4' else 'W4A16'}, "
            f"{'16x16' if self.block_2d else '1x16'} weight blocks",
            caption="W err, out err: relative squared error of the weight and of the layer's "
            "output on the calibration inputs, in %; (max): the same for round-to-nearest "
            "with the max amax",
            box=box.SIMPLE_HEAD,
        )
        columns = ("path", "method", "in x out", "amax (c)", "W err", "(max)", "out err", "(max)")
        for column in columns:
            table.add_column(column, justify="left" if column in ("path", "method") else "right")
        for path, e in self.layers.items():
            if e.action != "nvfp4":
                table.add_row(path, e.action, _shape(e.shape), e.reason, "", "", "", "")
                continue
            table.add_row(
                path,
                e.method,
                _shape(e.shape),
                f"{e.amax:.4g} ({e.amax_factor:g})",
                _percent(e.weight_error),
                _percent(e.max_weight_error),
                _percent(e.output_error),
                _percent(e.max_output_error),
            )
        return table

    def print(self, console: Console | None = None) -> None:
        """Prints `table()`."""
        (console or Console()).print(self.table())

    def __str__(self) -> str:
        console = Console(width=160, record=True, file=io.StringIO())
        console.print(self.table())
        return console.export_text()


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(map(str, shape)) if shape else ""


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.3f}"
