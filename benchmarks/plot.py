"""Draw the report's figures from a suite run's JSON (matplotlib: the optional `bench` extra).

    python -m benchmarks plot                                   # benchmarks/results/suite.json -> docs/img/
    python -m benchmarks plot /tmp/syncline-benchmarks/suite_quick.json --out /tmp/img

Figures (each drawn only when its section is in the JSON):

- `bucket_sweep.png`: median step time vs bucket cap, BucketedDDP and NativeDDP (and BucketedDDP without
  overlap), one panel per workload; bars span the 25th-75th percentiles of the steps.
- `breakdown.png`: forward, backward compute, exposed communication and optimizer per step, stacked, for
  local training, NativeDDP and BucketedDDP at their defaults, one panel per workload.
- `skip_sync.png`: time per sample vs synchronization interval; CharGPT training loss vs samples for
  each interval, with the final validation loss.
- `overhead.png`: time per step and time to the first step of the raw loop, the Trainer and Lightning.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .analysis import sweep
from .common import ROOT

__all__ = ["breakdown_parts", "cap_label", "add_arguments", "command", "plot_all"]

LABELS = {"native": "NativeDDP", "bucketed": "BucketedDDP"}
COLORS = {"native": "#4C72B0", "bucketed": "#DD8452", "no-overlap": "#937860", "local": "#55A868"}
PARTS = (("forward", "#8172B3"), ("backward compute", "#4C72B0"), ("exposed comm", "#C44E52"), ("optimizer", "#CCB974"))


def cap_label(cap: float) -> str:
    """'per param' for 0, 'all' for the all-in-one cap, else the cap in MiB."""
    if cap == 0:
        return "per\nparam"
    if cap >= 1024:
        return "all"
    return f"{cap:g}"


def breakdown_parts(variants: dict, name: str) -> dict[str, float]:
    """Split a variant's median step into forward, backward compute, exposed communication and optimizer.

    Backward compute is the local (unsynchronized) backward; what a DDP backward takes beyond it is
    exposed communication (never below zero: noise can make the difference negative).
    """
    phases = variants[name]["phases_ms"]
    local_backward = variants["local"]["phases_ms"]["backward"]
    compute = phases["backward"] if name == "local" else min(phases["backward"], local_backward)
    return {
        "forward": phases["forward"],
        "backward compute": compute,
        "exposed comm": max(0.0, phases["backward"] - compute),
        "optimizer": phases["optimizer"],
    }


def _sweep_figure(plt, ddp: dict, out: Path) -> None:
    names = [n for n in ("cnn", "bert") if n in ddp]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        variants = ddp[name]["variants"]
        caps = [cap for cap, _ in sweep(variants, "native")]
        positions = {cap: i for i, cap in enumerate(caps)}
        series = [("native", True, "NativeDDP (torch C++)"), ("bucketed", True, "BucketedDDP (syncline)")]
        series.append(("bucketed", False, "BucketedDDP, overlap off"))
        for reducer, overlap, label in series:
            points = sweep(variants, reducer, overlap)
            if not points:
                continue
            x = [positions[cap] + (0.08 if not overlap else 0) for cap, _ in points]
            y = [v["step"]["median_ms"] for _, v in points]
            low = [v["step"]["median_ms"] - v["step"]["p25_ms"] for _, v in points]
            high = [v["step"]["p75_ms"] - v["step"]["median_ms"] for _, v in points]
            color = COLORS[reducer if overlap else "no-overlap"]
            style = "-o" if overlap else ":s"
            ax.errorbar(x, y, yerr=[low, high], fmt=style, color=color, label=label, capsize=3, ms=4)
        for reducer, style in (("native", "--"), ("bucketed", "-.")):
            default = variants[f"{reducer} default"]["step"]["median_ms"]
            ax.axhline(
                default, ls=style, lw=0.8, color=COLORS[reducer], label=f"{reducer} default (25 MiB, first 1 MiB)"
            )
        ax.axhline(variants["local"]["step"]["median_ms"], color=COLORS["local"], lw=0.8, label="local (no sync)")
        w = ddp[name]["workload"]
        ax.set_title(
            f"{name.upper()}: {w['parameters'] / 1e6:.1f} M parameters, {w['gradient_mb']:.1f} MiB of gradients"
        )
        ax.set_xticks(range(len(caps)), [cap_label(c) for c in caps])
        ax.set_xlabel("bucket cap (MiB)")
        ax.set_ylabel("median step (ms), bars: 25th-75th pct")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "bucket_sweep.png", dpi=110)
    plt.close(fig)


def _breakdown_figure(plt, ddp: dict, out: Path) -> None:
    names = [n for n in ("cnn", "bert", "mlp") if n in ddp]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), squeeze=False)
    labels = {"local": "local", "native default": "NativeDDP", "bucketed default": "BucketedDDP"}
    for ax, name in zip(axes[0], names):
        variants = ddp[name]["variants"]
        bottoms = [0.0] * len(labels)
        parts = [breakdown_parts(variants, v) for v in labels]
        for part, color in PARTS:
            heights = [p[part] for p in parts]
            ax.bar(list(labels.values()), heights, bottom=bottoms, color=color, label=part)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        for i, v in enumerate(labels):
            step = variants[v]["step"]
            ax.errorbar(
                i,
                step["median_ms"],
                yerr=[[step["median_ms"] - step["p25_ms"]], [step["p75_ms"] - step["median_ms"]]],
                fmt="k_",
                capsize=4,
            )
        ax.set_title(name.upper())
        ax.set_ylabel("ms per step")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=110)
    plt.close(fig)


def _skip_sync_figure(plt, sections: dict, out: Path) -> None:
    panels = ("ddp" in sections) + 2 * ("curves" in sections)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if "ddp" in sections:
        ax = axes.pop(0)
        colors = {"cnn": "#4C72B0", "bert": "#C44E52"}
        for name in ("cnn", "bert"):
            if name not in sections["ddp"]:
                continue
            variants = sections["ddp"][name]["variants"]
            for reducer, style in (("native", "--o"), ("bucketed", "-s")):
                base = variants[f"{reducer} default"]["per_sample"]["median_ms"]
                points = sorted(
                    [(1, base)]
                    + [
                        (v["sync_every"], v["per_sample"]["median_ms"])
                        for v in variants.values()
                        if v["reducer"] == reducer and v["sync_every"] > 1
                    ]
                )
                ax.plot(
                    [k for k, _ in points],
                    [value / base for _, value in points],
                    style,
                    color=colors[name],
                    alpha=0.6 if reducer == "native" else 1.0,
                    label=f"{name.upper()} {LABELS[reducer]} ({base:.1f} ms at k=1)",
                )
            local = (
                variants["local"]["per_sample"]["median_ms"] / variants["bucketed default"]["per_sample"]["median_ms"]
            )
            ax.axhline(
                local, lw=0.8, ls=":", color=colors[name], label=f"{name.upper()} local, no sync (vs BucketedDDP)"
            )
        ax.set_xscale("log", base=2)
        ks = sorted(
            {v["sync_every"] for n in ("cnn", "bert") for v in sections["ddp"].get(n, {}).get("variants", {}).values()}
        )
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("synchronize every k micro-batches")
        ax.set_ylabel("time per sample / time per sample at k=1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title("Skip-sync: amortized time per sample")
    if "curves" in sections:
        ax = axes.pop(0)
        curves = sections["curves"]
        batch = curves["model"]["batch_size"] * curves["world_size"]
        for k, run in curves["runs"].items():
            losses = run["losses"]
            smooth, value = [], losses[0]
            for loss in losses:
                value = 0.9 * value + 0.1 * loss  # exponential moving average of rank 0's micro-batch losses
                smooth.append(value)
            samples = [(i + 1) * batch for i in range(len(losses))]
            ax.plot(samples, smooth, label=f"sync every {k}: val_loss {run['val_loss']['median']:.3f}")
        ax.set_xlabel("training samples (all ranks)")
        ax.set_ylabel("training loss (EMA 0.9, rank 0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("CharGPT, BucketedDDP x2: loss vs samples")
        ax = axes.pop(0)
        ks = [int(k) for k in curves["runs"]]
        for scaling, style, label in (
            ("base", "-o", f"lr {curves['model']['lr']:g} (tuned for k=1)"),
            ("sqrt", "--s", "lr x sqrt(k)"),
            ("linear", ":^", "lr x k"),
        ):
            points = [
                (k, run["val_loss"]["median"])
                for k in ks
                for run in [
                    curves["runs"][str(k)]
                    if scaling == "base"
                    else curves.get("lr_scaled", {}).get(str(k), {}).get(scaling)
                ]
                if run is not None
            ]
            if scaling != "base" and points:
                points.insert(0, (1, curves["runs"]["1"]["val_loss"]["median"]))
            if points:
                ax.plot([k for k, _ in points], [v for _, v in points], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("synchronize every k micro-batches (same samples)")
        ax.set_ylabel("final validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("CharGPT: validation loss vs k and learning rate")
    fig.tight_layout()
    fig.savefig(out / "skip_sync.png", dpi=110)
    plt.close(fig)


def _overhead_figure(plt, overhead: dict, out: Path) -> None:
    loops = overhead["loops"]
    names = list(loops)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, unit, scale in (
        (left, "step_us", "us per step", 1.0),
        (right, "first_step_s", "s to first step", 1.0),
    ):
        medians = [loops[n][key]["median"] * scale for n in names]
        low = [m - loops[n][key]["min"] * scale for m, n in zip(medians, names)]
        high = [loops[n][key]["max"] * scale - m for m, n in zip(medians, names)]
        ax.bar(names, medians, yerr=[low, high], capsize=4, color=["#55A868", "#DD8452", "#4C72B0"][: len(names)])
        ax.set_ylabel(f"{unit} (whisker: min-max)")
        ax.grid(axis="y", alpha=0.3)
    left.set_title("Steady state, tiny MLP (one process, interleaved)")
    right.set_title("Process start to first step")
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=110)
    plt.close(fig)


def plot_all(results: dict, out: Path) -> list[Path]:
    """Draw every figure whose section is in `results` into `out`; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    sections = results["sections"]
    written = []
    if "ddp" in sections:
        _sweep_figure(plt, sections["ddp"], out)
        _breakdown_figure(plt, sections["ddp"], out)
        written += [out / "bucket_sweep.png", out / "breakdown.png"]
    if "ddp" in sections or "curves" in sections:
        _skip_sync_figure(plt, sections, out)
        written.append(out / "skip_sync.png")
    if "overhead" in sections:
        _overhead_figure(plt, sections["overhead"], out)
        written.append(out / "overhead.png")
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("results", nargs="?", type=Path, default=ROOT / "benchmarks" / "results" / "suite.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    for path in plot_all(json.loads(args.results.read_text()), args.out):
        print(f"wrote {path}")
