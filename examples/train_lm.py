"""Trains a byte-level transformer language model with NVFP4 layers next to bf16.

    python examples/train_lm.py                       # both recipes, CPU-sized defaults
    python examples/train_lm.py --recipe nvfp4 --steps 2000 --width 512 --depth 8 --batch 64

The text is the Python documentation every CPython install carries (`pydoc_data.topics`),
split 90/10 into train and validation; `--data PATH` trains on a text file of your own.
Both runs start from the same initial weights and see the same batches in the same order.
The output folder gets `results.json`, `curves.png` and orbax checkpoints (`--resume`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

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
from lm_model import LMConfig, TransformerLM, loss_fn

import nvfp4_jax

RECIPES = ("nvfp4", "bf16")
EVAL_BATCHES = 8


def parse_args(argv=None) -> argparse.Namespace:
    """Parses and checks the command line; bad values exit with a message naming the flag."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=("nvfp4", "bf16", "both"), default="both")
    p.add_argument("--data", type=pathlib.Path, default=None, help="a UTF-8/byte text file")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-first", type=int, default=0, help="blocks kept in bf16 at the start")
    p.add_argument("--bf16-last", type=int, default=0, help="blocks kept in bf16 at the end")
    p.add_argument(
        "--disable",
        action="append",
        default=[],
        choices=("weight_2d", "wgrad_rht", "stochastic_rounding"),
        help="turn off a switch of the NVFP4 recipe (repeatable)",
    )
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/train_lm"))
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step"
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "width", "depth", "heads", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.save_every < 0 or args.lr <= 0:
        p.error(f"--save-every must be >= 0 and --lr > 0, got {args.save_every}, {args.lr}")
    if args.width % 16 or args.width % args.heads:
        p.error(f"--width must be a multiple of 16 and of --heads={args.heads}, got {args.width}")
    if args.bf16_first < 0 or args.bf16_last < 0:
        p.error("--bf16-first and --bf16-last must be >= 0")
    if args.stop_after is not None and args.stop_after < 1:
        p.error(f"--stop-after must be positive, got {args.stop_after}")
    if args.data is not None and not args.data.is_file():
        p.error(f"--data {args.data} is not a file")
    return args


def load_text(path: pathlib.Path | None) -> np.ndarray:
    """Returns the training text as uint8 bytes."""
    if path is not None:
        data = path.read_bytes()
    else:
        from pydoc_data.topics import topics  # noqa: PLC0415

        data = "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8)


def split_text(data: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits 90/10 into train and validation; each must hold at least one sequence."""
    cut = int(0.9 * len(data))
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


def nvfp4_recipe(args) -> nvfp4_jax.NVFP4Recipe:
    """The NVFP4 training recipe, all switches on but those `--disable` names."""
    return nvfp4_jax.NVFP4Recipe(**{name: False for name in args.disable})


def make_model(args, recipe_name: str) -> TransformerLM:
    """The model of one recipe; parameters come from the seed alone, so both runs start equal."""
    cfg = LMConfig(
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        max_len=args.seq_len,
        recipe=nvfp4_recipe(args) if recipe_name == "nvfp4" else None,
        bf16_first=args.bf16_first,
        bf16_last=args.bf16_last,
    )
    return TransformerLM(cfg, nnx.Rngs(params=args.seed, quantize=args.seed + 1))


def make_optimizer(model, args) -> nnx.Optimizer:
    """AdamW with linear warm-up and cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 20), args.steps, args.lr / 10
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    """One optimizer step; returns the loss."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_loss(model, batches):
    """Mean validation loss over a stack of batches (no gradients, so no SR randomness)."""
    return loss_fn(model, batches.reshape(-1, batches.shape[-1]))


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
    """Orbax checkpoints of one run: model and optimizer state plus the loss history."""

    def __init__(self, folder: pathlib.Path, every: int):
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
        self.manager = ocp.CheckpointManager(folder.resolve(), options=options)

    def save(self, step: int, model, optimizer, history: dict, force: bool = False):
        """Saves at multiples of `every` (and when `force`)."""
        if not (force or (self.every and step % self.every == 0)):
            return
        state = _savable({"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(history)
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


def run(recipe_name: str, args, train, val, console: Console) -> dict:
    """Trains one recipe; returns its history of train and validation losses."""
    model = make_model(args, recipe_name)
    optimizer = make_optimizer(model, args)
    checkpoints = Checkpoints(args.out / "checkpoints" / recipe_name, args.save_every)
    history = {"step": [], "train_loss": [], "val_step": [], "val_loss": [], "seconds": 0.0}
    start_step = 0
    if args.resume and (restored := checkpoints.restore(model, optimizer)) is not None:
        start_step, history = restored
        console.print(f"[{recipe_name}] resumed from step {start_step}")
    val_batches = jnp.stack(
        [batch_at(val, 10**9 + i, args.batch, args.seq_len, args.seed) for i in range(EVAL_BATCHES)]
    )
    columns = (TextColumn(f"{recipe_name:>5s}"), BarColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("", total=args.steps, completed=start_step, info="compiling")
        tick = time.perf_counter()
        last = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
        for step in range(start_step + 1, last + 1):
            loss = float(
                train_step(
                    model, optimizer, batch_at(train, step, args.batch, args.seq_len, args.seed)
                )
            )
            history["step"].append(step)
            history["train_loss"].append(loss)
            if step % args.eval_every == 0 or step == args.steps:
                history["val_step"].append(step)
                history["val_loss"].append(float(eval_loss(model, val_batches)))
            now = time.perf_counter()
            history["seconds"] += now - tick
            tokens_per_s = args.batch * args.seq_len / max(now - tick, 1e-9)
            tick = now
            val_text = f" val {history['val_loss'][-1]:.3f}" if history["val_loss"] else ""
            progress.update(
                task, advance=1, info=f"loss {loss:.3f}{val_text} {tokens_per_s:,.0f} tok/s"
            )
            checkpoints.save(step, model, optimizer, history, force=step == last)
    return history


def summarize(histories: dict, args, console: Console) -> dict:
    """Prints the final-loss table; returns the numbers written to results.json."""
    tail = max(1, min(20, args.steps // 10))
    rows = {}
    for name, h in histories.items():
        rows[name] = {
            "final_train_loss": float(np.mean(h["train_loss"][-tail:])),
            "final_val_loss": h["val_loss"][-1],
            "seconds": h["seconds"],
        }
    table = Table(title=f"after {args.steps} steps (train loss: mean of the last {tail})")
    for column in ("recipe", "train loss", "val loss", "val gap vs bf16", "time (s)"):
        table.add_column(column, justify="right")
    base = rows.get("bf16", {}).get("final_val_loss")
    for name, r in rows.items():
        gap = (r["final_val_loss"] - base) / base if base else None
        r["relative_val_gap"] = gap
        gap_text = "-" if gap is None else f"{100 * gap:+.2f}%"
        table.add_row(
            name,
            f"{r['final_train_loss']:.4f}",
            f"{r['final_val_loss']:.4f}",
            gap_text,
            f"{r['seconds']:.0f}",
        )
    console.print(table)
    return rows


def plot(histories: dict, path: pathlib.Path) -> None:
    """Writes both recipes' train and validation loss curves to a PNG."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, h), color in zip(histories.items(), ("tab:red", "tab:blue"), strict=False):
        ax.plot(h["step"], h["train_loss"], color=color, alpha=0.3, lw=1)
        ax.plot(h["val_step"], h["val_loss"], color=color, marker="o", label=f"{name} validation")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="byte-level LM: NVFP4 vs bf16")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    """Runs the recipes the flags ask for and writes the table, plot and JSON."""
    args = parse_args(argv)
    console = Console()
    train, val = split_text(load_text(args.data), args.seq_len)
    args.out.mkdir(parents=True, exist_ok=True)
    console.print(
        f"nvfp4_jax {nvfp4_jax.__version__} on {jax.default_backend()}: {len(train):,} train / "
        f"{len(val):,} validation bytes; width {args.width}, depth {args.depth}, "
        f"batch {args.batch}x{args.seq_len}, {args.steps} steps"
    )
    names = RECIPES if args.recipe == "both" else (args.recipe,)
    histories = {name: run(name, args, train, val, console) for name in names}
    if args.stop_after is not None and args.stop_after < args.steps:
        console.print(f"stopped after step {args.stop_after}; continue with --resume")
        return {"histories": histories}
    rows = summarize(histories, args, console)
    config = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    results = {"config": config, "results": rows, "histories": histories}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(histories, args.out / "curves.png")
    console.print(f"wrote {args.out / 'results.json'} and {args.out / 'curves.png'}")
    return results


if __name__ == "__main__":
    main()
