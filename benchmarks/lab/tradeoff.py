"""BAGUA's trade-off in the network lab: wall time to a fixed validation loss, strategy x link rate x nodes.

BAGUA's claim is that relaxed synchronization (compressed, delayed or decentralized) reaches a model's
target quality sooner than exact all-reduce where the network is slow, and costs little where it is not.
This runs the claim on the default example: `examples/char_gpt.py`'s CharGPT with its default
hyperparameters and schedule (one epoch of 439 steps of 32 windows), the global batch split over the
nodes (16 windows per rank on 2 nodes, 8 on 4), one process per node with one thread, in a lab cluster
(`cluster.py`) whose links are unshaped or shaped to 1 Gbit/s or 100 Mbit/s.

Every strategy trains until the validation loss (the first `val_batches` x 32 windows of the validation
text, the same windows at any node count, every `val_every` steps) first reaches `target`, or until the
epoch ends, or, with ``--max-seconds N``, until the first validation after N training seconds (rank 0's
clock): such a run is reported "not within N s", and a speed-up against it is a bound ("> 9.00x" for a run
that reached the target where `bucketed_ddp` was stopped; "< 0.50x" the other way). At 10 Mbit/s on 4 nodes
`bucketed_ddp` takes about 4 s per step, a quarter of an hour to the target. Reported per run: the training
seconds to the target (validations left out; rank 0's clock, which every synchronous strategy shares and
which the asynchronous ones meet at every validation), the steps it took, seconds per step, the bytes per
step the strategy handed to collectives (`comm/bytes`), and the speed-up over `bucketed_ddp` in the same cell.

torch's own relaxations run in the same cells as syncline's, at the same settings: `native_ddp` with torch's
PowerSGD hook (rank 4, 10 exact iterations, as `powersgd`) and with torch's post-local SGD hook and
`PeriodicModelAverager` (period 4, no warm-up, as `local_sgd`); each row also shows the ratio of syncline's
time to torch's. They run in torchrun jobs of their own (`TORCH_ROWS`), so a run that fails (torch's PowerSGD
hook died of a collective-size mismatch on gloo in every 4-node run of 2026-11-26) is recorded as a failure and
counted over repeats (``--repeat``) instead of ending the grid. Where torchft imports (`pip install
'syncline[ft]'`), torchft's DiLoCo runs the same way beside syncline's ``diloco`` rows at H=20 (outer momentum
0.5), 50 and 100 (`ft_diloco.py`); elsewhere those rows are skipped with one line.

    python -m syncline.lab tradeoff --nodes 2 4 --rates none 1gbit 100mbit --out tradeoff.json  # about 50 minutes
    python -m syncline.lab tradeoff --nodes 4 --rates 10mbit --only bucketed_ddp powersgd "diloco H=100"
    python -m syncline.lab tradeoff --nodes 4 --rates 10mbit --max-seconds 600 --runs 3 --out tradeoff.json  # resumable
    python -m syncline.lab tradeoff --out tradeoff.json --plot tradeoff.png --write page.md  # from the JSON

With ``--out`` the runs are merged into the file (a cell's earlier runs replaced, or with ``--repeat`` kept for
medians); without it they are only printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import ft_diloco
from .cluster import (
    UNAVAILABLE,
    StallGuard,
    add_worker_argument,
    lab_rate,
    lab_unavailable,
    lab_worker,
    run_isolating,
    run_worker_if_asked,
    run_worker_job,
)
from .records import QUIET_TRAINER, fill_marked_block
from .strategies import TORCH_ROWS

__all__ = [
    "COUNTERPARTS",
    "STRATEGIES",
    "TARGET_LOSS",
    "fill_page",
    "marker_of",
    "grid_tables",
    "run_cell",
    "bytes_table",
    "run_cell_counting_failures",
    "speedups",
    "table",
]

#: The validation loss every run trains to. The default run (`python -m syncline`) ends its epoch at
#: about 1.69 on 20 validation batches; `bucketed_ddp` reaches this at about 60% of the epoch, which
#: leaves the relaxations room to take more steps.
TARGET_LOSS = 1.95

#: (label, registered name, options): every strategy at its defaults, and the bf16 communication hook.
STRATEGIES: list[tuple[str, str, dict[str, Any]]] = [
    ("bucketed_ddp", "bucketed_ddp", {}),
    ("native_ddp", "native_ddp", {}),
    ("bucketed_ddp bf16", "bucketed_ddp", {"comm_hook": "bf16"}),
    ("tensor_fusion", "tensor_fusion", {}),
    ("bytegrad", "bytegrad", {}),
    ("powersgd", "powersgd", {}),
    ("qadam", "qadam", {}),
    ("local_sgd", "local_sgd", {}),
    # DiLoCo's outer Nesterov step every H inner AdamW steps (the epoch has 439: H=500 never exchanges within it);
    # at H=20 the paper's outer momentum 0.9 overshoots within one epoch (4 nodes: loss 2.30 after 430 steps), 0.5
    # does not. Streaming DiLoCo: 4 fragments, each exchanged every H steps, H/4 apart, merged at alpha 0.5 after
    # overlapping one inner step (or 4, behind which 8-bit fragments fit at 10 Mbit/s). Of twelve more 8-bit settings
    # (docs/performance.md, "Steps to the loss"), outer momentum 0.8 gave the lowest losses on the way (390 steps to
    # the target, as 0.9), and 2 fragments every 14 steps behind 6, the shortest period tried whose exchanges stay
    # hidden at 10 Mbit/s, 420.
    ("diloco H=20 outer_momentum=0.5", "diloco", {"period": 20, "outer_momentum": 0.5}),
    ("diloco H=50", "diloco", {"period": 50}),
    ("diloco H=100", "diloco", {"period": 100}),
    ("diloco H=500", "diloco", {"period": 500}),
    ("streaming diloco H=100 F=4", "diloco", {"period": 100, "fragments": 4}),
    ("streaming diloco H=100 F=4 uint8", "diloco", {"period": 100, "fragments": 4, "compression": "uint8"}),
    (
        "streaming diloco H=20 F=4 uint8 overlap=4",
        "diloco",
        {"period": 20, "fragments": 4, "overlap_steps": 4, "compression": "uint8"},
    ),
    (
        "streaming diloco H=20 F=4 uint8 overlap=4 outer_momentum=0.8",
        "diloco",
        {"period": 20, "fragments": 4, "overlap_steps": 4, "compression": "uint8", "outer_momentum": 0.8},
    ),
    (
        "streaming diloco H=14 F=2 uint8 overlap=6 outer_lr=1.0 outer_momentum=0.5",
        "diloco",
        {
            "period": 14,
            "fragments": 2,
            "overlap_steps": 6,
            "compression": "uint8",
            "outer_lr": 1.0,
            "outer_momentum": 0.5,
        },
    ),
    ("decentralized", "decentralized", {}),
    ("async_model_average", "async_model_average", {}),
    ("parameter_server", "parameter_server", {}),
    ("sharded_parameter_server", "sharded_parameter_server", {}),
    ("torch powersgd", "native_ddp", {"comm_hook": "powersgd"}),
    ("torch post-local sgd", "native_ddp", {"comm_hook": "post_local_sgd"}),
    # torchft's DiLoCo at the settings of syncline's rows (`ft_diloco.py`); where torchft imports.
    ("torchft diloco H=20 outer_momentum=0.5", ft_diloco.NAME, {"period": 20, "outer_momentum": 0.5}),
    ("torchft diloco H=50", ft_diloco.NAME, {"period": 50}),
    ("torchft diloco H=100", ft_diloco.NAME, {"period": 100}),
]

#: The words of a DiLoCo row's label and the `DiLoCo` option each sets (with its type).
_DILOCO_WORDS: dict[str, tuple[str, type]] = {
    "H": ("period", int),
    "F": ("fragments", int),
    "overlap": ("overlap_steps", int),
    "alpha": ("alpha", float),
    "outer_lr": ("outer_lr", float),
    "outer_momentum": ("outer_momentum", float),
}


def diloco_row(label: str) -> tuple[str, str, dict[str, Any]] | None:
    """The row a DiLoCo label names in the rows' own words, for settings beyond `STRATEGIES` (tuning runs):
    ``[streaming] diloco`` then ``H=<period>``, ``F=<fragments>``, ``overlap=<steps>``, ``alpha=``, ``outer_lr=``,
    ``outer_momentum=``, ``uint8`` or ``bf16`` (the compression) and ``carry`` (the merge). None if it is not one."""
    words = label.split()
    words = words[1:] if words[:1] == ["streaming"] else words
    if words[:1] != ["diloco"]:
        return None
    options: dict[str, Any] = {}
    for word in words[1:]:
        key, _, value = word.partition("=")
        if word in ("uint8", "bf16"):
            options["compression"] = word
        elif word == "carry":
            options["merge"] = "carry"
        elif key in _DILOCO_WORDS and value:
            name, kind = _DILOCO_WORDS[key]
            try:
                options[name] = kind(value)
            except ValueError:
                return None
        else:
            return None
    return label, "diloco", options


def chosen_rows(labels: list[str] | None) -> list[tuple[str, str, dict[str, Any]]]:
    """The rows `--only` names (every row of `STRATEGIES` without it), DiLoCo settings beyond them included.

    Raises:
        SystemExit: a label is neither a row nor a DiLoCo setting.
    """
    if not labels:
        return list(STRATEGIES)
    known = {row[0]: row for row in STRATEGIES}
    extra = {label: diloco_row(label) for label in labels if label not in known}
    unknown = [label for label, row in extra.items() if row is None]
    if unknown:
        sys.exit(
            f"--only {' '.join(map(repr, unknown))}: no such row. Rows: {', '.join(map(repr, known))}; or a DiLoCo "
            "setting in the same words, e.g. 'streaming diloco H=12 F=4 uint8 overlap=2 carry outer_lr=1.0'."
        )
    # The rows in the table's order, then the other settings in the order given.
    return [row for row in STRATEGIES if row[0] in labels] + [row for row in extra.values() if row is not None]


#: Each reference row beside the syncline strategy it is compared with: (its label, syncline's label).
COUNTERPARTS = {
    "torch powersgd": "powersgd",
    "torch post-local sgd": "local_sgd",
    "torchft diloco H=20 outer_momentum=0.5": "diloco H=20 outer_momentum=0.5",
    "torchft diloco H=50": "diloco H=50",
    "torchft diloco H=100": "diloco H=100",
}

#: The rows run by other libraries, each in a job of its own (`run_isolating`): torch's and torchft's.
ISOLATED = (*TORCH_ROWS, *(label for label, name, _ in STRATEGIES if name == ft_diloco.NAME))

GLOBAL_BATCH = 32


# ------------------------------------------------------------------ inside the torchrun job
def _worker(spec: dict[str, Any]) -> None:
    """Train CharGPT with every strategy of `spec` until the target loss; rank 0 writes the records."""
    import torch
    import torch.distributed as dist

    from syncline.callbacks import Callback
    from syncline.examples.char_gpt import CharGPT
    from syncline.strategies import STRATEGIES as REGISTRY
    from syncline.trainer import Trainer
    from syncline.trainer.seed import seed_everything

    from .step_recorder import StepRecorder, step_times

    torch.set_num_threads(1)
    target, max_seconds = spec["target"], spec.get("max_seconds")

    class StopAtLoss(Callback):
        """Stop once the validation loss (reduced over the ranks, so every rank agrees) reaches `target`, or once
        rank 0 has trained `max_seconds` (validations left out), which every rank learns by a reduction."""

        def __init__(self, recorder: StepRecorder) -> None:
            self.recorder = recorder
            self.capped = False

        def on_validation_end(self, trainer: Trainer, task: CharGPT) -> None:
            if float(trainer.callback_metrics["val_loss"]) <= target:
                trainer.should_stop = True
            elif max_seconds is not None:
                times = step_times(self.recorder.start, self.recorder.step_ends, self.recorder.validations)
                spent = times["train_s_at_step"][-1] if trainer.is_global_zero and self.recorder.step_ends else 0.0
                # Collective: rank 0's training seconds on every rank (the others add 0), so all stop alike.
                if float(trainer.strategy.reduce(torch.tensor([spent]), "max")) >= max_seconds:
                    trainer.should_stop = self.capped = True

    class Heartbeat(Callback):
        """Tell the stall guard that a step ended."""

        reads_parameters = False

        def __init__(self, guard: StallGuard) -> None:
            self.guard = guard

        def on_train_batch_end(self, trainer: Trainer, task: CharGPT, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.guard.beat()

    records = []
    for label, name, options in spec["strategies"]:
        if name == ft_diloco.NAME:
            records.append(ft_diloco.train_to_target(label, options, spec, GLOBAL_BATCH))
            continue
        seed_everything(0)
        world = int(os.environ["WORLD_SIZE"])  # torchrun's; the process group starts in fit
        task = CharGPT(batch_size=GLOBAL_BATCH // world, sample_chars=0)
        recorder = StepRecorder()
        stop = StopAtLoss(recorder)
        guard = StallGuard(label)
        trainer = Trainer(
            max_steps=spec["max_steps"],
            val_check_interval=spec["val_every"],
            limit_val_batches=spec["val_batches"],  # per rank: val_batches x 32 windows in all
            strategy=REGISTRY[name](**options),
            callbacks=[recorder, stop, Heartbeat(guard)],
            **QUIET_TRAINER,
            seed=0,
        )
        trainer.fit(task)
        guard.stop()
        times = step_times(recorder.start, recorder.step_ends, recorder.validations)
        reached = next(((s, v) for s, _, v in recorder.validations if v <= target), None)
        steps = reached[0] if reached else len(recorder.step_ends)
        records.append(
            {
                "label": label,
                "strategy": name,
                "options": options,
                "reached": reached is not None,
                # Stopped by --max-seconds: it would have needed longer than that (None: no cap).
                "capped": stop.capped and reached is None,
                "max_seconds": max_seconds,
                "steps": steps,
                "seconds": times["train_s_at_step"][steps - 1],
                "step_s": round(times["train_s_at_step"][steps - 1] / steps, 4),
                "validations": [[s, round(v, 4)] for s, _, v in recorder.validations],
                "train_s_at_validation": [times["train_s_at_step"][s - 1] for s, _, _ in recorder.validations],
                # Over the whole run: periodic and background strategies send unevenly.
                "comm_bytes_per_step": recorder.comm.get("comm/total_bytes", 0.0) / len(recorder.step_ends),
                # The most one step sent (rank 0's, one process per node): what the link must carry at once.
                "peak_comm_bytes_per_step": recorder.peak_comm_bytes,
            }
        )
        if dist.get_rank() == 0:
            print(f"{label}: {records[-1]['seconds']:.1f} s, {steps} steps, reached={reached}", flush=True)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(records, indent=1) + "\n")


# ------------------------------------------------------------------ the parent
def run_cell(
    nodes: int,
    rate: str | None,
    strategies: list[tuple[str, str, dict[str, Any]]] | None = None,
    target: float = TARGET_LOSS,
    max_steps: int = 439,
    val_every: int = 10,
    val_batches: int = 8,
    max_seconds: float | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """Train every strategy to `target` on a lab cluster of `nodes` nodes at `rate`; one record each. A run stops
    at the first validation after `max_seconds` training seconds (None: at the target or the epoch's end); the
    job's `timeout` (None: an hour, or twice every run's cap and ten minutes each where that is more)."""
    strategies = strategies or STRATEGIES
    spec = {
        "strategies": strategies,
        "target": target,
        "max_steps": max_steps,
        "val_every": val_every,
        "val_batches": val_batches,
        "max_seconds": max_seconds,
    }
    if timeout is None:
        timeout = 3600.0 if max_seconds is None else max(3600.0, len(strategies) * (2 * max_seconds + 600))
    records = run_worker_job(lab_worker("tradeoff"), spec, nodes, rate, timeout)
    for record in records:
        record.update(nodes=nodes, rate=rate or "unshaped")
    return records


def run_cell_counting_failures(
    nodes: int, rate: str | None, strategies: list[tuple[str, str, dict[str, Any]]], **options: Any
) -> list[dict[str, Any]]:
    """`run_cell` for the shared strategies in one job, and each of `ISOLATED` in a job of its own, whose failure
    becomes a record (``failed``, the error's `root_cause`) instead of ending the grid (`run_isolating`)."""
    records = run_isolating(lambda some: run_cell(nodes, rate, some, **options), strategies, ISOLATED)
    for record in records:
        if record.get("failed"):
            record.update(reached=False, steps=0, seconds=0.0, step_s=0.0, comm_bytes_per_step=0.0)
            record.update(nodes=nodes, rate=rate or "unshaped")
    return records


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (nodes, rate, label): its median run by seconds to the target (never reached: slowest).

    Failed runs (``failed``) are left out of the median and counted: the row gains ``failures``, with
    ``repeats`` (every run, failed ones included) and ``seconds_runs`` (the runs that did not fail, one that never
    reached the target as inf). With an even number of runs the lower median counts; a cell whose every run
    failed keeps a failed row.
    """
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["nodes"], r["rate"], r["label"]), []).append(r)
    out = []
    for group in groups.values():
        runs = sorted(
            (r for r in group if not r.get("failed")), key=lambda r: r["seconds"] if r["reached"] else math.inf
        )
        failures = len(group) - len(runs)
        median = runs[(len(runs) - 1) // 2] if runs else group[0]
        seconds = [r["seconds"] if r["reached"] else math.inf for r in runs]
        out.append({**median, "repeats": len(group), "failures": failures, "seconds_runs": seconds})
    return out


def speedups(rows: list[dict[str, Any]]) -> dict[tuple[int, str, str], float]:
    """(nodes, rate, label) -> bucketed_ddp's seconds to the target over this strategy's (0: never).

    `rows` hold one run per cell: single runs, or `medians` of repeated ones. A run stopped by its time cap
    (`capped`) needed longer than the cap, so a speed-up against it is a bound, computed with the cap for its
    seconds, whose side `bounds` gives; where both were stopped there is none.
    """
    return {key: up for key, (up, _) in _speedups(rows).items()}


def bounds(rows: list[dict[str, Any]]) -> dict[tuple[int, str, str], str]:
    """(nodes, rate, label) -> ">" or "<" where `speedups` gives a bound (a capped run on one side), else ""."""
    return {key: side for key, (_, side) in _speedups(rows).items()}


def _speedups(rows: list[dict[str, Any]]) -> dict[tuple[int, str, str], tuple[float, str]]:
    reference = {
        (r["nodes"], r["rate"]): r
        for r in rows
        if r["label"] == "bucketed_ddp" and (r["reached"] or r.get("capped")) and not r.get("failed")
    }
    out = {}
    for r in rows:
        ref = reference.get((r["nodes"], r["rate"]))
        key = (r["nodes"], r["rate"], r["label"])
        if ref is None or (ref.get("capped") and r.get("capped")):
            continue
        if not r["reached"] and not r.get("capped"):
            out[key] = (0.0, "")  # the whole run without reaching it
        elif ref.get("capped"):
            out[key] = (ref["max_seconds"] / r["seconds"], ">")  # bucketed_ddp needed more than its cap
        elif r.get("capped"):
            out[key] = (ref["seconds"] / r["max_seconds"], "<")
        else:
            out[key] = (ref["seconds"] / r["seconds"], "")
    return out


RATES = ("unshaped", "1gbit", "100mbit", "10mbit")
MARKER = "lab-tradeoff"


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown row per run: seconds and steps to the target, s/step, mean and peak bytes/step, speed-up."""
    ups, sides = speedups(rows), bounds(rows)
    lines = [
        "| nodes | link | strategy | seconds to target | steps | s/step | comm/bytes per step | peak | vs ddp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        up = ups.get((r["nodes"], r["rate"], r["label"]))
        cells = [
            r["nodes"],
            r["rate"],
            r["label"],
            _seconds(r),
            r["steps"],
            f"{r['step_s']:.3f}",
            f"{r['comm_bytes_per_step'] / 1e6:.2f} MB",
            _megabytes(r.get("peak_comm_bytes_per_step")),
            _speedup(up, sides.get((r["nodes"], r["rate"], r["label"]), "")),
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _megabytes(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.2f} MB"


def _seconds(r: dict[str, Any]) -> str:
    if r.get("failed"):
        return f"failed ({r.get('error', '')[:80]})"
    if r.get("capped"):
        return f"not within {r['max_seconds']:g} s"
    return f"{r['seconds']:.1f}" if r["reached"] else f"not reached ({r['seconds']:.0f} s)"


def _speedup(up: float | None, side: str = "") -> str:
    """A speed-up as the tables write it; `side` ">" or "<" makes it a bound."""
    if up is None:
        return "-"
    return "never" if up == 0 else f"{side + ' ' if side else ''}{up:.2f}x"


def grid_tables(data: dict[str, Any]) -> str:
    """Per node count, one row per strategy: seconds (steps) to the target and the speed-up, per link rate; torch's
    rows also say how many of their runs failed, and syncline's counterpart's time over theirs. The bytes per step
    are a last column where each strategy's are the same at every rate (the numerics do not depend on the link),
    else a table of their own."""
    rows = medians(data["rows"])
    ups, sides = speedups(rows), bounds(rows)
    labels = [label for label, _, _ in STRATEGIES if any(r["label"] == label for r in rows)]
    out = []
    for nodes in sorted({r["nodes"] for r in rows}):
        rates = [rate for rate in RATES if any(r["nodes"] == nodes and r["rate"] == rate for r in rows)]
        cells = {(r["rate"], r["label"]): r for r in rows if r["nodes"] == nodes}
        sent = {key: _bytes(r) for key, r in cells.items() if "peak_comm_bytes_per_step" in r and not r.get("failed")}
        one_column = bool(sent) and all(
            len({sent.get((rate, label)) for rate in rates} - {None}) <= 1 for label in labels
        )
        head = ["strategy"] + [f"{rate}: s (steps) | vs bucketed_ddp" for rate in rates]
        title = f"{nodes} nodes, training seconds to validation loss {data['target']}"
        if one_column:
            head.append("bytes per step per node, mean / peak")
            title += ", and bytes per step per node (mean over the run / peak step, the same at every rate)"
        lines = [f"{title}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * (1 + 2 * len(rates) + one_column)]
        for label in labels:
            line = [label]
            for rate in rates:
                r = cells.get((rate, label))
                if r is None:
                    line += ["-", "-"]
                    continue
                if r.get("failed"):
                    seconds = "failed"
                elif r.get("capped"):
                    seconds = f"> {r['max_seconds']:g} (not within {r['max_seconds']:g} s, {r['steps']} steps)"
                else:
                    seconds = f"{r['seconds']:.1f} ({r['steps']})" if r["reached"] else f"> {r['seconds']:.0f} (never)"
                if r["repeats"] > 1:
                    finite = [x for x in r["seconds_runs"] if math.isfinite(x)]
                    seconds += f", {min(finite):.1f}-{max(finite):.1f}" if finite else ""
                if r.get("failures"):
                    seconds += f", {r['failures']}/{r['repeats']} failed"
                ours = cells.get((rate, COUNTERPARTS.get(label, "")))
                if ours is not None and r["reached"] and ours["reached"]:
                    seconds += f"; {COUNTERPARTS[label]} {r['seconds'] / ours['seconds']:.2f}x sooner"
                key = (nodes, rate, label)
                line += [seconds, _speedup(ups.get(key), sides.get(key, ""))]
            if one_column:
                line.append(next((sent[rate, label] for rate in rates if (rate, label) in sent), "-"))
            lines.append("| " + " | ".join(line) + " |")
        out.append("\n".join(lines))
        if not one_column:
            out.append(bytes_table([r for r in rows if r["nodes"] == nodes], rates, labels))
    return "\n\n".join(part for part in out if part)


def bytes_table(rows: list[dict[str, Any]], rates: list[str], labels: list[str]) -> str:
    """Mean and peak bytes per step per node of one node count's median runs, per link rate ("" for runs recorded
    before the peak was)."""
    cells = {(r["rate"], r["label"]): r for r in rows if "peak_comm_bytes_per_step" in r and not r.get("failed")}
    if not cells:
        return ""
    lines = [
        f"{rows[0]['nodes']} nodes, bytes per step per node (mean over the run / peak step):",
        "",
        "| strategy | " + " | ".join(f"{rate}: mean / peak" for rate in rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for label in labels:
        found = [cells.get((rate, label)) for rate in rates]
        if any(found):
            lines.append("| " + " | ".join([label, *("-" if r is None else _bytes(r) for r in found)]) + " |")
    return "\n".join(lines)


def _bytes(run: dict[str, Any]) -> str:
    """A run's mean and peak bytes per step per node, as the tables show them."""
    return f"{_megabytes(run['comm_bytes_per_step'])} / {_megabytes(run['peak_comm_bytes_per_step'])}"


def fill_page(page: str, data: dict[str, Any], marker: str = MARKER) -> str:
    """Return `page` with its `<!-- marker -->` block replaced by `grid_tables(data)`."""
    return fill_marked_block(page, marker, grid_tables(data))


def marker_of(results: Path) -> str:
    """The page block a results file fills: its name with dashes (`lab_tradeoff_torch.json`: `lab-tradeoff-torch`)."""
    return results.stem.replace("_", "-")


def plot(data: dict[str, Any], out: Path) -> None:
    """Seconds to the target per strategy, one bar per link rate, one panel per node count (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = medians(data["rows"])
    node_counts = sorted({r["nodes"] for r in rows})
    rates = [rate for rate in RATES if any(r["rate"] == rate for r in rows)]
    labels = [label for label, _, _ in STRATEGIES if any(r["label"] == label for r in rows)]
    colors = {"unshaped": "#55A868", "1gbit": "#4C72B0", "100mbit": "#C44E52", "10mbit": "#8172B2"}
    fig, axes = plt.subplots(len(node_counts), 1, figsize=(11, 3.6 * len(node_counts)), squeeze=False)
    width = 0.8 / len(rates)
    for ax, nodes in zip(axes[:, 0], node_counts):
        for i, rate in enumerate(rates):
            cell = {r["label"]: r for r in rows if r["nodes"] == nodes and r["rate"] == rate}
            xs = [j + (i - (len(rates) - 1) / 2) * width for j in range(len(labels))]
            heights = [cell[label]["seconds"] if label in cell else math.nan for label in labels]
            bars = ax.bar(xs, heights, width, color=colors[rate], label=rate)
            for x, bar, label in zip(xs, bars, labels):
                if label in cell and cell[label].get("failed"):  # every run failed: no bar, a mark at its place
                    ax.annotate("failed", (x, 0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                                textcoords="offset points", rotation=90, ha="center", va="bottom", fontsize=7,
                                color=colors[rate])  # fmt: skip
                elif label in cell and not cell[label]["reached"]:
                    bar.set_hatch("//")
                    bar.set_alpha(0.5)
        ax.set_yscale("log")
        ax.set_ylabel("training seconds to target")
        target = data["target"]
        ax.set_title(f"{nodes} nodes: seconds to validation loss {target} (hatched: not reached, or not in time)")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([label.replace(" ", "\n").replace("_", "_\n", 1) for label in labels], fontsize=8)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(title="link", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    add_worker_argument(parser)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--rates", type=lab_rate, nargs="+", default=[None, "1gbit", "100mbit"], help="tc rates, or none"
    )
    parser.add_argument(
        "--only",
        nargs="*",
        help="labels of the strategies to run (default: all), or DiLoCo settings in the labels' words",
    )
    parser.add_argument(
        "--repeat", action="store_true", help="add these runs to the cells' earlier ones (medians), not replace them"
    )
    parser.add_argument(
        "--runs",
        type=int,
        metavar="K",
        help="bring every (nodes, rate, strategy) to K runs in --out, a pass over the grid at a time, adding to "
        "the runs it holds (the same command goes on after a stop)",
    )
    parser.add_argument("--target", type=float, default=TARGET_LOSS)
    parser.add_argument(
        "--max-seconds",
        type=float,
        help="stop a run at the first validation after this many training seconds; it is reported as not within them",
    )
    parser.add_argument("--max-steps", type=int, default=439)
    parser.add_argument("--out", type=Path, help="merge the runs into this JSON file (without it: only printed)")
    parser.add_argument("--plot", type=Path, help="only draw the figure from --out's JSON into this PNG")
    parser.add_argument(
        "--write", type=Path, metavar="PAGE", help="only fill PAGE's block named after --out (lab-tradeoff, ...)"
    )


def command(args: argparse.Namespace) -> int | None:
    """Run every cell asked for, print its table, and write the JSON (merged into an existing file)."""
    if run_worker_if_asked(args, _worker):
        return 0
    if (args.plot or args.write) and args.out is None:
        sys.exit("--plot and --write draw from the runs of a JSON file: name it with --out.")
    if args.plot or args.write:
        data = json.loads(args.out.read_text())
        if args.plot:
            plot(data, args.plot)
            print(f"wrote {args.plot}")
        if args.write:
            try:
                args.write.write_text(fill_page(args.write.read_text(), data, marker_of(args.out)))
            except ValueError as error:
                sys.exit(f"{args.write}: {error}")
            print(f"{args.write}: filled the trade-off tables from {args.out}")
        return 0
    if lab_unavailable("lab tradeoff"):
        return UNAVAILABLE
    strategies = chosen_rows(args.only)
    skipped = ft_diloco.missing("torchft's DiLoCo rows")
    if skipped and any(name == ft_diloco.NAME for _, name, _ in strategies):
        print(skipped)
        strategies = [s for s in strategies if s[1] != ft_diloco.NAME]
        if not strategies:
            return 0
    data = json.loads(args.out.read_text()) if args.out and args.out.is_file() else {"target": args.target, "rows": []}
    if data["target"] != args.target:
        sys.exit(f"{args.out} holds runs to target {data['target']}, not {args.target}: pass another --out")
    if args.runs is not None and args.repeat:
        sys.exit("--runs K adds runs to the cells that hold fewer than K, --repeat to every cell: pass one of them")
    # With --runs K, pass k over the grid runs what holds fewer than k runs: the same command goes on after a stop.
    for wanted in range(1, args.runs + 1) if args.runs else [None]:
        for nodes in args.nodes:
            for rate in args.rates:
                cell = (nodes, rate or "unshaped")
                held = Counter(r["label"] for r in data["rows"] if (r["nodes"], r["rate"]) == cell)
                todo = [s for s in strategies if wanted is None or held[s[0]] < wanted]
                if not todo:
                    continue
                started = time.monotonic()
                new = run_cell_counting_failures(
                    nodes, rate, todo, target=args.target, max_steps=args.max_steps, max_seconds=args.max_seconds
                )
                took = time.monotonic() - started
                print(f"\n{nodes} nodes, {rate or 'unshaped'} ({took:.0f} s)\n{table(new)}", flush=True)
                done = {(r["nodes"], r["rate"], r["label"]) for r in new}
                if not args.repeat and wanted is None:
                    data["rows"] = [r for r in data["rows"] if (r["nodes"], r["rate"], r["label"]) not in done]
                data["rows"] += new
                if args.out is not None:  # after every cell: a later cell's failure keeps what was measured
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(("" if args.out is None else f"\nwrote {args.out}") + f"\n{table(medians(data['rows']))}")
    return 0
