"""The NVFP4-vs-bf16 validation-loss gap of the example, against width, policy and steps.

    python examples/study_gap.py                       # everything (about 45 minutes on 2 cores)
    python examples/study_gap.py --only width-128 policy-suggested
    python examples/study_gap.py --plot-only           # redraw from the saved runs

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
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

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
        train_lm.main([*common, *recipe, *POINTS[name][2], "--out", str(folder)])
    results = json.loads(results.read_text())
    if "bf16" not in results["histories"]:
        base = run_point(BASELINE, out, common)
        results["histories"]["bf16"] = base["histories"]["bf16"]
        results["results"]["bf16"] = base["results"]["bf16"]
        val, ref = (
            results["results"]["nvfp4"]["final_val_loss"],
            base["results"]["bf16"]["final_val_loss"],
        )
        results["results"]["nvfp4"]["relative_val_gap"] = (val - ref) / ref
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
    parser.add_argument("--only", nargs="+", choices=sorted(POINTS), default=sorted(POINTS))
    parser.add_argument("--plot-only", action="store_true", help="redraw from saved runs")
    parser.add_argument(
        "--steps", type=int, default=600, help="steps of every point (train_lm's default)"
    )
    args = parser.parse_args(argv)
    common = ["--steps", str(args.steps), "--eval-every", "100"]
    names = args.only
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.json").write_text(json.dumps(study, indent=1))
    plot(study, args.out / "study.png")
    for name, p in points.items():
        print(
            f"{name:>20}: gap {p['gap_percent']:+.2f}%  (nvfp4 {p['val_nvfp4']:.4f}, bf16 "
            f"{p['val_bf16']:.4f})"
        )
    print(f"wrote {args.out / 'study.json'} and {args.out / 'study.png'}")
    return study


if __name__ == "__main__":
    main()
