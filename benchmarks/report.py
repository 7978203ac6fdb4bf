"""Print the report's tables (Markdown) from a suite run's JSON, so the report quotes the run's own numbers.

python benchmarks/report.py                          # benchmarks/results/suite.json
python benchmarks/report.py benchmarks/results/suite_quick.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/report.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.analysis import sweep
from benchmarks.common import ROOT
from benchmarks.plot import breakdown_parts

__all__ = ["main", "tables"]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _step(v: dict) -> str:
    s = v["step"]
    return f"{s['median_ms']:.1f} ({s['p25_ms']:.1f}-{s['p75_ms']:.1f})"


def _cap(cap: float) -> str:
    return "per parameter (0)" if cap == 0 else "all in one" if cap >= 1024 else f"{cap:g}"


def machine_table(results: dict) -> str:
    m = results["machine"]
    rows = [
        ["CPU", f"{m['cpu']}, {m['cores']} cores"],
        ["torch / python", f"{m['torch']} / {m['python']}"],
        ["backend", f"{m['backend']}, world size {m['world_size']}, {m['threads_per_rank']} thread per rank"],
        ["started", results["started_at"]],
        ["wall time", f"{results['wall_s']:.0f} s"],
        ["load average (1/5/15 min) at start", " / ".join(map(str, m["load_average_start"]))],
        ["load average at end", " / ".join(map(str, m["load_average_end"]))],
    ]
    for name, section in results["sections"].items():
        t = section["_timing"]
        rows.append(
            [
                f"section `{name}`",
                f"{t['wall_s']:.0f} s, load {t['load_average_start'][0]} -> {t['load_average_end'][0]}",
            ]
        )
    return _table(["", ""], rows)


def breakdown_table(ddp: dict) -> str:
    rows = []
    for name in ("cnn", "bert", "mlp"):
        if name not in ddp:
            continue
        variants = ddp[name]["variants"]
        for label, key in (("local", "local"), ("NativeDDP", "native default"), ("BucketedDDP", "bucketed default")):
            v, parts = variants[key], breakdown_parts(variants, key)
            own = v.get("reducer_exposed_wait_ms")
            rows.append(
                [
                    name.upper(),
                    label,
                    _step(v),
                    f"{parts['forward']:.1f}",
                    f"{v['phases_ms']['backward']:.1f}",
                    ""
                    if key == "local"
                    else f"{v['phases_ms']['backward'] - variants['local']['phases_ms']['backward']:.1f}",
                    "" if own is None else f"{own:.1f}",
                    f"{parts['optimizer']:.1f}",
                ]
            )
    header = [
        "workload",
        "variant",
        "step ms, median (p25-p75)",
        "forward",
        "backward",
        "backward - local backward",
        "reducer's own wait",
        "optimizer",
    ]
    return _table(header, rows)


def sweep_table(ddp: dict) -> str:
    rows = []
    for name in ("cnn", "bert"):
        if name not in ddp:
            continue
        variants = ddp[name]["variants"]
        native = dict(sweep(variants, "native"))
        bucketed = dict(sweep(variants, "bucketed"))
        off = dict(sweep(variants, "bucketed", overlap=False))
        for cap in sorted(native):
            ratio = bucketed[cap]["step"]["median_ms"] / native[cap]["step"]["median_ms"]
            rows.append(
                [
                    name.upper(),
                    _cap(cap),
                    _step(native[cap]),
                    _step(bucketed[cap]),
                    f"{ratio:.2f}",
                    _step(off[cap]) if cap in off else "",
                ]
            )
        d = ("native default", "bucketed default", "bucketed default no-overlap")
        ratio = variants[d[1]]["step"]["median_ms"] / variants[d[0]]["step"]["median_ms"]
        rows.append(
            [
                name.upper(),
                "default: 25, first 1",
                _step(variants[d[0]]),
                _step(variants[d[1]]),
                f"{ratio:.2f}",
                _step(variants[d[2]]),
            ]
        )
    header = [
        "workload",
        "bucket cap (MiB)",
        "NativeDDP step ms",
        "BucketedDDP step ms",
        "Bucketed / Native",
        "Bucketed, overlap off",
    ]
    return _table(header, rows)


def skip_table(ddp: dict) -> str:
    rows = []
    for name in ("cnn", "bert"):
        if name not in ddp:
            continue
        variants = ddp[name]["variants"]
        for reducer in ("native", "bucketed"):
            base = variants[f"{reducer} default"]["per_sample"]["median_ms"]
            cells = {1: f"{base:.2f}"}
            for v in variants.values():
                if v["reducer"] == reducer and v["sync_every"] > 1:
                    value = v["per_sample"]["median_ms"]
                    cells[v["sync_every"]] = f"{value:.2f} ({value / base:.2f}x)"
            local = variants["local"]["per_sample"]["median_ms"]
            rows.append([name.upper(), reducer, *(cells.get(k, "") for k in (1, 2, 4, 8)), f"{local:.2f}"])
    return _table(["workload", "reducer", "every 1", "every 2", "every 4", "every 8", "local (no sync)"], rows)


SCALING_LABELS = {"sqrt": "val loss, lr x sqrt(k)", "linear": "val loss, lr x k"}


def curves_table(curves: dict) -> str:
    scaled = curves.get("lr_scaled", {})
    scalings = sorted({name for by_k in scaled.values() for name in by_k}, key=("sqrt", "linear").index)
    rows = []
    for k, run in curves["runs"].items():
        losses = run["losses"]
        tail = sum(losses[-20:]) / len(losses[-20:])
        rows.append(
            [
                k,
                len(losses) // int(k),
                f"{run['steady_epoch_s']['median']:.2f}",
                f"{run['microbatch_median_ms']:.1f}",
                f"{tail:.3f}",
                f"{run['val_loss']['median']:.3f}",
                *(
                    f"{scaled[k][name]['val_loss']['median']:.3f}" if name in scaled.get(k, {}) else ""
                    for name in scalings
                ),
            ]
        )
    header = [
        "sync every",
        "optimizer steps",
        "epoch s (steady)",
        "micro-batch ms",
        "train loss, last 20 (rank 0)",
        f"val loss, lr {curves['model']['lr']:g}",
        *(SCALING_LABELS[name] for name in scalings),
    ]
    return _table(header, rows)


def overhead_table(overhead: dict) -> str:
    rows = []
    for loop, v in overhead["loops"].items():
        s, fresh, f = v["step_us"], v["fresh_process_step_us"], v["first_step_s"]
        paired = v.get("paired_step_ratio")
        rows.append(
            [
                loop,
                f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})",
                f"{v.get('step_ratio_over_raw', 1.0):.2f}",
                f"{paired['median']:.2f} ({paired['min']:.2f}-{paired['max']:.2f})" if paired else "",
                f"{fresh['median']:.0f} ({fresh['min']:.0f}-{fresh['max']:.0f})",
                f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})",
            ]
        )
    header = [
        "loop",
        "us per step, one process (min-max)",
        "/ raw",
        "/ raw, paired per round (min-max)",
        "us per step, fresh processes (min-max)",
        "s from process start to first step (min-max)",
    ]
    return _table(header, rows)


def strategies_table(strategies: dict) -> str:
    rows = []
    single = strategies["strategies"]["single"]["steady_epoch_s"]["median"]
    for name, s in strategies["strategies"].items():
        e = s["steady_epoch_s"]
        rows.append(
            [
                name,
                s["devices"],
                f"{e['median']:.2f} ({e['min']:.2f}-{e['max']:.2f})",
                f"{e['median'] / single:.2f}",
                f"{s['first_microbatch_s']['median']:.2f}",
                f"{s['process_s_median']:.1f}",
                f"{s['val_loss']['median']:.4f}",
            ]
        )
    header = [
        "strategy",
        "processes",
        "epoch s, steady (min-max)",
        "/ single",
        "first step s",
        "process s (launch to end)",
        "val loss",
    ]
    return _table(header, rows)


def tables(results: dict) -> str:
    """Return every table of the report for the sections in `results`."""
    sections = results["sections"]
    parts = ["### Machine\n\n" + machine_table(results)]
    if "ddp" in sections:
        ddp = sections["ddp"]
        parts += [
            "### Latency breakdown\n\n" + breakdown_table(ddp),
            "### Bucket size and overlap\n\n" + sweep_table(ddp),
            "### Skip-sync, ms per sample\n\n" + skip_table(ddp),
        ]
    if "curves" in sections:
        parts.append("### Skip-sync, CharGPT\n\n" + curves_table(sections["curves"]))
    if "overhead" in sections:
        parts.append("### Framework overhead\n\n" + overhead_table(sections["overhead"]))
    if "strategies" in sections:
        parts.append("### Strategies\n\n" + strategies_table(sections["strategies"]))
    parts.append("### Headline\n\n```json\n" + json.dumps(results["headline"], indent=1) + "\n```")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the report's tables from a suite run's JSON.")
    parser.add_argument("results", nargs="?", type=Path, default=ROOT / "benchmarks" / "results" / "suite.json")
    args = parser.parse_args(argv)
    print(tables(json.loads(args.results.read_text())))


if __name__ == "__main__":
    main()
