"""Post-training quantization of a bf16 run of train_lm.py: validation loss per PTQ method.

    python examples/train_lm.py --recipe bf16 --out runs/bf16      # train in bf16 (~1 min)
    python examples/ptq_lm.py --from runs/bf16                      # quantize it 16 ways

Rebuilds the bf16 model of a `train_lm.py` output folder from its latest checkpoint
(`FOLDER/checkpoints/bf16`, the flags it was trained with read from the checkpoint), takes
`--calib-batches` batches of the training split (the run's first training batches) and, for
each rule set, method and mode, freezes the model with `nvfp4_jax.ptq.quantize_for_export`
and measures the validation loss with `train_lm.eval_loss` on the validation batches the run
was evaluated on. Prints a table (val loss, gap vs bf16) and writes a JSON (`--out`, default
`FOLDER/ptq.json`, replaced atomically) with every run's per-layer report.

Rule sets: "default" keeps what the exporter keeps by default (the embeddings and lm_head)
in bf16 and quantizes every other linear; "last-bf16" keeps the last block in bf16 too.
Modes: "w4a16" (weight-only) and "w4a4" (activations quantized with a static scale
calibrated by max). Every flag is checked before anything runs: a bad value exits with
status 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time
import zlib

import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_lm

import nvfp4_jax
from nvfp4_jax import ptq

MODES = {"w4a16": "high_precision", "w4a4": "nvfp4"}
RULE_SETS = ("default", "last-bf16")
DEFAULT_CALIB_BATCHES = 8
# The run flags that fix the model's shape, its batches and its optimizer (to restore it).
MODEL_FLAGS = ("steps", "batch", "seq_len", "width", "depth", "heads", "lr", "warmup", "seed")
MOE_FLAGS = ("experts", "top_k", "expert_intermediate", "aux_loss_coef")


class UsageError(Exception):
    """A problem with the run folder found after parsing; exits like argparse."""


def _run_folder(text: str) -> pathlib.Path:
    """An argparse `type`: a train_lm output folder holding a bf16 checkpoint."""
    path = pathlib.Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    folder = path / "checkpoints" / "bf16"
    if not folder.is_dir() or not any(p.name.isdigit() for p in folder.iterdir()):
        raise argparse.ArgumentTypeError(
            f"{text} holds no bf16 checkpoint ({folder}); train one with "
            f"`python examples/train_lm.py --recipe bf16 --out {text}`"
        )
    return path


def _json_file(text: str) -> pathlib.Path:
    """An argparse `type`: a file path whose folder exists and can be written."""
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    parent = path.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a writable folder")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--from",
        dest="source",
        type=_run_folder,
        required=True,
        help="a train_lm.py output folder with a bf16 run (checkpoints/bf16)",
    )
    p.add_argument(
        "--out", type=_json_file, default=None, help="the JSON (default FOLDER/ptq.json)"
    )
    p.add_argument(
        "--data",
        type=train_lm._text_file,
        default=None,
        help="the text the run was trained on (default: its results.json's, else pydoc's)",
    )
    p.add_argument(
        "--calib-batches",
        type=train_lm._integer(1, 1024),
        default=DEFAULT_CALIB_BATCHES,
        help=f"calibration batches from the training split (default {DEFAULT_CALIB_BATCHES})",
    )
    p.add_argument(
        "--methods", nargs="+", choices=ptq.METHODS, default=list(ptq.METHODS), help="PTQ methods"
    )
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument(
        "--rule-sets",
        nargs="+",
        choices=RULE_SETS,
        default=list(RULE_SETS),
        help="default: lm_head and embeddings in bf16; last-bf16: the last block too",
    )
    p.add_argument(
        "--weight-blocks",
        choices=("16x16", "1x16"),
        default="16x16",
        help="weight scale blocks (default 16x16, the exporter's)",
    )
    p.add_argument("--gptq-act-order", action="store_true", help="GPTQ in activation order")
    return p


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    p = parser or build_parser()
    args = p.parse_args(argv)
    for name in ("methods", "modes", "rule_sets"):
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    if args.out is None:
        args.out = args.source / "ptq.json"
    return args


def _checkpoints(args) -> train_lm.Checkpoints:
    return train_lm.Checkpoints(args.source / "checkpoints" / "bf16", create=False)


def run_args(args, console: Console) -> argparse.Namespace:
    """train_lm's arguments of the run: its flags from the checkpoint, its text checked."""
    checkpoints = _checkpoints(args)
    step = checkpoints.latest_step()
    config = checkpoints.config(step) if step is not None else None
    if not config:
        raise UsageError(f"--from {args.source}: the bf16 checkpoint records no run config")
    data = args.data
    results = args.source / "results.json"
    if data is None and results.is_file():
        saved = json.loads(results.read_text()).get("config", {}).get("data")
        data = pathlib.Path(saved) if saved else None
    argv = ["--recipe", "bf16"]
    for name in MODEL_FLAGS + (MOE_FLAGS if config.get("experts") else ()):
        if config.get(name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(config[name])]
    if data is not None:
        argv += ["--data", str(data)]
    try:
        targs = train_lm.parse_args(argv)
    except SystemExit:
        raise UsageError(f"--from {args.source}: its run config {config} does not parse") from None
    text = train_lm.load_text(targs.data)
    expected = config.get("text", {})
    if expected and (expected.get("bytes"), expected.get("crc32")) != (
        int(text.size),
        zlib.crc32(text),
    ):
        raise UsageError(
            f"--from {args.source}: the run was trained on another text ({expected}); pass "
            "--data with that text"
        )
    console.print(
        f"{args.source}: step {step}, width {targs.width}, depth {targs.depth}, batch "
        f"{targs.batch}x{targs.seq_len}",
        markup=False,
    )
    return targs


def load_model(args, targs):
    """The bf16 model restored from the run's latest checkpoint."""
    model = train_lm.make_model(targs, "bf16")
    optimizer = train_lm.make_optimizer(model, targs)
    if _checkpoints(args).restore(model, optimizer) is None:
        raise UsageError(f"--from {args.source}: no bf16 checkpoint to restore")
    return model


def rules_for(name: str, depth: int) -> list[nvfp4_jax.Rule]:
    """The rules of a rule set: the PTQ default (embeddings, head, routers in bf16), and for
    "last-bf16" the last block in bf16 too."""
    rules = nvfp4_jax.default_rules(0, first=0, last=0)
    if name == "last-bf16":
        rules = [*nvfp4_jax.keep_bf16(rf"^layers/{depth - 1}/"), *rules]
    return rules


def _forward(model, batch):
    return model(batch[:, :-1])


def _gap(loss: float, base: float) -> float | None:
    return (loss - base) / base if math.isfinite(loss) and base else None


def write_json(path: pathlib.Path, data: dict) -> None:
    """Writes `data` as JSON to `path` atomically (a temporary file, then os.replace)."""
    text = json.dumps(train_lm._json_safe(data), indent=1, allow_nan=False)
    handle, tmp = tempfile.mkstemp(dir=path.absolute().parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def evaluate(args, targs, console: Console) -> dict:
    """Every (rule set, method, mode): quantize, evaluate; returns the JSON's content."""
    _, train, val = train_lm.load_data(targs)
    model = load_model(args, targs)
    calib = [
        train_lm.batch_at(train, step, targs.batch, targs.seq_len, targs.seed)
        for step in range(1, args.calib_batches + 1)
    ]
    val_batches = jnp.stack(
        [
            train_lm.batch_at(val, 10**9 + i, targs.batch, targs.seq_len, targs.seed)
            for i in range(train_lm.EVAL_BATCHES)
        ]
    )
    base = float(train_lm.eval_loss(model, val_batches))
    console.print(f"bf16 validation loss {base:.4f}", markup=False)
    runs = []
    for rule_set in args.rule_sets:
        rules = rules_for(rule_set, targs.depth)
        for method in args.methods:
            for mode in args.modes:
                begin = time.perf_counter()
                frozen, report = ptq.quantize_for_export(
                    model,
                    calib,
                    method=method,
                    rules=rules,
                    activations=MODES[mode],
                    forward=_forward,
                    block_2d=args.weight_blocks == "16x16",
                    gptq_act_order=args.gptq_act_order,
                )
                loss = float(train_lm.eval_loss(frozen, val_batches))
                seconds = time.perf_counter() - begin
                gap = _gap(loss, base)
                gap_text = "-" if gap is None else f"{100 * gap:+.2f}%"
                console.print(
                    f"[{rule_set} {method} {mode}] val {loss:.4f} ({gap_text}), "
                    f"{len(report.paths('nvfp4'))} layers, {seconds:.1f} s",
                    markup=False,
                )
                runs.append(
                    {
                        "rules": rule_set,
                        "method": method,
                        "mode": mode,
                        "val_loss": loss,
                        "gap": gap,
                        "mean_weight_error": report.mean("weight_error"),
                        "mean_output_error": report.mean("output_error"),
                        "quantized_layers": len(report.paths("nvfp4")),
                        "seconds": seconds,
                        "report": report.to_dict(),
                    }
                )
    return {
        "from": str(args.source),
        "run": {name: getattr(targs, name) for name in MODEL_FLAGS},
        "calibration_batches": args.calib_batches,
        "weight_blocks": args.weight_blocks,
        "gptq_act_order": args.gptq_act_order,
        "bf16_val_loss": base,
        "runs": runs,
    }


def print_table(results: dict, console: Console) -> None:
    base = results["bf16_val_loss"]
    table = Table(
        title=f"post-training quantization of {results['from']} "
        f"({results['calibration_batches']} calibration batches, "
        f"{results['weight_blocks']} weight blocks)"
    )
    for column in ("rules", "method", "mode", "val loss", "gap vs bf16", "out err (%)"):
        table.add_column(column, justify="left" if column in ("rules", "method") else "right")
    table.add_row("-", "bf16", "-", f"{base:.4f}", "+0.00%", "-")
    for run in results["runs"]:
        gap = run["gap"]
        error = run["mean_output_error"]
        table.add_row(
            run["rules"],
            run["method"],
            run["mode"].upper(),
            f"{run['val_loss']:.4f}",
            "-" if gap is None else f"{100 * gap:+.2f}%",
            "-" if error is None else f"{100 * error:.3f}",
        )
    console.print(table)


def main(argv=None) -> dict:
    """Parses the flags, quantizes and evaluates, prints the table, writes the JSON."""
    parser = build_parser()
    args = parse_args(argv, parser)
    console = Console()
    try:
        targs = run_args(args, console)
        results = evaluate(args, targs, console)
    except (UsageError, train_lm.UsageError) as error:
        parser.error(str(error))
    print_table(results, console)
    write_json(args.out, results)
    console.print(f"wrote {args.out}", markup=False)
    return results


if __name__ == "__main__":
    main()
