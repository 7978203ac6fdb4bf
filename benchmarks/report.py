"""The report's tables (Markdown) from a suite run's JSON, so the report quotes the run's own numbers.

    python -m benchmarks report                          # print them, from benchmarks/results/suite.json
    python -m benchmarks report /tmp/syncline-benchmarks/suite_quick.json
    python -m benchmarks report --write docs/performance.md   # fill the page's marked blocks
    python -m benchmarks report --check docs/performance.md   # exit 1 if the page differs from the JSON

In the page a table lives between `<!-- report:NAME -->` and `<!-- /report:NAME -->`, NAME being one of
`BLOCKS`; `--write` replaces what is between the markers and leaves the prose around them alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .analysis import paired_ratio, sweep
from .common import ROOT
from .ddp import variant_name
from .plot import breakdown_parts

__all__ = ["BLOCKS", "blocks", "fill", "add_arguments", "command", "tables"]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _step(v: dict, digits: int = 1) -> str:
    s = v["step"]
    return f"{s['median_ms']:.{digits}f} ({s['p25_ms']:.{digits}f}-{s['p75_ms']:.{digits}f})"


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


def overlap_table(ddp: dict) -> str:
    """BucketedDDP's step without overlap / with it, at every cap measured both ways and at the default."""
    caps = sorted(
        {cap for name in ("cnn", "bert") if name in ddp for cap, _ in sweep(ddp[name]["variants"], "bucketed", False)}
    )
    rows = []
    for name in ("cnn", "bert"):
        if name not in ddp:
            continue
        variants = ddp[name]["variants"]
        on, off = dict(sweep(variants, "bucketed")), dict(sweep(variants, "bucketed", overlap=False))
        cells = [
            f"{off[cap]['step']['median_ms'] / on[cap]['step']['median_ms']:.2f}" if cap in off else "" for cap in caps
        ]
        default, no_overlap = variants["bucketed default"], variants["bucketed default no-overlap"]
        ratio = no_overlap["step"]["median_ms"] / default["step"]["median_ms"]
        paired = paired_ratio(no_overlap, default)
        rows.append([name.upper(), *cells, f"{ratio:.2f} (paired {paired['median']:.2f})"])
    return _table(["workload \\ bucket cap (MiB)", *(_cap(cap) for cap in caps), "default (25, first 1)"], rows)


def device_table(device: dict) -> str:
    """The one-device job: each variant's step and phases, relative to local and to NativeDDP."""
    rows = []
    for name, workload in device["workloads"].items():
        variants = workload["variants"]
        for precision in device["precisions"]:
            local, native = (
                variants[variant_name("local", precision)],
                variants[variant_name("native default", precision)],
            )
            for label, key in (
                ("local", "local"),
                ("NativeDDP", "native default"),
                ("BucketedDDP", "bucketed default"),
            ):
                v = variants[variant_name(key, precision)]
                median = v["step"]["median_ms"]
                digits = 3 if local["step"]["median_ms"] < 10 else 1  # the MLP's steps are fractions of a ms
                rows.append(
                    [
                        name.upper(),
                        precision,
                        label,
                        _step(v, digits),
                        *(f"{v['phases_ms'][phase]:.{digits}f}" for phase in ("forward", "backward", "optimizer")),
                        f"{median / local['step']['median_ms']:.3f}",
                        "" if key == "local" else f"{median / native['step']['median_ms']:.3f}",
                    ]
                )
    header = ["workload", "precision", "variant", "step ms, median (p25-p75)", "forward", "backward", "optimizer"]
    return _table([*header, "/ local", "/ NativeDDP"], rows)


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


def _paired(p: dict) -> str:
    return f"paired per repeat: median {p['median']:.2f}, range {p['min']:.2f}-{p['max']:.2f}"


def headline_table(results: dict) -> str:
    """The headline ratios (the paper's claims and the framework's overhead), with the spread each comes with."""
    h, sections = results["headline"], results["sections"]
    rows = []
    if "ddp" in h:
        ddp = h["ddp"]

        def per_workload(claim: str, names: list[str], cell: Callable[[dict], str]) -> None:
            if names:
                rows.append([claim, "; ".join(f"{n.upper()}{cell(ddp[n])}" for n in names)])

        names = [n for n in ("cnn", "bert", "mlp") if n in ddp]
        swept = [n for n in names if "native_sweep" in ddp[n]]
        per_workload(
            "BucketedDDP / NativeDDP, step time at the default bucket size (25 MiB, first bucket 1 MiB)",
            names,
            lambda w: (
                f" **{w['bucketed_over_native_default']:.2f}** ({_paired(w['bucketed_over_native_default_paired'])})"
            ),
        )
        per_workload(
            "worst / best bucket size (paper: can exceed 2x)",
            swept,
            lambda w: (
                f": NativeDDP **{w['native_sweep']['worst_over_best']:.2f}**, "
                f"BucketedDDP **{w['bucketed_sweep']['worst_over_best']:.2f}**"
            ),
        )
        per_workload(
            "best / worst bucket cap, MiB",
            swept,
            lambda w: ", ".join(
                f"{label} {_cap(w[key]['best_cap_mb'])} / {_cap(w[key]['worst_cap_mb'])}"
                for label, key in ((": NativeDDP", "native_sweep"), ("BucketedDDP", "bucketed_sweep"))
            ),
        )
        per_workload(
            "overlap speedup: BucketedDDP step without / with overlap, default size (paper: 1.21-1.27 on Gloo)",
            names,
            lambda w: f" **{w['overlap_speedup_default']:.2f}** ({_paired(w['overlap_speedup_default_paired'])})",
        )
        per_workload(
            "overlap speedup at the other swept sizes",
            [n for n in swept if "overlap_speedup_by_cap" in ddp[n]],
            lambda w: (
                f" {min(w['overlap_speedup_by_cap'].values()):.2f}-{max(w['overlap_speedup_by_cap'].values()):.2f}"
            ),
        )
        skip = [n for n in swept if "skip_sync_time_per_sample_vs_every_step" in ddp[n]]
        k = max((int(k) for n in skip for k in ddp[n]["skip_sync_time_per_sample_vs_every_step"]["native"]), default=1)
        per_workload(
            f"skip-sync: time per sample, synchronizing every {k} micro-batches / every one",
            skip,
            lambda w: (
                ": "
                + ", ".join(
                    f"{label} {w['skip_sync_time_per_sample_vs_every_step'][reducer][str(k)]:.2f}"
                    for label, reducer in (("BucketedDDP", "bucketed"), ("NativeDDP", "native"))
                )
            ),
        )
    if "device" in h:
        device = h["device"]
        where = f"{device['device']}, world size 1, {results['sections']['device']['device_name']}"
        names = [n for n in device if n != "device"]
        rows.append(
            [
                f"one device ({where}): reducer step / local step, no communication",
                "; ".join(
                    f"{n.upper()}: BucketedDDP **{device[n]['32']['bucketed_over_local']:.3f}**, "
                    f"NativeDDP **{device[n]['32']['native_over_local']:.3f}**"
                    for n in names
                ),
            ]
        )
        for precision in results["sections"]["device"]["precisions"][1:]:
            rows.append(
                [
                    f"{precision}: local step / fp32 local step; BucketedDDP / NativeDDP",
                    "; ".join(
                        f"{n.upper()}: {device[n][precision]['local_over_fp32_local']:.2f}; "
                        f"{device[n][precision]['bucketed_over_native']:.3f}"
                        for n in names
                    ),
                ]
            )
    if "curves_val_loss_by_sync_every" in h:
        ks = list(h["curves_val_loss_by_sync_every"])
        best = h["curves_best_val_loss_by_sync_every"]
        samples = sections["curves"]["microbatches"] * sections["curves"]["model"]["batch_size"] * 2
        rows.append(
            [
                f"skip-sync: CharGPT validation loss after {samples:,} samples, sync every {' / '.join(ks)}",
                "base lr: "
                + " / ".join(f"{v:.3f}" for v in h["curves_val_loss_by_sync_every"].values())
                + "; best lr tried: "
                + " / ".join(f"{best[k]['val_loss']:.3f} ({best[k]['lr_scaling']})" for k in ks),
            ]
        )
    if "overhead" in h:
        o = h["overhead"]
        for loop, label in (("trainer", "Trainer"), ("lightning", "Lightning")):
            if f"{loop}_over_raw_step" in o:
                rows.append(
                    [
                        f"{label} / raw loop, time per step (tiny MLP)",
                        f"**{o[f'{loop}_over_raw_step']:.2f}** in one process, interleaved (paired median "
                        f"{o[f'{loop}_over_raw_step_paired_median']:.2f}); "
                        f"{o[f'{loop}_over_raw_step_fresh_processes']:.2f} in fresh processes",
                    ]
                )
        loops = [loop for loop in ("raw", "trainer", "lightning") if f"{loop}_first_step_s" in o]
        rows.append(
            [
                f"seconds from process start to first step: {' / '.join(loops)}",
                " / ".join(f"{o[f'{loop}_first_step_s']:.2f}" for loop in loops),
            ]
        )
    if "strategies" in h:
        s = h["strategies"]
        steps = sections["strategies"]["steps"]
        rows.append(
            [
                f"CharGPT, {steps} steps: epoch time / single process",
                ", ".join(f"{name} {v['steady_epoch_vs_single']:.2f}" for name, v in s.items() if name != "single")
                + "; validation loss "
                + ", ".join(f"{name} {v['val_loss']:.4f}" for name, v in s.items()),
            ]
        )
    return _table(["claim", "measured here"], rows)


def _section_block(name: str, make: Callable[[dict], str]) -> Callable[[dict], str | None]:
    return lambda results: make(results["sections"][name]) if name in results["sections"] else None


#: The page's blocks, by the NAME of their markers: each makes its table from a run, or None without its section.
BLOCKS: dict[str, Callable[[dict], str | None]] = {
    "headline": headline_table,
    "machine": machine_table,
    "breakdown": _section_block("ddp", breakdown_table),
    "sweep": _section_block("ddp", sweep_table),
    "overlap": _section_block("ddp", overlap_table),
    "skip": _section_block("ddp", skip_table),
    "device": _section_block("device", device_table),
    "curves": _section_block("curves", curves_table),
    "overhead": _section_block("overhead", overhead_table),
    "strategies": _section_block("strategies", strategies_table),
}

_BLOCK = re.compile(r"(<!-- report:(\w+) -->\n)(?:.*?\n)?(<!-- /report:\2 -->)", re.DOTALL)


def blocks(page: str) -> list[str]:
    """The names of the marked blocks in `page`, in order."""
    return [match.group(2) for match in _BLOCK.finditer(page)]


def fill(page: str, results: dict) -> str:
    """Return `page` with every marked block replaced by its table from `results`.

    Raises:
        ValueError: a block names no table, or the run lacks the section a block needs.
    """

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in BLOCKS:
            raise ValueError(f"unknown report block {name!r}; valid: {', '.join(BLOCKS)}")
        table = BLOCKS[name](results)
        if table is None:
            raise ValueError(f"report block {name!r} needs a section this run lacks: rerun `python -m benchmarks`")
        # Blank lines around the table: Markdown then sees it as a block of its own between the comments.
        return f"{match.group(1)}\n{table}\n\n{match.group(3)}"

    return _BLOCK.sub(replace, page)


TITLES = {
    "headline": "Headline",
    "machine": "Machine",
    "breakdown": "Latency breakdown",
    "sweep": "Bucket size and overlap",
    "overlap": "Overlap speedup (step without / with overlap)",
    "skip": "Skip-sync, ms per sample",
    "device": "One device, world size 1",
    "curves": "Skip-sync, CharGPT",
    "overhead": "Framework overhead",
    "strategies": "Strategies",
}


def tables(results: dict) -> str:
    """Return every table of the report for the sections in `results`, and the headline JSON."""
    parts = [f"### {TITLES[name]}\n\n{table}" for name, make in BLOCKS.items() if (table := make(results))]
    parts.append("### Headline ratios (JSON)\n\n```json\n" + json.dumps(results["headline"], indent=1) + "\n```")
    return "\n\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("results", nargs="?", type=Path, default=ROOT / "benchmarks" / "results" / "suite.json")
    page = parser.add_mutually_exclusive_group()
    page.add_argument("--write", type=Path, metavar="PAGE", help="fill the marked blocks of PAGE in place")
    page.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if PAGE's blocks differ from the JSON")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    results = json.loads(args.results.read_text())
    target = args.write or args.check
    if target is None:
        print(tables(results))
        return
    text = target.read_text()
    try:
        filled = fill(text, results)
    except ValueError as error:
        sys.exit(f"{target}: {error}")
    if args.write:
        target.write_text(filled)
        print(f"{target}: filled {', '.join(blocks(text))} from {args.results}")
    elif filled != text:
        sys.exit(f"{target}: its tables differ from {args.results}; run `python -m benchmarks report --write {target}`")
