"""The checked arguments of `quantize_for_export`: the method, the activations, the options."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from flax import nnx

from nvfp4_jax._src.core import checks
from nvfp4_jax._src.flax.frozen import ACTIVATIONS
from nvfp4_jax._src.model.convert.rules import Rule, check_rules, default_rules

# The name of the operation, in error messages.
OP = "quantize_for_export"

METHODS = ("max", "mse", "four_over_six", "gptq")
# The global-amax factors c the "mse" method tries: 0.70, 0.71, ..., 1.20 (1 is always in).
DEFAULT_MSE_GRID = tuple(round(0.70 + 0.01 * i, 2) for i in range(51))
DEFAULT_GPTQ_DAMP = 0.01


def _default_forward(model, batch) -> Any:
    return model(batch)


def _check_fused_groups(fused_groups) -> tuple[tuple[str, ...], ...]:
    if isinstance(fused_groups, str) or not isinstance(fused_groups, Iterable):
        raise TypeError(
            f"{OP}: fused_groups must be a sequence of name groups, e.g. "
            f"(('q_proj', 'k_proj', 'v_proj'),), got {fused_groups!r}"
        )
    groups = []
    for group in fused_groups:
        if isinstance(group, str) or not isinstance(group, Iterable):
            raise TypeError(f"{OP}: fused_groups must hold sequences of names, got {group!r}")
        group = tuple(group)
        if not all(isinstance(name, str) for name in group):
            raise TypeError(f"{OP}: fused_groups must hold sequences of names, got {group!r}")
        groups.append(group)
    return tuple(groups)


def _check_grid(grid) -> tuple[float, ...]:
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Iterable):
        raise TypeError(f"{OP}: mse_grid must be a sequence of positive numbers, got {grid!r}")
    values = []
    for c in grid:
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, np.number)):
            raise TypeError(f"{OP}: mse_grid must hold numbers, got {c!r}")
        if not 0 < float(c) < math.inf:
            raise ValueError(f"{OP}: mse_grid must hold positive, finite numbers, got {c!r}")
        values.append(float(c))
    return tuple(dict.fromkeys([1.0, *values]))


def _check_damp(damp) -> float:
    if isinstance(damp, (bool, np.bool_)) or not isinstance(damp, (int, float, np.number)):
        raise TypeError(f"{OP}: gptq_damp must be a positive number, got {damp!r}")
    if not 0 < float(damp) < math.inf:
        raise ValueError(f"{OP}: gptq_damp must be a positive, finite number, got {damp!r}")
    return float(damp)


def check_batches(batches) -> list:
    """The calibration batches as a list; TypeError or ValueError for what is not."""
    if batches is None or isinstance(batches, (str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(
            f"{OP}: batches must be an iterable of calibration inputs (one per forward call), "
            f"got {type(batches).__name__}"
        )
    if isinstance(batches, (jax.Array, np.ndarray)):
        raise TypeError(
            f"{OP}: batches must be an iterable of batches, got one array of shape "
            f"{batches.shape}; pass [batch] for a single batch"
        )
    batches = list(batches)
    if not batches:
        raise ValueError(f"{OP}: batches is empty; calibration needs at least one batch")
    return batches


@dataclasses.dataclass(frozen=True)
class Settings:
    """The checked arguments of `quantize_for_export`."""

    method: str
    activations: str
    rules: tuple[Rule, ...]
    forward: Callable[[nnx.Module, Any], Any]
    block_2d: bool
    fused_groups: tuple[tuple[str, ...], ...]
    mse_grid: tuple[float, ...]
    four_over_six: str
    e4m3_max: int
    damp: float
    act_order: bool
    jit: bool
    kv_cache: bool = False


def check_settings(
    method, activations, rules, forward, block_2d, fused_groups, options
) -> Settings:
    """The checked arguments of `quantize_for_export` (`options`: the method options)."""
    method = checks.check_choice(f"{OP}: method", method, METHODS)
    activations = checks.check_choice(f"{OP}: activations", activations, ACTIVATIONS)
    rules = default_rules(0, first=0, last=0) if rules is None else check_rules(rules, OP)
    if forward is None:
        forward = _default_forward
    elif not callable(forward):
        raise TypeError(f"{OP}: forward must be callable as forward(model, batch), got {forward!r}")
    mode, e4m3_max = checks.check_four_over_six(
        options["four_over_six"], options["four_over_six_e4m3_max"], OP
    )
    if mode is None:
        raise ValueError(f"{OP}: four_over_six must be 'mse' or 'mae', got None")
    return Settings(
        method=method,
        activations=activations,
        rules=tuple(rules),
        forward=forward,
        block_2d=checks.check_flag(block_2d, OP, "block_2d"),
        fused_groups=_check_fused_groups(fused_groups),
        mse_grid=_check_grid(options["mse_grid"]),
        four_over_six=mode,
        e4m3_max=e4m3_max,
        damp=_check_damp(options["gptq_damp"]),
        act_order=checks.check_flag(options["gptq_act_order"], OP, "gptq_act_order"),
        jit=checks.check_flag(options["jit"], OP, "jit"),
        kv_cache=checks.check_flag(options.get("kv_cache", False), OP, "kv_cache"),
    )
