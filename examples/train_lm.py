"""Trains a byte-level transformer language model with NVFP4 layers next to bf16.

    python examples/train_lm.py                       # both recipes, CPU-sized defaults
    python examples/train_lm.py --recipe nvfp4 --steps 2000 --width 512 --depth 8 --batch 64
    python examples/train_lm.py --experts 4 --top-k 2 # a mixture of experts (Mixtral-style)

The text is the Python documentation every CPython install carries (`pydoc_data.topics`),
split 90/10 into train and validation; `--data PATH` trains on a text file of your own.
Both runs start from the same initial weights and see the same batches in the same order.
With `--experts`, every MLP is a dropless mixture of experts: an f32 router (never quantized)
picks `--top-k` experts per token, the experts' grouped GEMMs follow the same rules as the
linear layers (`--bf16-first/--bf16-last/--keep-bf16/--rules` keep them in bf16 too), and a
load-balancing loss (`--aux-loss-coef`) is added to the training loss and reported apart.
`--high-precision-final F` runs the last fraction F of the NVFP4 run's steps with the forward
GEMMs (or, with `--high-precision-final-gemms all`, every GEMM) in high precision; a resumed
run continues in the recipe of its step.
The output folder gets `results.json`, `curves.png` and orbax checkpoints (`--resume`).
Every flag is checked before anything runs: a bad value or combination exits with status 2
and a message naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from lm_model import LMConfig, TransformerLM, loss_fn, train_loss_fn

import nvfp4_jax

RECIPES = ("nvfp4", "bf16")
# The NVFP4Recipe switches --disable and --rules may turn off (fprop, dgrad, wgrad: that GEMM
# in high precision for the whole run).
SWITCHES = ("weight_2d", "wgrad_rht", "stochastic_rounding", "fprop", "dgrad", "wgrad")
EVAL_BATCHES = 8
# optax counts optimizer steps in int32.
MAX_STEPS = 2**31 - 1
MAX_SEED = 2**32 - 1
# --eval-every and --save-every default to this, or to --steps when that is smaller.
DEFAULT_INTERVAL = 100
# The bytes of a --data file searched for a NUL byte, the mark of a binary file.
BINARY_SNIFF_BYTES = 1 << 16
# The flags a resumed run must share with its checkpoint: they fix the model, the batches
# and the learning-rate schedule. The others (--eval-every, --save-every, --stop-after,
# --recipe) may change between the parts of a run.
# JAX's persistent compilation cache (--compile-cache): a run loads what an earlier one compiled.
DEFAULT_COMPILE_CACHE = (
    pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    / "nvfp4_jax"
    / "xla"
)

RESUME_FLAGS = (
    "steps",
    "batch",
    "seq_len",
    "width",
    "depth",
    "heads",
    "lr",
    "warmup",
    "seed",
    "bf16_first",
    "bf16_last",
    "keep_bf16",
    "rules",
    "suggest_share",
    "disable",
    "experts",
    "top_k",
    "expert_intermediate",
    "aux_loss_coef",
    "high_precision_final",
    "high_precision_final_gemms",
    "four_over_six",
    "four_over_six_error",
    "four_over_six_e4m3_max",
    "sr_seed",
    "backward",
)
# What a checkpoint made before a flag existed was made with (it records no value for it).
RESUME_DEFAULTS = {
    "experts": 0,
    "top_k": 2,
    "expert_intermediate": None,
    "aux_loss_coef": 0.01,
    "high_precision_final": 0.0,
    "high_precision_final_gemms": "fprop",
    "four_over_six": [],
    "four_over_six_error": "mse",
    "four_over_six_e4m3_max": 256,
    "sr_seed": None,
    "backward": "nvidia",
}
# --backward: the NVFP4 backward GEMMs' quantization (NVFP4Recipe.backward), NVIDIA's recipe
# (dy stochastically rounded) or Quartet II's MS-EDEN; and the default, MS-EDEN since the
# recipe study (docs/results/accuracy.md, "Quartet II's backward": its mean gap over three
# rounding draws was the lower one on every recipe studied).
BACKWARDS = ("nvidia", "ms_eden")
DEFAULT_BACKWARD = "ms_eden"
# The --disable switches only NVIDIA's backward has.
NVIDIA_SWITCHES = {"stochastic_rounding", "wgrad_rht"}
# The Four Over Six fields a --rules recipe may set (null, "mae" or "mse"), over the flags'.
RULE_FOUR_OVER_SIX = ("weight_four_over_six", "activation_four_over_six", "gradient_four_over_six")
# --four-over-six: the operand classes of the NVFP4 GEMMs quantized with Four Over Six, and
# those quantized with it when the flag is not given.
FOUR_OVER_SIX_CLASSES = ("weight", "activation", "gradient")
DEFAULT_FOUR_OVER_SIX = ("all",)
# With --experts the grouped GEMMs take 4/6 on their weights only.
DEFAULT_FOUR_OVER_SIX_EXPERTS = ("weight",)
# --high-precision-final-gemms: the GEMMs of the NVFP4 layers run in high precision after the
# switch (the forward alone, or all three).
HIGH_PRECISION_GEMMS = {"fprop": ("fprop",), "all": ("fprop", "dgrad", "wgrad")}
# The default NVFP4 recipe of the example (docs/results/accuracy.md): the first block, the last
# block and the head in bf16, the last 20% of the steps with the forward in bf16, and Four
# Over Six on every operand (DEFAULT_FOUR_OVER_SIX; W and x under MS-EDEN's backward, which
# quantizes dy itself). The accuracy study (NVIDIA's backward), width 128, 600 steps, seeds
# 0 and 1: +0.18% / +0.36% against +2.47% / +2.43% for the plain recipe.
DEFAULT_BF16_FIRST = 1
DEFAULT_HIGH_PRECISION_FINAL = 0.2
# The MoE's defaults: experts per token, the load-balancing loss's weight (Switch's 0.01).
DEFAULT_TOP_K = 2
DEFAULT_AUX_LOSS_COEF = 0.01


class UsageError(Exception):
    """A command-line problem found after parsing (checkpoints, the text); exits like argparse."""


def _integer(low: int, high: int | None = None, multiple_of: int = 1, what: str | None = None):
    """An argparse `type`: an integer in [low, high] that is a multiple of `multiple_of`."""
    if what is None:
        if high is not None:
            what = f"an integer from {low} to {high}"
        else:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < low or (high is not None and value > high) or value % multiple_of:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    """An argparse `type`: a finite number > 0 (NaN, inf, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _text_file(text: str) -> pathlib.Path:
    """An argparse `type`: a readable, non-empty file that does not look binary."""
    path = pathlib.Path(text)
    try:
        if not path.is_file():
            kind = " (it is a folder)" if path.is_dir() else ""
            raise argparse.ArgumentTypeError(f"{text} is not a file{kind}")
        with path.open("rb") as file:
            head = file.read(BINARY_SNIFF_BYTES)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {error.strerror or error}") from None
    if not head:
        raise argparse.ArgumentTypeError(f"{text} is empty")
    if (nul := head.find(b"\0")) >= 0:
        raise argparse.ArgumentTypeError(
            f"{text} looks like a binary file (a NUL byte at offset {nul}); pass a text file"
        )
    return path


def _compile_cache(text: str) -> pathlib.Path | str:
    """An argparse `type`: "none", or a folder that exists or can be created and written."""
    return "none" if text == "none" else _out_folder(text)


def _out_folder(text: str) -> pathlib.Path:
    """An argparse `type`: a folder that exists or can be created, and can be written."""
    path = pathlib.Path(text)
    try:
        if path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
        ancestor = path.absolute()
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise argparse.ArgumentTypeError(f"cannot create {text}: {ancestor} is not a folder")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text}: no permission in {ancestor}")
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot use {text}: {error.strerror or error}") from None
    return path


def _regex(text: str) -> str:
    """An argparse `type`: a valid regular expression."""
    try:
        re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"not a regular expression ({error}): {text!r}") from None
    return text


def _non_negative_float(text: str) -> float:
    """An argparse `type`: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _share(text: str) -> float:
    """An argparse `type`: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def _fraction_below_one(text: str) -> float:
    """An argparse `type`: a number F with 0 <= F < 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to below 1, got {text}")
    return value


def _rules_file(text: str) -> tuple:
    """An argparse `type`: a JSON rules file, as a tuple of (pattern, recipe switches or None)."""
    try:
        data = json.loads(pathlib.Path(text).read_text())
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {error.strerror}") from None
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text} is not JSON: {error}") from None
    if not isinstance(data, list):
        raise argparse.ArgumentTypeError(f"{text}: expected a JSON list of rules")
    rules = []
    for i, rule in enumerate(data):
        if not isinstance(rule, dict) or set(rule) - {"pattern", "recipe"} or "pattern" not in rule:
            raise argparse.ArgumentTypeError(
                f"{text}: rule {i} must be {{'pattern': regex, 'recipe': null or switches}}"
            )
        recipe = rule.get("recipe")
        fields = (*SWITCHES, *RULE_FOUR_OVER_SIX)
        if recipe is not None and (
            not isinstance(recipe, dict)
            or set(recipe) - set(fields)
            or any(not isinstance(recipe[k], bool) for k in set(recipe) & set(SWITCHES))
            or any(recipe[k] not in (None, "mae", "mse") for k in set(recipe) - set(SWITCHES))
        ):
            raise argparse.ArgumentTypeError(
                f"{text}: rule {i}: recipe must be null or a dict of {SWITCHES} to booleans "
                f"and of {RULE_FOUR_OVER_SIX} to null, 'mae' or 'mse'"
            )
        rules.append(
            (_regex(rule["pattern"]), None if recipe is None else tuple(sorted(recipe.items())))
        )
    return tuple(rules)


def build_parser() -> argparse.ArgumentParser:
    """The command line; each flag's `type` checks its own value."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=("nvfp4", "bf16", "both"), default="both")
    p.add_argument(
        "--data", type=_text_file, default=None, help="a text file, read as bytes (not binary)"
    )
    p.add_argument("--steps", type=_integer(1, MAX_STEPS), default=600)
    p.add_argument("--batch", type=_integer(1), default=16)
    p.add_argument("--seq-len", type=_integer(1), default=64, help="at most a tenth of the text")
    width_rule = f"a positive multiple of {nvfp4_jax.BLOCK_SIZE} (the NVFP4 block size)"
    p.add_argument(
        "--width",
        type=_integer(nvfp4_jax.BLOCK_SIZE, multiple_of=nvfp4_jax.BLOCK_SIZE, what=width_rule),
        default=128,
    )
    p.add_argument("--depth", type=_integer(1), default=4)
    p.add_argument("--heads", type=_integer(1), default=4, help="must divide --width")
    p.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate")
    p.add_argument(
        "--warmup",
        type=_integer(0),
        default=None,
        help="linear warm-up steps, at most --steps (default: steps/20, at least 1)",
    )
    p.add_argument("--seed", type=_integer(0, MAX_SEED), default=0)
    p.add_argument(
        "--sr-seed",
        type=_integer(0, MAX_SEED),
        default=None,
        help="seed of the NVFP4 run's rounding streams alone (stochastic rounding, or MS-EDEN's "
        "rotations and scale roundings; default: from --seed); the weights and the batches "
        "stay --seed's",
    )
    p.add_argument(
        "--bf16-first",
        type=_integer(0),
        default=None,
        help=f"blocks kept in bf16 at the start (default {DEFAULT_BF16_FIRST} when that leaves "
        "a block in NVFP4, else 0)",
    )
    p.add_argument(
        "--bf16-last",
        type=_integer(0),
        default=2,
        help="blocks kept in bf16 at the end, the output head counting as one (default 2: the "
        "last block and the head, the NVFP4 paper's policy scaled to this depth)",
    )
    p.add_argument(
        "--keep-bf16",
        action="append",
        default=[],
        type=_regex,
        metavar="PATTERN",
        help="keep the linear layers whose path matches this regular expression in bf16 "
        "(e.g. 'lm_head' or '^layers/3/'; repeatable)",
    )
    p.add_argument(
        "--rules",
        type=_rules_file,
        default=None,
        metavar="FILE",
        help='a JSON list of {"pattern": regex, "recipe": null | {switch: bool}} rules (a '
        'recipe may also set weight/activation/gradient_four_over_six: null, "mae", "mse"), '
        "first match wins, after --keep-bf16/--bf16-first/--bf16-last",
    )
    p.add_argument(
        "--suggest-share",
        type=_share,
        default=0.0,
        help="also keep in bf16 the worst share of the linear layers by the diagnostics' "
        "weight-gradient angle (0 to 1)",
    )
    p.add_argument(
        "--diagnostics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before the NVFP4 run, measure each linear layer's NVFP4 error on the first batch "
        "(diagnostics.json and .png; default on); --no-diagnostics skips it, not with "
        "--suggest-share",
    )
    p.add_argument(
        "--disable",
        action="append",
        default=[],
        choices=SWITCHES,
        help="turn off a switch of the NVFP4 recipe (repeatable)",
    )
    p.add_argument(
        "--high-precision-final",
        type=_fraction_below_one,
        default=DEFAULT_HIGH_PRECISION_FINAL,
        help="run the last fraction F of the steps (0 <= F < 1; default "
        f"{DEFAULT_HIGH_PRECISION_FINAL}; 0: none) of the NVFP4 run with the GEMMs "
        "--high-precision-final-gemms names in high precision (bf16)",
    )
    p.add_argument(
        "--high-precision-final-gemms",
        choices=tuple(HIGH_PRECISION_GEMMS),
        default=None,
        help="which GEMMs --high-precision-final puts in high precision: the forward (fprop, "
        "the default; the backward stays NVFP4) or all three",
    )
    p.add_argument(
        "--backward",
        choices=BACKWARDS,
        default=DEFAULT_BACKWARD,
        help="the NVFP4 backward GEMMs: nvidia (NVIDIA's recipe: dy stochastically rounded, the "
        "wgrad operands rotated by a 16-point RHT) or ms_eden (Quartet II: dy and the forward's "
        f"quantized W and x re-quantized with MS-EDEN); default {DEFAULT_BACKWARD}",
    )
    p.add_argument(
        "--four-over-six",
        action="append",
        default=None,
        choices=(*FOUR_OVER_SIX_CLASSES, "all", "none"),
        help="quantize this operand class of the NVFP4 GEMMs with Four Over Six (repeatable; "
        "weight: W, activation: x, gradient: dy; all: the three, the default (weight with "
        "--experts; weight and activation with --backward ms_eden, whose dy is MS-EDEN's); "
        "none: plain NVFP4)",
    )
    p.add_argument(
        "--four-over-six-error",
        choices=("mae", "mse"),
        default="mse",
        help="Four Over Six's candidate error (default mse)",
    )
    p.add_argument(
        "--four-over-six-e4m3-max",
        type=int,
        choices=(256, 448),
        default=256,
        help="the E4M3 maximum of the global scale under Four Over Six (default 256)",
    )
    p.add_argument(
        "--experts",
        type=_integer(0),
        default=0,
        help="a mixture of this many experts in every MLP (default 0: dense MLPs)",
    )
    p.add_argument(
        "--top-k",
        type=_integer(1),
        default=None,
        help=f"experts per token, from 1 to --experts (default {DEFAULT_TOP_K}; needs --experts)",
    )
    expert_rule = f"a positive multiple of {nvfp4_jax.BLOCK_SIZE} (the NVFP4 block size)"
    p.add_argument(
        "--expert-intermediate",
        type=_integer(nvfp4_jax.BLOCK_SIZE, multiple_of=nvfp4_jax.BLOCK_SIZE, what=expert_rule),
        default=None,
        help="one expert's MLP size (default: the dense MLP size / --top-k, rounded up to a "
        "multiple of 16: the dense model's compute per token; needs --experts)",
    )
    p.add_argument(
        "--aux-loss-coef",
        type=_non_negative_float,
        default=None,
        help=f"weight of the load-balancing loss added to the training loss (default "
        f"{DEFAULT_AUX_LOSS_COEF}; needs --experts)",
    )
    p.add_argument(
        "--eval-every",
        type=_integer(1),
        default=None,
        help=f"validation interval, at most --steps (default: {DEFAULT_INTERVAL} or --steps); "
        "the last step is always evaluated",
    )
    p.add_argument(
        "--save-every",
        type=_integer(0),
        default=None,
        help=f"checkpoint interval, at most --steps, 0: only at the end (default: "
        f"{DEFAULT_INTERVAL} or --steps)",
    )
    p.add_argument("--out", type=_out_folder, default="runs/train_lm", help="the output folder")
    p.add_argument(
        "--compile-cache",
        type=_compile_cache,
        default=None,
        metavar="DIR|none",
        help="JAX's persistent compilation cache, so that a run with programs an earlier run "
        f"compiled loads them (default: JAX_COMPILATION_CACHE_DIR if set, else "
        f"{DEFAULT_COMPILE_CACHE}; none: compile everything)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoints in --out (needs the same flags)",
    )
    p.add_argument(
        "--stop-after",
        type=_integer(1),
        default=None,
        help="stop (with a checkpoint) after this step, at most --steps",
    )
    return p


def _check_moe_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The mixture-of-experts flags: they need --experts; fills in their defaults."""
    if not args.experts:
        for name in ("top_k", "expert_intermediate", "aux_loss_coef"):
            if getattr(args, name) is not None:
                p.error(f"--{name.replace('_', '-')} needs --experts (a mixture of experts)")
    if args.top_k is None:
        args.top_k = min(DEFAULT_TOP_K, args.experts or DEFAULT_TOP_K)
    elif args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if args.aux_loss_coef is None:
        args.aux_loss_coef = DEFAULT_AUX_LOSS_COEF


def _check_four_over_six_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--four-over-six: "all" and "none" alone; the classes sorted, without repeats."""
    default = DEFAULT_FOUR_OVER_SIX_EXPERTS if args.experts else DEFAULT_FOUR_OVER_SIX
    named = set(args.four_over_six or default)
    for word in ("all", "none"):
        if word in named and len(named) > 1:
            p.error(f"--four-over-six {word} cannot be combined with other classes")
    if "all" in named:
        named = set(FOUR_OVER_SIX_CLASSES)
        if args.backward == "ms_eden":
            named -= {"gradient"}  # dy is quantized with MS-EDEN
    elif args.backward == "ms_eden" and "gradient" in named:
        p.error("--four-over-six gradient cannot be combined with --backward ms_eden (dy is "
                "quantized with MS-EDEN)")  # fmt: skip
    args.four_over_six = sorted(named - {"none"})
    if args.experts and set(args.four_over_six) - {"weight"}:
        p.error(
            "--four-over-six activation/gradient is not implemented for --experts (the grouped "
            "GEMMs quantize each expert's tokens with their own amax); use --four-over-six weight"
        )


def _check_high_precision_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--high-precision-final-gemms needs --high-precision-final; fills in its default."""
    if args.high_precision_final_gemms is None:
        args.high_precision_final_gemms = "fprop"
    elif not args.high_precision_final:
        p.error("--high-precision-final-gemms needs --high-precision-final F > 0")


def _check_diagnostics_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.suggest_share and not args.diagnostics:
        p.error("--suggest-share needs the diagnostics: drop --no-diagnostics")


def _check_backward_flags(p: argparse.ArgumentParser, args) -> None:
    """Exit 2 on a --disable switch or a --rules field only NVIDIA's backward has, under
    MS-EDEN's."""
    if args.backward != "ms_eden":
        return
    if nvidia := sorted(set(args.disable) & NVIDIA_SWITCHES):
        p.error(
            f"--disable {' '.join(nvidia)}: a switch of --backward nvidia (MS-EDEN's backward "
            "rounds no gradient stochastically and has no RHT)"
        )
    for pattern, switches in args.rules or ():
        nvidia = [
            f"{name}: {json.dumps(value)}"
            for name, value in switches or ()
            if (name in NVIDIA_SWITCHES and value is False)
            or (name == "gradient_four_over_six" and value is not None)
        ]
        if nvidia:
            p.error(
                f"--rules: the rule of {pattern} sets {', '.join(nvidia)}, which only --backward "
                "nvidia has (MS-EDEN's backward quantizes dy itself)"
            )


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parses and checks the command line; bad values exit with a message naming the flag."""
    p = build_parser() if parser is None else parser
    args = p.parse_args(argv)
    if args.width % args.heads:
        p.error(f"--heads {args.heads} must divide --width {args.width}")
    _check_moe_flags(p, args)
    _check_diagnostics_flags(p, args)
    _check_high_precision_flags(p, args)
    if args.bf16_first is None:
        # The default keeps at least one transformer block in NVFP4 (--bf16-last counts the
        # head as one): 0 where a bf16 first block would leave none.
        fits = DEFAULT_BF16_FIRST + max(args.bf16_last - 1, 0) < args.depth
        args.bf16_first = DEFAULT_BF16_FIRST if fits else 0
    if args.bf16_first + args.bf16_last > args.depth + 1:
        p.error(
            f"--bf16-first {args.bf16_first} plus --bf16-last {args.bf16_last} is more than the "
            f"{args.depth + 1} blocks of the model (--depth {args.depth} and the output head)"
        )
    defaults = {
        "eval_every": DEFAULT_INTERVAL,
        "save_every": DEFAULT_INTERVAL,
        "warmup": max(1, args.steps // 20),
        "stop_after": None,
    }
    for name, default in defaults.items():
        value = getattr(args, name)
        if value is None:
            setattr(args, name, None if default is None else min(default, args.steps))
        elif value > args.steps:
            p.error(f"--{name.replace('_', '-')} {value} is more than --steps {args.steps}")
    args.disable = sorted(set(args.disable))
    _check_four_over_six_flags(p, args)
    _check_backward_flags(p, args)
    size = text_size(args.data)
    longest = longest_seq_len(size)
    if args.seq_len > longest:
        source = args.data or "the default text"
        if longest < 1:
            p.error(
                f"--data {source} is too short to train on: {size} bytes, where --seq-len "
                f"{args.seq_len} needs about {10 * (args.seq_len + 2):,}"
            )
        p.error(
            f"--seq-len {args.seq_len} is too long for {source} ({size:,} bytes): its 10% "
            f"validation part needs seq_len + 2 bytes, so --seq-len can be at most {longest:,}"
        )
    if (problem := check_model_shape(args)) is not None:
        p.error(
            f"--width {args.width} --heads {args.heads} --depth {args.depth} --seq-len "
            f"{args.seq_len} make no working model: {problem}"
        )
    return args


@functools.cache
def _default_text() -> bytes:
    """The Python documentation topics of this CPython install, as UTF-8."""
    from pydoc_data.topics import topics  # noqa: PLC0415

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def text_size(path: pathlib.Path | None) -> int:
    """The length in bytes of the training text."""
    return len(_default_text()) if path is None else path.stat().st_size


def _split_point(size: int) -> int:
    """Where the 90/10 train/validation split cuts a text of `size` bytes."""
    return int(0.9 * size)


def longest_seq_len(size: int) -> int:
    """The longest --seq-len for which both parts of a `size`-byte text hold one sequence."""
    cut = _split_point(size)
    return min(cut, size - cut) - 2


def load_text(path: pathlib.Path | None) -> np.ndarray:
    """Returns the training text as uint8 bytes."""
    data = _default_text() if path is None else path.read_bytes()
    return np.frombuffer(data, dtype=np.uint8)


def split_text(data: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits 90/10 into train and validation; each must hold at least one sequence."""
    cut = _split_point(len(data))
    train, val = data[:cut], data[cut:]
    if min(len(train), len(val)) <= seq_len + 1:
        raise ValueError(
            f"the text ({len(data)} bytes) is too short for --seq-len {seq_len}: each of the "
            f"train ({len(train)}) and validation ({len(val)}) parts needs {seq_len + 2} bytes"
        )
    return train, val


def batch_at(data: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> jax.Array:
    """The batch of step `step`: a pure function of (seed, step), so runs and resumes agree."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    return jnp.asarray(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32))


def four_over_six_fields(args) -> dict:
    """The `NVFP4Recipe` Four Over Six fields --four-over-six and its options ask for."""
    classes = getattr(args, "four_over_six", [])
    error = getattr(args, "four_over_six_error", "mse")
    return {
        f"{kind}_four_over_six": error if kind in classes else None
        for kind in FOUR_OVER_SIX_CLASSES
    } | {"four_over_six_e4m3_max": getattr(args, "four_over_six_e4m3_max", 256)}


def _backward(args) -> dict:
    """The `NVFP4Recipe.backward` field --backward asks for."""
    # Arguments without the flag predate it: NVIDIA's backward, as RESUME_DEFAULTS says.
    return dict(backward=getattr(args, "backward", RESUME_DEFAULTS["backward"]))


def nvfp4_recipe(args) -> nvfp4_jax.NVFP4Recipe:
    """The NVFP4 training recipe, all switches on but those `--disable` names, with Four Over
    Six on the operand classes --four-over-six names."""
    return nvfp4_jax.NVFP4Recipe(
        **{name: False for name in args.disable}, **four_over_six_fields(args), **_backward(args)
    )


def model_config(args, recipe_name: str) -> LMConfig:
    """The model shape the flags ask for: plain layers, quantized afterwards by rules."""
    del recipe_name
    return LMConfig(
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        max_len=args.seq_len,
        experts=getattr(args, "experts", 0),
        top_k=getattr(args, "top_k", DEFAULT_TOP_K),
        expert_intermediate=getattr(args, "expert_intermediate", None),
        router_aux_loss_coef=getattr(args, "aux_loss_coef", DEFAULT_AUX_LOSS_COEF),
    )


def model_rules(args) -> list[nvfp4_jax.Rule]:
    """The rules of the NVFP4 run (first match wins): the flags' bf16 layers, then --rules,
    then every other linear layer in NVFP4. The output head counts as the last block."""
    recipe = nvfp4_recipe(args)
    keep = list(args.keep_bf16)
    layers = [*range(args.bf16_first), *range(args.depth + 1 - args.bf16_last, args.depth)]
    if layers:
        keep.append(f"^layers/({'|'.join(str(i) for i in layers)})/")
    if args.bf16_last:
        keep.append("^lm_head$")
    rules = [nvfp4_jax.Rule(pattern, None) for pattern in keep]
    for pattern, switches in args.rules or ():
        rules.append(
            nvfp4_jax.Rule(
                pattern,
                None
                if switches is None
                else nvfp4_jax.NVFP4Recipe(
                    **(four_over_six_fields(args) | _backward(args) | dict(switches))
                ),
            )
        )
    return [*rules, nvfp4_jax.Rule(".*", recipe)]


def high_precision_steps(args) -> int:
    """How many of the last steps the NVFP4 run takes in high precision (--high-precision-final)."""
    return int(math.floor(args.high_precision_final * args.steps + 0.5))


def switch_step(args) -> int | None:
    """The last step of the NVFP4 run in NVFP4 before --high-precision-final switches; None
    when it never switches. Steps after it run with `switched_rules`."""
    final = high_precision_steps(args)
    return args.steps - final if final else None


def in_high_precision(recipe_name: str, args, step: int) -> bool:
    """Whether step `step` of a recipe's run takes the --high-precision-final recipe: the
    NVFP4 run's steps after `switch_step` (step 0: the start).

    The one place that decides a run's phase. A checkpoint of step `step` holds the state that
    step's recipe left (its SR streams too): a resumed run takes the recipe of its
    checkpoint's step, and any run switches before the first step of the other phase.
    """
    switch = switch_step(args) if recipe_name == "nvfp4" else None
    return switch is not None and step > switch


def switched_rules(rules, gemms: str) -> list[nvfp4_jax.Rule]:
    """`rules` with the GEMMs `gemms` names (--high-precision-final-gemms) in high precision in
    every NVFP4 recipe; the rules of high-precision layers stay as they are."""
    off = {name: False for name in HIGH_PRECISION_GEMMS[gemms]}
    return [
        rule
        if rule.recipe is None
        else nvfp4_jax.Rule(rule.pattern, dataclasses.replace(rule.recipe, **off))
        for rule in rules
    ]


def switch_precision(model, args, rules) -> None:
    """Puts the NVFP4 run's model in its --high-precision-final recipe, in place.

    `quantize_model` with `switched_rules`: the parameter variables stay the same objects (the
    optimizer state is unaffected); the NVFP4 linear layers get the switched recipe and fresh
    stochastic-rounding streams forked from a key of the seed and the switch step (an
    `Experts` layer keeps its stream), so that a resumed run (which restores those streams
    from its checkpoint) and an uninterrupted one take the same steps. Call it once per run:
    `quantize_model` leaves a layer already in its switched recipe as it is, streams and all.
    """
    key = jax.random.fold_in(jax.random.key(_sr_seed(args, switch=True)), switch_step(args))
    nvfp4_jax.quantize_model(
        model, switched_rules(rules, args.high_precision_final_gemms), rngs=nnx.Rngs(quantize=key)
    )


def finish_at_run_time(recipe_name: str, args) -> bool:
    """Whether the run's high-precision finish is a runtime flag of its compiled step
    (`CompiledRun`): an NVFP4 run that switches its forward GEMMs alone."""
    return (
        recipe_name == "nvfp4"
        and switch_step(args) is not None
        and args.high_precision_final_gemms == "fprop"
    )


def switch_streams(model, args, rules) -> None:
    """Gives `model` the SR streams `switch_precision` gives, its recipes unchanged: the
    switch of a run whose finish is a runtime flag (`finish_at_run_time`)."""
    switched = nnx.clone(model)
    switch_precision(switched, args, rules)
    nnx.update(model, nnx.state(switched, nnx.RngState))


def check_model_shape(args) -> str | None:
    """Why the flags make no working model (None if they do): builds it and traces the loss of
    one sequence abstractly (no memory, no compile), so any shape rule of `lm_model` counts."""
    try:
        cfg = model_config(args, "bf16")
        tokens = jnp.zeros((1, args.seq_len + 1), jnp.int32)
        nnx.eval_shape(lambda: loss_fn(TransformerLM(cfg, nnx.Rngs(0)), tokens))
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def make_model(args, recipe_name: str, rules=None) -> TransformerLM:
    """The model of one recipe; parameters come from the seed alone, so both runs start equal.

    The NVFP4 run is the same model with its `nnx.Linear` layers turned into NVFP4 ones by
    `rules` (default: `model_rules(args)`) through `nvfp4_jax.quantize_model`.
    """
    model = TransformerLM(model_config(args, recipe_name), nnx.Rngs(params=args.seed))
    if recipe_name == "nvfp4":
        rules = model_rules(args) if rules is None else rules
        nvfp4_jax.quantize_model(model, rules, rngs=nnx.Rngs(quantize=_sr_seed(args)))
    return model


def _sr_seed(args, switch: bool = False) -> int:
    """The seed of the NVFP4 layers' SR streams: from --seed (seed + 1 at the start, seed at
    the --high-precision-final switch), or --sr-seed S (S, and S + 1 at the switch)."""
    sr_seed = getattr(args, "sr_seed", None)
    if sr_seed is None:
        return args.seed if switch else args.seed + 1
    return sr_seed + 1 if switch else sr_seed


def write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file beside it: a run killed while writing
    leaves the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def diagnose(args, train, out: pathlib.Path, console: Console) -> list[nvfp4_jax.Rule]:
    """Runs `nvfp4_jax.inspect_model` on the first batch with the NVFP4 run's rules, writes
    `diagnostics.json` and `diagnostics.png`, prints the worst layers, and returns the rules
    to train with (with the diagnostics' suggestion when --suggest-share asks for it)."""
    rules = model_rules(args)
    model = make_model(args, "bf16")
    batch = batch_at(train, 0, args.batch, args.seq_len, args.seed)
    report = nvfp4_jax.inspect_model(model, batch, loss_fn=loss_fn, rules=rules, key=args.seed)
    write_atomically(out / "diagnostics.json", report.to_json())
    report.plot(out / "diagnostics.png")
    worst = sorted(report.scores().items(), key=lambda kv: -kv[1])[:3]
    console.print(
        "diagnostics (weight-gradient angle, degrees): "
        + ", ".join(f"{path} {score:.1f}" for path, score in worst),
        markup=False,
    )
    if args.suggest_share:
        rules = report.suggest_rules(share=args.suggest_share)
        kept = [r.pattern for r in rules if r.recipe is None]
        console.print(f"kept in bf16 by the diagnostics: {kept}", markup=False)
    return rules


def lr_schedule(peak: float, steps: int, warmup: int) -> optax.Schedule:
    """Linear warm-up to `peak`, then cosine decay to `peak / 10` at the last of `steps` updates.

    The schedule maps optax's 0-based update count c to the rate of update n = c + 1: n / warmup
    of the peak during the warm-up (the first update already moves, the warm-up's last one is at
    the peak), then a cosine from the peak that reaches peak / 10 at update `steps`. Defined for
    every steps >= 1 and warmup >= 0; a warm-up as long as the run, or longer, is all ramp.
    """
    final = peak / 10
    decay = steps - warmup

    def schedule(count):
        n = jnp.asarray(count, jnp.float32) + 1
        ramp = peak * jnp.minimum(n / max(warmup, 1), 1.0)
        if decay <= 0:
            return ramp
        progress = jnp.clip((n - warmup) / decay, 0.0, 1.0)
        cosine = final + (peak - final) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(n <= warmup, ramp, cosine)

    return schedule


@functools.cache
def adamw(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
    """AdamW on `lr_schedule`, gradients clipped to global norm 1.

    Cached: the optimizer's graph holds this object and `nnx.jit` caches on that graph, so runs
    with the same schedule in one process (a test session) share their compiled steps.
    """
    schedule = lr_schedule(lr, steps, warmup)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


def make_optimizer(model, args) -> nnx.Optimizer:
    """AdamW with linear warm-up and cosine decay."""
    return nnx.Optimizer(model, adamw(args.lr, args.steps, args.warmup), wrt=nnx.Param)


def _loss_and_grads(model, batch):
    """(cross-entropy, load-balancing loss, the objective's gradients): `train_loss_fn`, with
    experts the cross-entropy plus `--aux-loss-coef` times the load-balancing loss."""
    (_, (loss, aux)), grads = nnx.value_and_grad(train_loss_fn, has_aux=True)(model, batch)
    return loss, aux, grads


def _mean_loss(model, batches):
    """The mean loss over a stack of batches (no gradients, so no SR randomness)."""
    return loss_fn(model, batches.reshape(-1, batches.shape[-1]))


@nnx.jit
def train_step(model, optimizer, batch):
    """One optimizer step; returns the cross-entropy and the MoE's load-balancing loss (0 for
    a dense model), both before the update (`_loss_and_grads`)."""
    loss, aux, grads = _loss_and_grads(model, batch)
    optimizer.update(model, grads)
    return loss, aux


@nnx.jit
def eval_loss(model, batches):
    """Mean validation loss over a stack of batches (no gradients, so no SR randomness)."""
    return _mean_loss(model, batches)


def _gradients(graph, state, batch):
    """`_loss_and_grads` of the model (`graph`, `state`), and its state after them (its SR
    streams advanced)."""
    model = nnx.merge(graph, state)
    return *_loss_and_grads(model, batch), nnx.state(model)


def _in_phase(finish, fn, *operands):
    """`fn(*operands)`, under `nvfp4_jax.high_precision_forward(finish)` unless it is None."""
    if finish is None:
        return fn(*operands)
    with nvfp4_jax.high_precision_forward(finish):
        return fn(*operands)


@functools.partial(jax.jit, static_argnums=0)
def _compiled_train_step(graphs, state, opt_state, batch, finish):
    """`train_step` on split state: (loss, aux, the model's and the optimizer's new state).

    `graphs`: the model's and the optimizer's graphs; `finish`: None, or a bool scalar that
    puts the NVFP4 forward GEMMs in high precision at run time (the finish's program is the
    NVFP4 phase's).
    """
    loss, aux, grads, state = _in_phase(finish, _gradients, graphs[0], state, batch)
    model, optimizer = nnx.merge(graphs[0], state), nnx.merge(graphs[1], opt_state)
    optimizer.update(model, grads)
    return loss, aux, nnx.state(model), nnx.state(optimizer)


def _evaluation(graph, state, batches):
    """`eval_loss` of the model (`graph`, `state`), and the model's state after it."""
    model = nnx.merge(graph, state)
    return _mean_loss(model, batches), nnx.state(model)


@functools.partial(jax.jit, static_argnums=0)
def _compiled_eval_loss(graph, state, batches, finish):
    """`eval_loss` on split state: (the loss, the model's new state)."""
    return _in_phase(finish, _evaluation, graph, state, batches)


def _split_committed(node):
    """`nnx.split(node)` with every array of the state committed to the device it is on.

    A restored checkpoint's arrays are committed and a new model's are not, and jit compiles
    one program per kind of placement: the same placement for both lets a resumed run (and
    the switch of one, whose fresh SR streams meet restored arrays) reuse the step compiled
    for a new run, in this process and in the persistent compilation cache.
    """
    graph, state = nnx.split(node)
    return graph, jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)


class CompiledRun:
    """One run's train step and evaluation, split state in and out, each compiled once.

    The model and optimizer are split once into their graphs and state; the state goes through
    the compiled functions step after step and back into the objects by `sync` (before a
    checkpoint, the switch and the end of the run).

    A run whose high-precision finish puts only the forward GEMMs in high precision (`--high-
    precision-final-gemms fprop`, the default) passes `finish`: a flag the compiled step and
    evaluation take as an argument (`nvfp4_jax.high_precision_forward`), so the switch
    (`switch_streams`) compiles nothing and its steps are bit for bit those of the model
    switched by `switch_precision` and compiled anew (tests/integration/test_train_lm.py).
    With `--high-precision-final-gemms all` the backward's residuals change with the recipe:
    that run switches its graph by `switch` and compiles again.

    Args:
      model: the model, in the recipe of the step the run starts from.
      optimizer: its optimizer.
      finish: None (no runtime switch), or whether the run starts in its finish.
    """

    def __init__(self, model, optimizer, finish: bool | None = None):
        self.model, self.optimizer = model, optimizer
        self.graph, self.state = _split_committed(model)
        self.opt_graph, self.opt_state = _split_committed(optimizer)
        self.finish = None if finish is None else np.bool_(finish)

    def _step_args(self, batch) -> tuple:
        return (self.graph, self.opt_graph), self.state, self.opt_state, batch, self.finish

    def step(self, batch) -> tuple[jax.Array, jax.Array]:
        """One optimizer step (`train_step`): (loss, load-balancing loss) before the update."""
        loss, aux, self.state, self.opt_state = _compiled_train_step(*self._step_args(batch))
        return loss, aux

    def lower(self, batch):
        """The train step `step` runs, lowered for `batch` (`jax.stages.Lowered`)."""
        return _compiled_train_step.lower(*self._step_args(batch))

    @staticmethod
    def programs() -> int:
        """How many train-step programs this process has compiled (every run's)."""
        return _compiled_train_step._cache_size()

    def eval_loss(self, batches) -> jax.Array:
        """The mean validation loss over a stack of batches (`eval_loss`)."""
        loss, self.state = _compiled_eval_loss(self.graph, self.state, batches, self.finish)
        return loss

    def sync(self) -> None:
        """Writes the run's state into the model and optimizer objects."""
        nnx.update(self.model, self.state)
        nnx.update(self.optimizer, self.opt_state)

    def switch(self, change) -> None:
        """Calls `change(model)` on the synced model (`switch_precision`, or with `finish`,
        `switch_streams`) and goes on from the model's state (and graph) after it; with
        `finish`, the finish starts."""
        self.sync()
        change(self.model)
        self.graph, self.state = _split_committed(self.model)
        if self.finish is not None:
            self.finish = np.bool_(True)


def _savable(state):
    """Typed PRNG keys -> raw uint32 data, for orbax."""
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        state,
    )


def _unsavable(saved, like):
    """Inverse of `_savable`, using the current state to know which leaves are keys."""
    return jax.tree.map(
        lambda s, x: (
            jax.random.wrap_key_data(s) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else s
        ),
        saved,
        like,
    )


class Checkpoints:
    """Orbax checkpoints of one run: model and optimizer state, loss history and run config."""

    def __init__(self, folder: pathlib.Path, every: int = 0, create: bool = True):
        self.folder = folder
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=create)
        self.manager = ocp.CheckpointManager(folder.resolve(), options=options)

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint, None when there is none."""
        return self.manager.latest_step()

    def clear(self) -> list[int]:
        """Deletes every checkpoint (a new run replaces an earlier one's); returns their steps."""
        steps = sorted(self.manager.all_steps())
        for step in steps:
            self.manager.delete(step)
        return steps

    def config(self, step: int) -> dict | None:
        """The run config saved with checkpoint `step` (`run_config`); None if it has none."""
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
            )
        except KeyError:
            return None
        return restored["config"]

    def due(self, step: int, force: bool = False) -> bool:
        """Whether the run saves at `step`: at multiples of `every`, and when `force`."""
        return force or bool(self.every and step % self.every == 0)

    def save(self, step: int, model, optimizer, history: dict, config: dict):
        """Saves the model and optimizer state, the history and the config as `step`."""
        state = _savable({"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                history=ocp.args.JsonSave(history),
                config=ocp.args.JsonSave(config),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, model, optimizer) -> tuple[int, dict] | None:
        """Loads the latest checkpoint into model/optimizer; returns (step, history) or None."""
        step = self.manager.latest_step()
        if step is None:
            return None
        like = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _savable(like))
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()
            ),
        )
        state = _unsavable(restored["state"], like)
        nnx.update(model, state["model"])
        nnx.update(optimizer, state["optimizer"])
        return step, restored["history"]


def checkpoint_folder(args, recipe_name: str) -> pathlib.Path:
    """Where the checkpoints of one recipe's run live."""
    return args.out / "checkpoints" / recipe_name


# The NVFP4 checkpoints' config holds, under this name, the rules the run trains with (the
# flags' rules, or the diagnostics' suggestion with --suggest-share): a resumed run takes
# them from there instead of running the diagnostics again.
TRAINED_RULES = "trained_rules"


def saved_config(config: dict, recipe_name: str, args, rules=None) -> dict:
    """What one recipe's checkpoints save besides its state: the run config, and for the
    NVFP4 run the rules it trains with (`rules`, default `model_rules(args)`)."""
    if recipe_name != "nvfp4":
        return config
    rules = model_rules(args) if rules is None else rules
    return {**config, TRAINED_RULES: [rule.to_dict() for rule in rules]}


def trained_rules(saved: dict | None) -> list[nvfp4_jax.Rule] | None:
    """The rules saved in an NVFP4 checkpoint's config (`saved_config`), or None: no such
    checkpoint, or one saved before the rules were."""
    rules = None if saved is None else saved.get(TRAINED_RULES)
    return None if rules is None else [nvfp4_jax.Rule.from_dict(rule) for rule in rules]


def run_config(args, text: np.ndarray) -> dict:
    """What a resumed run must share with its checkpoint: `RESUME_FLAGS` and the text itself."""
    config = {name: getattr(args, name) for name in RESUME_FLAGS}
    config["text"] = {"bytes": int(text.size), "crc32": zlib.crc32(text)}
    return json.loads(json.dumps(config))  # as the checkpoint stores it (tuples become lists)


def _config_change(key: str, saved, now) -> str:
    """One difference between a checkpoint's config and the command line, in flag terms."""
    if key == "text":
        return "another text (--data)"
    if isinstance(saved, list):
        saved, now = (" ".join(v) or "nothing" for v in (saved, now))
    return f"--{key.replace('_', '-')} {saved} (now {now})"


def check_resume(args, names: tuple[str, ...], config: dict) -> dict[str, dict]:
    """--resume needs a checkpoint made with the same flags and not past --stop-after.

    Returns the config saved with each recipe's latest checkpoint (recipes without one left
    out)."""
    found = {}
    for name in names:
        if checkpoint_folder(args, name).is_dir():
            checkpoints = Checkpoints(checkpoint_folder(args, name), create=False)
            if (step := checkpoints.latest_step()) is not None:
                found[name] = (checkpoints, step)
    if not found:
        raise UsageError(
            f"--resume: {args.out / 'checkpoints'} holds no checkpoint of the "
            f"{' or '.join(names)} run; leave out --resume to start a new run"
        )
    configs = {}
    for name, (checkpoints, step) in found.items():
        saved = configs[name] = checkpoints.config(step)
        if saved is None:
            raise UsageError(
                f"--resume: the {name} checkpoint in {checkpoints.folder} does not record the "
                "flags it was made with (an older version of this script); start a new run"
            )
        saved = {**RESUME_DEFAULTS, **saved}
        changes = [
            _config_change(k, saved.get(k), v) for k, v in config.items() if saved.get(k) != v
        ]
        if changes:
            raise UsageError(
                f"--resume: the {name} checkpoint (step {step}) was made with "
                f"{'; '.join(changes)}. Resume with its flags, or start a new run without --resume"
            )
        if args.stop_after is not None and args.stop_after < step:
            raise UsageError(
                f"--stop-after {args.stop_after} is before step {step}, which the {name} "
                "checkpoint has already reached"
            )
    return configs


def _say(console: Console, recipe_name: str, text: str) -> None:
    """Prints a line about one recipe's run (no rich markup: `[nvfp4]` is not a style)."""
    console.print(f"[{recipe_name}] {text}", markup=False, highlight=False)


def start(recipe_name: str, args, model, optimizer, checkpoints, console) -> tuple[int, dict]:
    """Restores the checkpoint (--resume) or clears an earlier run's; returns (step, history)."""
    history = {"step": [], "train_loss": [], "val_step": [], "val_loss": [], "seconds": 0.0}
    if not args.resume:
        if replaced := checkpoints.clear():
            _say(
                console,
                recipe_name,
                f"new run: deleted the checkpoints of an earlier run (up to step {replaced[-1]}) "
                f"in {checkpoints.folder}; --resume would have continued it",
            )
        return 0, history
    restored = checkpoints.restore(model, optimizer)
    if restored is None:
        _say(console, recipe_name, "no checkpoint to resume from: starting at step 1")
        return 0, history
    step, history = restored
    if step >= args.steps:
        _say(
            console,
            recipe_name,
            f"the run already finished at step {step} (--steps {args.steps}): "
            "nothing left to train",
        )
    else:
        _say(console, recipe_name, f"resumed from step {step}")
    return step, history


def _resume_phase(recipe_name: str, args, model, rules, checkpoints) -> bool:
    """Puts the model in the recipe of the step the run continues from (`in_high_precision`),
    before --resume restores the checkpoint into it; returns whether it switched.

    A checkpoint of the switch step itself holds the NVFP4 phase's state: the run switches
    after restoring it, before the next step, as an uninterrupted run does.
    """
    step = (checkpoints.latest_step() or 0) if args.resume else 0
    if not in_high_precision(recipe_name, args, step):
        return False
    if not finish_at_run_time(recipe_name, args):  # else the restored streams are the finish's
        switch_precision(model, args, rules)
    return True


def run(recipe_name: str, args, train, val, config: dict, console: Console, rules=None) -> dict:
    """Trains one recipe; returns its history of train and validation losses."""
    rules = model_rules(args) if recipe_name == "nvfp4" and rules is None else rules
    model = make_model(args, recipe_name, rules)
    optimizer = make_optimizer(model, args)
    checkpoints = Checkpoints(checkpoint_folder(args, recipe_name), args.save_every)
    switched = _resume_phase(recipe_name, args, model, rules, checkpoints)
    start_step, history = start(recipe_name, args, model, optimizer, checkpoints, console)
    last = args.steps if args.stop_after is None else args.stop_after
    if start_step >= last:
        return history
    val_batches = jnp.stack(
        [batch_at(val, 10**9 + i, args.batch, args.seq_len, args.seed) for i in range(EVAL_BATCHES)]
    )
    # The state split once, not at every call: nnx.jit's per-call graph traversal costs
    # milliseconds, more for NVFP4 layers (their quantization RNG state).
    at_run_time = finish_at_run_time(recipe_name, args)
    steps = CompiledRun(model, optimizer, finish=switched if at_run_time else None)
    step_seconds = []  # the train steps alone (no evaluation, no checkpoint), this session
    columns = (TextColumn(f"{recipe_name:>5s}"), BarColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("", total=args.steps, completed=start_step, info="compiling")
        tick = time.perf_counter()
        for step in range(start_step + 1, last + 1):
            if not switched and in_high_precision(recipe_name, args, step):
                change = switch_streams if at_run_time else switch_precision
                steps.switch(lambda m, change=change: change(m, args, rules))
                switched = True
                history["high_precision_from"] = step
                _say(
                    console,
                    recipe_name,
                    f"step {step}: {args.high_precision_final_gemms} GEMMs in high precision "
                    "from here on (--high-precision-final)",
                )
            batch = batch_at(train, step, args.batch, args.seq_len, args.seed)
            begin = time.perf_counter()
            loss, aux = steps.step(batch)
            loss = float(loss)
            step_seconds.append(time.perf_counter() - begin)
            history["step"].append(step)
            history["train_loss"].append(loss)
            if args.experts:
                history.setdefault("aux_loss", []).append(float(aux))
            if step % args.eval_every == 0 or step == args.steps:
                history["val_step"].append(step)
                history["val_loss"].append(float(steps.eval_loss(val_batches)))
            now = time.perf_counter()
            history["seconds"] += now - tick
            tokens_per_s = args.batch * args.seq_len / max(now - tick, 1e-9)
            tick = now
            val_text = f" val {history['val_loss'][-1]:.3f}" if history["val_loss"] else ""
            progress.update(
                task, advance=1, info=f"loss {loss:.3f}{val_text} {tokens_per_s:,.0f} tok/s"
            )
            if not all(map(math.isfinite, [loss, *history["val_loss"][-1:]])):
                history["diverged_at"] = step
                break
            if step == last:
                # The first step compiles; the steady state is the median of the others.
                history["first_step_seconds"] = step_seconds[0]
                history["step_ms"] = 1e3 * float(np.median(step_seconds[1:] or step_seconds))
            if checkpoints.due(step, force=step == last):
                steps.sync()
                checkpoints.save(step, model, optimizer, history, config)
    steps.sync()
    if "diverged_at" in history:
        _say(
            console,
            recipe_name,
            f"the loss is not finite at step {history['diverged_at']}: training diverged, "
            "this run stops here (a smaller --lr may help)",
        )
    return history


def _final(history: dict, tail: int) -> dict:
    """The final losses of one history (None where it has none)."""
    train = history["train_loss"][-tail:]
    final = {
        "final_train_loss": float(np.mean(train)) if train else None,
        "final_val_loss": history["val_loss"][-1] if history["val_loss"] else None,
        "seconds": history["seconds"],
        "step_ms": history.get("step_ms"),
        "first_step_seconds": history.get("first_step_seconds"),
        "diverged_at": history.get("diverged_at"),
    }
    if "aux_loss" in history:  # a mixture of experts: its load-balancing loss, apart
        aux = history["aux_loss"][-tail:]
        final["final_aux_loss"] = float(np.mean(aux)) if aux else None
    return final


def _gap(val: float | None, base: float | None) -> float | None:
    """The relative validation-loss gap to bf16, None where either loss is missing or bad."""
    if val is None or base is None or not (math.isfinite(val) and math.isfinite(base)) or not base:
        return None
    return (val - base) / base


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def summarize(histories: dict, args, console: Console) -> dict:
    """Prints the final-loss table; returns the numbers written to results.json."""
    tail = max(1, min(20, args.steps // 10))
    rows = {name: _final(h, tail) for name, h in histories.items()}
    diverged = {name: r["diverged_at"] for name, r in rows.items() if r["diverged_at"]}
    table = Table(
        title=f"after {args.steps} steps (train loss: mean of the last {tail})",
        caption="; ".join(f"{name} diverged at step {step}" for name, step in diverged.items())
        or None,
    )
    moe = bool(args.experts)
    columns = ("recipe", "train loss", "val loss", "val gap vs bf16", "time (s)", "ms/step")
    if moe:  # the load-balancing loss, apart from the cross-entropy (1: a uniform router)
        columns = (*columns[:2], "aux loss", *columns[2:])
    for column in columns:
        table.add_column(column, justify="right")
    base = rows.get("bf16", {}).get("final_val_loss")
    for name, r in rows.items():
        r["relative_val_gap"] = gap = _gap(r["final_val_loss"], base)
        cells = [
            f"{name} (diverged)" if name in diverged else name,
            _number(r["final_train_loss"]),
            *([_number(r.get("final_aux_loss"))] if moe else []),
            _number(r["final_val_loss"]),
            "-" if gap is None else f"{100 * gap:+.2f}%",
            f"{r['seconds']:.0f}",
            "-" if r["step_ms"] is None else f"{r['step_ms']:.0f}",
        ]
        table.add_row(*cells)
    console.print(table)
    return rows


def _json_safe(value):
    """`value` with NaN and infinities (a diverged run's losses) as None, for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def relative_gaps(histories: dict) -> tuple[list[int], list[float]] | None:
    """(steps, NVFP4's relative validation gap in %) where both runs were evaluated, or None."""
    if not {"nvfp4", "bf16"} <= histories.keys():
        return None
    base = dict(zip(histories["bf16"]["val_step"], histories["bf16"]["val_loss"], strict=True))
    points = [
        (step, 100 * (loss - base[step]) / base[step])
        for step, loss in zip(
            histories["nvfp4"]["val_step"], histories["nvfp4"]["val_loss"], strict=True
        )
        if step in base and math.isfinite(loss) and math.isfinite(base[step]) and base[step]
    ]
    if not points:
        return None
    steps, gaps = zip(*points, strict=True)
    return list(steps), list(gaps)


def plot(histories: dict, path: pathlib.Path) -> None:
    """Writes both recipes' train and validation loss curves to a PNG, and beside them
    NVFP4's relative validation gap when both recipes ran."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    gap = relative_gaps(histories)
    fig, axes = plt.subplots(1, 2 if gap else 1, figsize=(12 if gap else 7, 4.5), squeeze=False)
    ax = axes[0, 0]
    for (name, h), color in zip(histories.items(), ("tab:red", "tab:blue"), strict=False):
        ax.plot(h["step"], h["train_loss"], color=color, alpha=0.3, lw=1)
        ax.plot(h["val_step"], h["val_loss"], color=color, marker="o", label=f"{name} validation")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="byte-level LM: NVFP4 vs bf16")
    ax.grid(alpha=0.3)
    ax.legend()
    if gap:
        # The two curves lie close together: the gap itself, on its own scale.
        ax = axes[0, 1]
        ax.plot(*gap, color="tab:red", marker="o")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set(
            xlabel="step",
            ylabel="(val_nvfp4 - val_bf16) / val_bf16 (%)",
            title="NVFP4's relative validation-loss gap",
        )
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def use_compile_cache(choice: pathlib.Path | str | None) -> None:
    """Points JAX's persistent compilation cache at `--compile-cache` (every program, however
    fast it compiled), leaves one configured already (JAX_COMPILATION_CACHE_DIR) as it is, or
    turns it off ("none"). A program loaded from the cache is the compiled one, bit for bit.
    """
    if choice == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if choice is None:
        if jax.config.jax_compilation_cache_dir:
            return
        choice = DEFAULT_COMPILE_CACHE
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(choice))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv=None) -> dict:
    """Runs the recipes the flags ask for and writes the table, plot and JSON."""
    parser = build_parser()
    args = parse_args(argv, parser)
    use_compile_cache(args.compile_cache)
    try:
        return train_and_report(args)
    except UsageError as error:
        parser.error(str(error))


def load_data(args) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole text and its train and validation parts; problems raise `UsageError`."""
    try:
        text = load_text(args.data)
    except OSError as error:
        raise UsageError(
            f"--data {args.data}: cannot read it ({error.strerror or error})"
        ) from None
    try:
        train, val = split_text(text, args.seq_len)
    except ValueError as error:  # the file shrank since parse_args looked at it
        raise UsageError(str(error)) from None
    return text, train, val


def train_and_report(args) -> dict:
    """`main` after parsing: checks the checkpoints, trains, writes the results."""
    console = Console()
    text, train, val = load_data(args)
    names = RECIPES if args.recipe == "both" else (args.recipe,)
    config = run_config(args, text)
    saved = check_resume(args, names, config) if args.resume else {}
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"--out {args.out}: cannot create it ({error.strerror or error})"
        ) from None
    console.print(
        f"nvfp4_jax {nvfp4_jax.__version__} on {jax.default_backend()}: {len(train):,} train / "
        f"{len(val):,} validation bytes; width {args.width}, depth {args.depth}, "
        f"batch {args.batch}x{args.seq_len}, {args.steps} steps",
        markup=False,
    )
    if args.experts:
        cfg = model_config(args, "bf16")
        console.print(
            f"mixture of experts: {cfg.experts} experts of MLP size {cfg.expert_intermediate}, "
            f"top-{cfg.top_k}, load-balancing loss weight {cfg.router_aux_loss_coef}",
            markup=False,
        )
    rules = None
    if "nvfp4" in names:
        # A resumed run trains with its checkpoint's rules; its diagnostics are the first
        # part's (the same flags, so the same model, batch and rules: the same report).
        rules = trained_rules(saved.get("nvfp4"))
        if rules is None and args.diagnostics:
            rules = diagnose(args, train, args.out, console)
        elif rules is None:
            rules = model_rules(args)
        else:
            console.print(
                f"diagnostics: those of the run's start ({args.out / 'diagnostics.json'}); "
                "the NVFP4 run resumes with its checkpoint's rules",
                markup=False,
            )
    histories = {
        name: run(name, args, train, val, saved_config(config, name, args, rules), console, rules)
        for name in names
    }
    if args.stop_after is not None and args.stop_after < args.steps:
        console.print(f"stopped after step {args.stop_after}; continue with --resume")
        return {"histories": histories}
    rows = summarize(histories, args, console)
    flags = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    flags["rules"] = [[r.pattern, None if r.recipe is None else str(r.recipe)] for r in rules or []]
    results = {"config": flags, "results": rows, "histories": histories}
    write_atomically(
        args.out / "results.json", json.dumps(_json_safe(results), indent=1, allow_nan=False)
    )
    plot(histories, args.out / "curves.png")
    console.print(f"wrote {args.out / 'results.json'} and {args.out / 'curves.png'}", markup=False)
    return results


if __name__ == "__main__":
    main()
