"""The NVFP4-vs-bf16 validation-loss gap of the example, against width, policy and steps.

    python examples/study_gap.py                       # everything (about 45 minutes on 2 cores)
    python examples/study_gap.py --only width-128 policy-suggested
    python examples/study_gap.py --plot-only           # redraw from the saved runs
    python examples/study_gap.py --study accuracy      # Four Over Six, the finish (~60 min)
    python examples/study_gap.py --study recipes       # SR vs MS-EDEN backward, 3 draws (~60 min)

Each study point is one `examples/train_lm.py` run (NVFP4 and bf16 from the same initial
weights and batches) in its own folder under `--out`; a point already run is read back, not
trained again. The figure has three panels, each showing the relative gap
`(val_nvfp4 - val_bf16) / val_bf16` in percent:

* against model width (128, 256, 512; depth, batch, sequence length and steps fixed, so every
  width sees the same tokens), every linear layer in NVFP4 (the head included);
* against the layers kept in bf16, at the default width: none (every linear layer NVFP4, the
  output head included), the last block (with the head), the first and the last blocks, and
  the diagnostics' suggestion (`--suggest-share`: the worst layers by weight-gradient angle);
* against training steps, from the validation curves of the default configuration.

It writes `study.json` (every point's losses and gap) and `study.png` under `--out`.

`--study recipes` compares the backward's quantization, NVIDIA's stochastic rounding against
Quartet II's MS-EDEN (`--backward`), on the plain recipe, the default recipe, and the default
recipe with the attention projections in bf16 ("MLP only", as NVIDIA's MaxText recipe
does), each with three rounding draws (the default streams, `--sr-seed 2` and `--sr-seed
3`: the same weights and batches), against one bf16 run; it writes `recipes.json` (every
draw's gap, their mean and spread) and `recipes.png`. Every run has its own folder, so an
interrupted study picks up where it stopped.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_lm

# name -> (panel, label, train_lm flags)
POINTS = {
    # The peak learning rate scales as 1 / width (3e-3 at 128), so that the wider models train
    # stably: at 3e-3, width 512 ends worse than width 128 in bf16 too (1.666 vs 1.390).
    "width-128": ("width", 128, ["--width", "128", "--heads", "4", "--bf16-last", "0"]),
    "width-256": (
        "width",
        256,
        ["--width", "256", "--heads", "4", "--bf16-last", "0", "--lr", "1.5e-3"],
    ),
    "width-512": (
        "width",
        512,
        ["--width", "512", "--heads", "8", "--bf16-last", "0", "--lr", "7.5e-4"],
    ),
    "policy-none": ("policy", "none", None),
    "policy-last": ("policy", "last block + head (the default)", ["--bf16-last", "2"]),
    "policy-first-last": (
        "policy",
        "first + last block + head",
        ["--bf16-first", "1", "--bf16-last", "2"],
    ),
    "policy-suggested": ("policy", "diagnostics (worst 10%)", ["--suggest-share", "0.1"]),
}


# The accuracy tools (`--study accuracy`): Four Over Six per operand class, the
# high-precision finish, bf16 first/last blocks, and their combinations, at the example's
# width (128) and at 256. Every point pins the plain recipe's flags (PLAIN) and adds its own,
# so that the study means the same whatever train_lm's defaults are; the first point of each
# width trains bf16 too, the others NVFP4 only and compare with it.
PLAIN = ["--bf16-first", "0", "--bf16-last", "2", "--high-precision-final", "0"]
# The gap and accuracy studies were measured with NVIDIA's backward (the example's default
# until Quartet II's replaced it): their runs pin it.
NVIDIA_BACKWARD = ["--backward", "nvidia"]
WIDTHS = {128: [], 256: ["--width", "256", "--heads", "4", "--lr", "1.5e-3"]}
TOOLS = {
    "plain": ("plain NVFP4 (last block + head in bf16)", []),
    "fos-weight": ("4/6 on W", ["--four-over-six", "weight"]),
    "fos-activation": ("4/6 on x", ["--four-over-six", "activation"]),
    "fos-gradient": ("4/6 on dy", ["--four-over-six", "gradient"]),
    "fos-all": ("4/6 on W, x, dy", ["--four-over-six", "all"]),
    "finish-0.1": ("finish: last 10% forward in bf16", ["--high-precision-final", "0.1"]),
    "finish-0.2": ("finish: last 20% forward in bf16", ["--high-precision-final", "0.2"]),
    "fos-all+finish-0.2": (
        "4/6 on W, x, dy + finish 20%",
        ["--four-over-six", "all", "--high-precision-final", "0.2"],
    ),
    "rn-gradients": (
        "dy rounded to nearest (no SR)",
        ["--disable", "stochastic_rounding"],
    ),
    "weights-1x16": ("1x16 weight blocks (not 16x16)", ["--disable", "weight_2d"]),
    "first-last": ("first block in bf16 too", ["--bf16-first", "1"]),
    "first-last+finish-0.2": (
        "first block in bf16 + finish 20%",
        ["--bf16-first", "1", "--high-precision-final", "0.2"],
    ),
    "first-last+finish-0.2+fos-all": (
        "first block in bf16 + finish 20% + 4/6 on W, x, dy",
        ["--bf16-first", "1", "--high-precision-final", "0.2", "--four-over-six", "all"],
    ),
}
# Width 256 (4x the GEMM work per step) takes the combinations that matter.
TOOLS_AT = {
    128: tuple(TOOLS),
    256: (
        "plain",
        "fos-all",
        "rn-gradients",
        "finish-0.2",
        "fos-all+finish-0.2",
        "first-last+finish-0.2",
        "first-last+finish-0.2+fos-all",
    ),
}
ACCURACY_POINTS = {
    f"acc{width}-{tool}": (width, TOOLS[tool][0], [*WIDTHS[width], *TOOLS[tool][1]])
    for width, tools in TOOLS_AT.items()
    for tool in tools
}


def accuracy_flags(name: str) -> list[str]:
    """The train_lm flags of an accuracy point: PLAIN, then the point's own."""
    flags = [*PLAIN, *NVIDIA_BACKWARD, *ACCURACY_POINTS[name][2]]
    if "--four-over-six" not in flags:
        flags += ["--four-over-six", "none"]
    return flags


# The recipe study (`--study recipes`): each point pins every flag it depends on, so that it
# means the same whatever train_lm's defaults are.
PLAIN_RECIPE = [*PLAIN, "--four-over-six", "none"]
DEFAULT_RECIPE = [
    "--bf16-first", "1", "--bf16-last", "2", "--high-precision-final", "0.2",
    "--four-over-six", "all",
]  # fmt: skip
MLP_ONLY = [*DEFAULT_RECIPE, "--keep-bf16", "/self_attn/"]
RECIPE_POINTS = {
    "plain-sr": ("plain recipe, SR", [*PLAIN_RECIPE, "--backward", "nvidia"]),
    "plain-ms_eden": ("plain recipe, MS-EDEN", [*PLAIN_RECIPE, "--backward", "ms_eden"]),
    "default-sr": ("default recipe, SR", [*DEFAULT_RECIPE, "--backward", "nvidia"]),
    "default-ms_eden": ("default recipe, MS-EDEN", [*DEFAULT_RECIPE, "--backward", "ms_eden"]),
    "mlp_only-sr": ("default, MLP only (attention bf16), SR", [*MLP_ONLY, "--backward", "nvidia"]),
    "mlp_only-ms_eden": (
        "default, MLP only (attention bf16), MS-EDEN",
        [*MLP_ONLY, "--backward", "ms_eden"],
    ),
    # Quartet II's forward quantizes W in 1x16 blocks, as x: its backward re-quantizes the
    # forward's W, so NVIDIA's 16x16 weight blocks (which make W and W^T one tensor) buy
    # nothing there, and 1x16 blocks err less (docs/NUMERICS.md section 10).
    "plain-ms_eden_w1x16": (
        "plain recipe, MS-EDEN, 1x16 W (Quartet II)",
        [*PLAIN_RECIPE, "--backward", "ms_eden", "--disable", "weight_2d"],
    ),
    "default-ms_eden_w1x16": (
        "default recipe, MS-EDEN, 1x16 W (Quartet II)",
        [*DEFAULT_RECIPE, "--backward", "ms_eden", "--disable", "weight_2d"],
    ),
}
# The rounding draws: the default streams (from --seed), then --sr-seed 2 and 3.
DRAWS = (None, 2, 3)


def draw_folder(out: pathlib.Path, name: str, draw: int | None) -> pathlib.Path:
    """Where a recipe point's run of one draw lives: `name` for the default streams."""
    return out / (name if draw is None else f"{name}@sr{draw}")


def run_recipe_point(name: str, draw: int | None, out: pathlib.Path, common: list[str]) -> dict:
    """The results of one recipe point and draw, against the study's bf16 run."""
    folder = draw_folder(out, name, draw)
    if not (folder / "results.json").exists():
        seed = [] if draw is None else ["--sr-seed", str(draw)]
        flags = [*common, "--recipe", "nvfp4", *RECIPE_POINTS[name][1], *seed]
        train_lm.main([*flags, "--out", str(folder)])
    results = json.loads((folder / "results.json").read_text())
    base = out / "bf16"
    if not (base / "results.json").exists():
        train_lm.main([*common, "--recipe", "bf16", "--out", str(base)])
    return with_baseline(results, json.loads((base / "results.json").read_text()))


def plot_recipes(study: dict, path: pathlib.Path) -> None:
    """The gap of every recipe point: the mean of its draws, and each draw."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    points = list(study["points"].values())
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["tab:blue" if "MS-EDEN" not in p["label"] else "tab:orange" for p in points]
    ax.barh([p["label"] for p in points], [p["gap_percent"] for p in points], color=colors)
    for i, p in enumerate(points):
        ax.plot(p["gaps_percent"], [i] * len(p["gaps_percent"]), "k.", ms=6)
    ax.plot([], [], "k.", label="each rounding draw")
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="relative validation-loss gap (%), mean of the draws")
    ax.grid(alpha=0.3)
    fig.suptitle("The backward's rounding: NVIDIA's SR (blue) vs Quartet II's MS-EDEN (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recipes_main(args, common: list[str]) -> dict:
    """`--study recipes`: runs (or reads back) every recipe point's draws; recipes.json/png."""
    names = [n for n in RECIPE_POINTS if not args.only or n in args.only]
    points = {}
    for name in names:
        draws = [
            d
            for d in DRAWS
            if not args.plot_only or (draw_folder(args.out, name, d) / "results.json").exists()
        ]
        rows = [run_recipe_point(name, d, args.out, common)["results"] for d in draws]
        if not rows:
            continue
        gaps = [100 * r["nvfp4"]["relative_val_gap"] for r in rows]
        points[name] = {
            "label": RECIPE_POINTS[name][0],
            "flags": RECIPE_POINTS[name][1],
            "draws": ["default" if d is None else f"--sr-seed {d}" for d in draws],
            "gaps_percent": gaps,
            "gap_percent": float(np.mean(gaps)),
            "spread_percent": float(np.std(gaps)),
            "vals_nvfp4": [r["nvfp4"]["final_val_loss"] for r in rows],
            "val_nvfp4": float(np.mean([r["nvfp4"]["final_val_loss"] for r in rows])),
            "val_bf16": rows[0]["bf16"]["final_val_loss"],
            "ms_per_step_nvfp4": [r["nvfp4"]["step_ms"] for r in rows],
        }
    if not points:
        raise SystemExit(f"no recipe point has been run under {args.out}")
    return write_study({"steps": args.steps, "points": points}, args.out, "recipes", plot_recipes)


def point_folder(out: pathlib.Path, name: str, seed: int) -> pathlib.Path:
    """Where a point's run of one seed lives: `name` for seed 0, `name@seedN` otherwise."""
    return out / (name if seed == 0 else f"{name}@seed{seed}")


def run_accuracy_point(name: str, seed: int, out: pathlib.Path, common: list[str]) -> dict:
    """The results of one accuracy point and seed (NVFP4 against the bf16 run of its width's
    plain point of the same seed)."""
    width = ACCURACY_POINTS[name][0]
    base_name = f"acc{width}-plain"
    folder = point_folder(out, name, seed)
    if not (folder / "results.json").exists():
        recipe = [] if name == base_name else ["--recipe", "nvfp4"]
        flags = [*common, *recipe, *accuracy_flags(name), "--seed", str(seed)]
        train_lm.main([*flags, "--out", str(folder)])
    results = json.loads((folder / "results.json").read_text())
    if "bf16" not in results["histories"]:
        with_baseline(results, run_accuracy_point(base_name, seed, out, common))
    return results


def with_baseline(results: dict, base: dict) -> dict:
    """An NVFP4-only run's results with the bf16 run of `base` (same model, same batches)."""
    results["histories"]["bf16"] = base["histories"]["bf16"]
    results["results"]["bf16"] = base["results"]["bf16"]
    val = results["results"]["nvfp4"]["final_val_loss"]
    ref = base["results"]["bf16"]["final_val_loss"]
    results["results"]["nvfp4"]["relative_val_gap"] = (val - ref) / ref
    return results


def plot_accuracy(study: dict, path: pathlib.Path) -> None:
    """One panel per width: the relative gap of every accuracy point."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    widths = sorted({p["width"] for p in study["points"].values()})
    fig, axes = plt.subplots(1, len(widths), figsize=(7 * len(widths), 4.5), squeeze=False)
    for ax, width in zip(axes[0], widths, strict=True):
        points = [p for p in study["points"].values() if p["width"] == width]
        labels = [p["label"] for p in points]
        ax.barh(labels, [p["gap_percent"] for p in points], label="mean over seeds")
        for i, p in enumerate(points):
            ax.plot(p["gaps_percent"], [i] * len(p["gaps_percent"]), "k.", ms=5)
        ax.plot([], [], "k.", label="each seed")
        ax.legend(loc="lower right", fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="gray", ls=":", lw=1)
        ax.set(xlabel="relative validation-loss gap (%)", title=f"width {width}")
        ax.grid(alpha=0.3)
    fig.suptitle("NVFP4 accuracy tools on the example Llama: (val_nvfp4 - val_bf16) / val_bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accuracy_main(args, common: list[str]) -> dict:
    """`--study accuracy`: runs (or reads back) the accuracy points of every seed in
    `--seeds`, writes accuracy.json/png: each point's gap per seed and their mean."""
    names = [n for n in ACCURACY_POINTS if not args.only or n in args.only]
    points = {}
    for name in names:
        width, label, _ = ACCURACY_POINTS[name]
        seeds = [
            seed
            for seed in args.seeds
            if not args.plot_only or (point_folder(args.out, name, seed) / "results.json").exists()
        ]
        rows = [run_accuracy_point(name, seed, args.out, common)["results"] for seed in seeds]
        if not rows:
            continue
        gaps = [100 * r["nvfp4"]["relative_val_gap"] for r in rows]
        points[name] = {
            "width": width,
            "label": label,
            "flags": accuracy_flags(name),
            "seeds": seeds,
            "gaps_percent": gaps,
            "gap_percent": float(sum(gaps) / len(gaps)),
            "val_nvfp4": rows[0]["nvfp4"]["final_val_loss"],
            "val_bf16": rows[0]["bf16"]["final_val_loss"],
            "ms_per_step_nvfp4": rows[0]["nvfp4"]["step_ms"],
        }
    if not points:
        raise SystemExit(f"no accuracy point has been run under {args.out}")
    return write_study({"steps": args.steps, "points": points}, args.out, "accuracy", plot_accuracy)


def write_study(study: dict, out: pathlib.Path, stem: str, draw) -> dict:
    """Writes `stem`.json and `stem`.png (drawn by `draw`) under `out`; prints every point."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(study, indent=1))
    draw(study, out / f"{stem}.png")
    for name, p in study["points"].items():
        print(
            f"{name:>28}: gap {p['gap_percent']:+.2f}%  (nvfp4 {p['val_nvfp4']:.4f}, bf16 "
            f"{p['val_bf16']:.4f}"
            + (
                f"; per seed {', '.join(f'{g:+.2f}%' for g in p['gaps_percent'])})"
                if "gaps_percent" in p
                else ")"
            )
        )
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.png'}")
    return study


# The policy points differ from width-128 only in the NVFP4 run's rules: their bf16 run would
# be the same bits (same initial weights and batches), so they train NVFP4 only and compare
# with width-128's bf16 run.
BASELINE = "width-128"


def run_point(name: str, out: pathlib.Path, common: list[str]) -> dict:
    """The results of one point: read back if it was run, else trained now."""
    if POINTS[name][2] is None:
        name = BASELINE  # every layer in NVFP4: the NVFP4 run of the baseline point itself
    folder = out / name
    results = folder / "results.json"
    if not results.exists():
        recipe = ["--recipe", "nvfp4"] if POINTS[name][0] == "policy" else []
        flags = [*common, *recipe, *NVIDIA_BACKWARD, *POINTS[name][2]]
        train_lm.main([*flags, "--out", str(folder)])
    results = json.loads(results.read_text())
    if "bf16" not in results["histories"]:
        with_baseline(results, run_point(BASELINE, out, common))
    return results


def plot(study: dict, path: pathlib.Path) -> None:
    """One figure, three panels of the relative gap."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = sorted(
        (p for p in study["points"].values() if p["panel"] == "width"), key=lambda p: p["label"]
    )
    axes[0].plot(range(len(width)), [p["gap_percent"] for p in width], "o-")
    axes[0].set_xticks(range(len(width)), [str(p["label"]) for p in width])
    axes[0].set(
        xlabel="model width (lr 3e-3 x 128 / width)", title="gap against width (same tokens)"
    )
    policy = [p for p in study["points"].values() if p["panel"] == "policy"]
    axes[1].barh([p["label"] for p in policy], [p["gap_percent"] for p in policy], color="tab:red")
    axes[1].invert_yaxis()
    axes[1].set(xlabel="relative gap (%)", title="gap against the layers kept in bf16")
    for name, curve in study["curves"].items():
        axes[2].plot(curve["steps"], curve["gaps"], marker="o", label=name)
    axes[2].set(xlabel="step", title="gap against training steps")
    axes[2].legend()
    for ax in (axes[0], axes[2]):
        ax.set_ylabel("relative validation-loss gap (%)")
    for ax in axes:
        ax.axvline(3, color="gray", ls=":", lw=1) if ax is axes[1] else ax.axhline(
            3, color="gray", ls=":", lw=1
        )
        ax.grid(alpha=0.3)
    fig.suptitle("NVFP4 vs bf16 on the example Llama: (val_nvfp4 - val_bf16) / val_bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/study_gap"))
    parser.add_argument(
        "--study",
        choices=("gap", "accuracy", "recipes"),
        default="gap",
        help="gap: width, bf16 layers and steps; accuracy: Four Over Six and the "
        "high-precision finish (writes accuracy.json and accuracy.png); recipes: the "
        "backward's SR against MS-EDEN, three draws each (recipes.json and recipes.png)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted([*POINTS, *ACCURACY_POINTS, *RECIPE_POINTS]),
        default=None,
    )
    parser.add_argument("--plot-only", action="store_true", help="redraw from saved runs")
    parser.add_argument(
        "--steps", type=int, default=600, help="steps of every point (train_lm's default)"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="--study accuracy: train every point with each of these seeds (default 0)",
    )
    args = parser.parse_args(argv)
    common = ["--steps", str(args.steps), "--eval-every", "100"]
    if args.study == "accuracy":
        return accuracy_main(args, common)
    if args.study == "recipes":
        return recipes_main(args, common)
    # The plain recipe whatever train_lm's defaults (a point's own flags come after these).
    common += ["--bf16-first", "0", "--high-precision-final", "0"]
    names = args.only or sorted(POINTS)
    if args.plot_only:
        names = [
            n
            for n in POINTS
            if (args.out / (BASELINE if POINTS[n][2] is None else n) / "results.json").exists()
        ]
    points, curves = {}, {}
    for name in names:
        panel, label, flags = POINTS[name]
        results = run_point(name, args.out, common)
        rows = results["results"]
        points[name] = {
            "panel": panel,
            "label": label,
            "flags": flags or [],
            "val_nvfp4": rows["nvfp4"]["final_val_loss"],
            "val_bf16": rows["bf16"]["final_val_loss"],
            "gap_percent": 100 * rows["nvfp4"]["relative_val_gap"],
            "seconds_nvfp4": rows["nvfp4"]["seconds"],
            "seconds_bf16": rows["bf16"]["seconds"],
            "rules": results["config"]["rules"],
        }
        if panel == "width" or name == "policy-suggested":
            steps, gaps = train_lm.relative_gaps(results["histories"]) or ([], [])
            curves[f"{name}"] = {"steps": steps, "gaps": gaps}
    study = {"steps": args.steps, "points": points, "curves": curves}
    return write_study(study, args.out, "study", plot)


if __name__ == "__main__":
    main()
