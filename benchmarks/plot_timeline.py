"""Draw some steps of a `CommunicationTimeline` trace as a PNG (matplotlib: the optional `bench` extra).

    python -m benchmarks plot-timeline timeline.json --steps 14 15 --out docs/img/timeline.png

One row per rank and lane (the step's phases, then one row per bucket), time in ms from the first span
drawn; the exposed wait is drawn over the end of the backward it belongs to.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "exposed wait": "#c44e52",
    "optimizer step": "#8172b2",
    "bucket": "#dd8452",
    "collective": "#937860",
}


def spans_of(trace: dict[str, Any], steps: set[int]) -> tuple[list[dict[str, Any]], dict[tuple[int, int], str]]:
    """Return the "X" events of `steps` and the lane name of every (pid, tid)."""
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"].get("step") in steps]
    return spans, lanes


def plot(trace: dict[str, Any], steps: list[int], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans, lanes = spans_of(trace, set(steps))
    if not spans:
        raise SystemExit(f"no spans of steps {steps} in the trace")
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    y = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    origin = min(e["ts"] for e in spans)
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2), dpi=110)
    for e in spans:
        color = COLORS.get(e["name"], COLORS.get(e["cat"], "#999999"))
        nested = e["name"] == "exposed wait"
        height, offset = (0.45, 0.0) if nested else (0.8, -0.4)
        start, width = (e["ts"] - origin) / 1e3, e["dur"] / 1e3
        ax.broken_barh([(start, width)], (y[(e["pid"], e["tid"])] + offset, height), color=color, linewidth=0)
    ax.set_yticks([y[row] for row in rows], [f"rank {pid}: {lanes[(pid, tid)]}" for pid, tid in rows], fontsize=8)
    ax.set_xlabel("ms", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", linewidth=0.3)
    names = ["forward", "backward", "exposed wait", "optimizer step", "bucket", "collective"]
    present = {e["name"] for e in spans} | {e["cat"] for e in spans}
    handles = [Patch(color=COLORS[n], label=n if n != "bucket" else "bucket collective") for n in names if n in present]
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, nargs="+", required=True, help="optimizer steps to draw")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    plot(json.loads(args.trace.read_text()), args.steps, args.out, args.title)
