"""Every strategy against its link's bound, in the network lab (docs/performance.md, section 9).

For each node count and link rate the lab (`cluster.py`) builds a cluster and runs one torchrun
job across it; the job trains the default example's CharGPT, widened so that its gradients weigh several
MB, with each strategy in turn (one process per node, one thread each). For every strategy it records,
after a few untimed steps (for `bucket_cap_mb="auto"` also after its trial steps, so that what is timed
is the cap it chose):

- the step time: the slowest rank's time for the timed optimizer steps, divided by their number;
- the bytes each node sent per step, read off its own interface (``/sys/class/net/eth0``) around the
  timed steps, so setup and rendezvous do not count, next to the bytes the strategy says it handed to
  collectives (`comm/bytes`);
- the bound: ``max(local step time, busiest node's bytes per step * 8 / rate)``, where the local step
  time is that of the same job with no communication at all (``local``: local SGD that never averages),
  all nodes computing at once on the same cores as in the other runs; it runs first and last, and the
  faster of the two counts (the machine's other load drifts);
- the CPU floor: the machine's busy CPU seconds per step (``/proc/stat``, every node and the kernel's
  network work together) over its core count, a floor no schedule can beat on these shared cores.

measured / bound near 1 means the strategy waits for nothing but its own bytes on the wire (or its own
compute); well above 1 means it leaves the link idle while it waits, or waits on something else.

Beside it, the **algorithmic bound** (`bound.py`): the link bound assumes every second of
compute can hide wire time, but an algorithm allows less (local SGD's averaging follows the step; a gradient
all-reduce can hide only behind the backward). Each strategy's wire phases are listed there (`wire_phases`);
the local step is split into forward, backward and optimizer step by `local_phases` (timed in this process,
before the clusters run), and measured / algorithmic bound says how far the implementation is from what its
algorithm allows.

    python -m syncline.lab strategies --nodes 2 4 --rates none 1gbit 100mbit --steps 12 --out lab_strategies.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cluster import (
    UNAVAILABLE,
    StallGuard,
    add_worker_argument,
    lab_rate,
    lab_unavailable,
    lab_worker,
    link_bound,
    parse_rate,
    run_isolating,
    run_worker_if_asked,
    run_worker_job,
)
from .records import QUIET_TRAINER, write_json

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_STRATEGIES",
    "LOCAL_LABELS",
    "TORCH_ROWS",
    "busy_cpu_seconds",
    "grid_table",
    "lab_rows",
    "local_phases",
    "run_strategies",
    "select_strategies",
]

#: CharGPT widened to 3.2 M parameters (12.6 MB of fp32 gradients) on short batches, so that at 100 Mbit
#: a step's bytes take longer than its compute and at 1 Gbit they do not.
DEFAULT_MODEL = {
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 256,
    "block_size": 64,
    "batch_size": 8,
    "max_chars": 200_000,
    "sample_chars": 0,
}

#: (label, registered name, options). `local` is the reference without communication.
DEFAULT_STRATEGIES: list[tuple[str, str, dict[str, Any]]] = [
    ("local", "local_sgd", {"period": 1_000_000}),
    ("bucketed_ddp", "bucketed_ddp", {}),
    ("bucketed_ddp cap=1", "bucketed_ddp", {"bucket_cap_mb": 1, "first_bucket_mb": 1}),
    ("bucketed_ddp auto", "bucketed_ddp", {"bucket_cap_mb": "auto"}),
    ("native_ddp", "native_ddp", {}),
    ("native_ddp cap=1", "native_ddp", {"bucket_cap_mb": 1}),
    ("bucketed_ddp bf16", "bucketed_ddp", {"comm_hook": "bf16"}),
    ("bucketed_ddp bf16 cap=1", "bucketed_ddp", {"comm_hook": "bf16", "bucket_cap_mb": 1, "first_bucket_mb": 1}),
    ("bytegrad", "bytegrad", {}),
    # 1 MiB buckets: the comm thread can overlap only what the backward hands over before it ends.
    ("bytegrad cap=1", "bytegrad", {"bucket_cap_mb": 1}),
    ("powersgd", "powersgd", {"start_iter": 2}),
    ("qadam", "qadam", {"warmup_steps": 2}),
    ("local_sgd", "local_sgd", {"period": 4}),
    # At local_sgd's period (a timed window of a few steps sees no exchange at H=50..500; the trade-off has those):
    # blocking, and streaming with 2 fragments exchanged behind the next inner step.
    ("diloco", "diloco", {"period": 4}),
    ("streaming diloco", "diloco", {"period": 4, "fragments": 2}),
    ("decentralized", "decentralized", {}),
    ("decentralized all uint8", "decentralized", {"peers": "all", "compression": "uint8"}),
    ("decentralized all uint8 prefetch", "decentralized", {"peers": "all", "compression": "uint8", "prefetch": True}),
    ("async_model_average", "async_model_average", {}),
    ("tensor_fusion", "tensor_fusion", {}),
    ("parameter_server", "parameter_server", {}),
    ("sharded_parameter_server", "sharded_parameter_server", {}),
    # torch's relaxations at the settings of the rows they are compared with (powersgd, local_sgd above).
    ("torch powersgd", "native_ddp", {"comm_hook": "powersgd", "start_iter": 2}),
    ("torch post-local sgd", "native_ddp", {"comm_hook": "post_local_sgd"}),
    ("bucketed_ddp deferred", "bucketed_ddp", {"bucket_cap_mb": 1, "first_bucket_mb": 1, "deferred_update": True}),
    # 1 MiB buckets, so the next forward can start on the first layers' parameters (blocking at the same cap beside).
    ("parameter_server cap=1", "parameter_server", {"bucket_cap_mb": 1}),
    ("sharded_parameter_server cap=1", "sharded_parameter_server", {"bucket_cap_mb": 1}),
    ("parameter_server prefetch", "parameter_server", {"bucket_cap_mb": 1, "prefetch": True}),
    ("sharded_parameter_server prefetch", "sharded_parameter_server", {"bucket_cap_mb": 1, "prefetch": True}),
    ("local (end)", "local_sgd", {"period": 1_000_000}),
]


#: Forward, backward and AdamW step of `DEFAULT_MODEL` in ms, timed alone in one thread (`--phases`, 2026-11-25,
#: docs/performance.md section 9): the split of the local step for runs recorded without their own.
DEFAULT_PHASES_MS = {"forward": 27.9, "backward": 49.6, "optimizer": 11.1}

#: torch's own relaxations: each runs in a job of its own (`run_isolating`), so that a failure (its PowerSGD hook can
#: die of a collective-size mismatch on gloo) is recorded instead of ending the cell.
TORCH_ROWS = ("torch powersgd", "torch post-local sgd")

#: The rows without communication that give the bound its local step time (not `local_sgd`, which averages).
LOCAL_LABELS = ("local", "local (end)")


def select_strategies(labels: Sequence[str] = ()) -> list[tuple[str, str, dict[str, Any]]]:
    """`DEFAULT_STRATEGIES` with these labels (all where none are given), always with the `local` rows."""
    return [s for s in DEFAULT_STRATEGIES if not labels or s[0] in labels or s[0] in LOCAL_LABELS]


# ------------------------------------------------------------------ inside the torchrun job
def _link_counters(interface: str) -> tuple[int, int]:
    """(bytes sent, bytes received) of this node's interface; zeros where there is none (unshaped runs)."""
    base = Path("/sys/class/net") / interface / "statistics"
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return 0, 0


def busy_cpu_seconds() -> float:
    """CPU seconds this machine's cores have spent busy since boot (user, system, interrupts; /proc/stat).

    Machine-wide on purpose: in the lab every node, the kernel's veth, bridge and token-bucket work and
    gloo's threads share the same cores, so the busy seconds a step costs over the core count is a floor
    on its wall time that no schedule can beat.
    """
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    busy = sum(fields[:8]) - idle  # guest time is already counted in user time
    return busy / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds each thread of this process has run (user and system; /proc/self/task), summed by name.

    Python threads go by their `threading` name ("MainThread", a strategy's communication thread); threads that
    Python did not start (gloo's transport, torch's) are "other". Where a node's busy CPU goes, per step.
    """
    import threading

    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        name = names.get(int(task.name), "other")
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return seconds


def _worker(spec: dict[str, Any]) -> None:
    """Train every strategy of `spec` in this torchrun job; rank 0 writes the records to spec["out"]."""
    import torch
    import torch.distributed as dist

    from syncline.callbacks import Callback
    from syncline.examples.char_gpt import CharGPT
    from syncline.strategies import STRATEGIES
    from syncline.strategies.comm.bucket_autotune import AUTO, DEFAULT_CAPS_MB
    from syncline.trainer import Trainer

    torch.set_num_threads(1)
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "eth0")
    steps = spec["steps"]

    class LinkRecorder(Callback):
        """After each optimizer step: the time, the link's counters, `comm/bytes`, the machine's busy CPU and this
        process's CPU per thread."""

        reads_parameters = False  # a step in flight stays in flight

        def __init__(self) -> None:
            self.marks: list[tuple[float, int, int, float, float]] = []
            self.threads: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer: Trainer, task: CharGPT, outputs: Any, batch: Any, batch_idx: int) -> None:
            guard.beat()
            sent, received = _link_counters(interface)
            comm = trainer.strategy.communication_stats().get("comm/bytes", 0.0)
            self.marks.append((time.perf_counter(), sent, received, comm, busy_cpu_seconds()))
            self.threads.append(thread_cpu_seconds())

    results = []
    for label, name, options in spec["strategies"]:
        torch.manual_seed(0)
        task = CharGPT(**spec["model"])
        recorder = LinkRecorder()
        guard = StallGuard(label)  # a hang (torch's PowerSGD hook on gloo) ends the job, not the session
        # `bucket_cap_mb="auto"` tries caps in its first steps: time what it chose, not its trials.
        tuning = (
            len(DEFAULT_CAPS_MB) * (options.get("autotune_steps", 2) + 1) if options.get("bucket_cap_mb") == AUTO else 0
        )
        warmup = spec["warmup"] + tuning
        trainer = Trainer(
            max_steps=warmup + steps,
            strategy=STRATEGIES[name](**options),
            callbacks=[recorder],
            limit_val_batches=0,
            **QUIET_TRAINER,
        )
        trainer.fit(task)
        guard.stop()
        marks = recorder.marks[warmup - 1 :]  # the end of the last untimed step starts the window
        times = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
        mine = {
            "step_s": times,
            "sent_per_step": (marks[-1][1] - marks[0][1]) / steps,
            "received_per_step": (marks[-1][2] - marks[0][2]) / steps,
            "comm_bytes_per_step": statistics.mean(m[3] for m in marks[1:]),
            "busy_cpu_per_step": (marks[-1][4] - marks[0][4]) / steps,
            "thread_cpu_per_step": {
                thread: round((seconds - recorder.threads[warmup - 1].get(thread, 0.0)) / steps, 4)
                for thread, seconds in recorder.threads[-1].items()
            },
            "loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
        }
        everyone: list[Any] = [None] * dist.get_world_size()
        # Collective: every rank's record, for rank 0 to write.
        dist.all_gather_object(everyone, mine)
        # The run is as slow as its slowest rank: its time over the timed steps, per step. (A mean, not a
        # median: strategies that communicate every k-th step, or in the background, pay unevenly.)
        slowest = max(sum(r["step_s"]) for r in everyone) / steps
        record = {
            "label": label,
            "strategy": name,
            "options": options,
            "step_s": slowest,
            "cores": os.cpu_count(),
            "ranks": everyone,
        }
        if tuning:
            record["autotune"] = trainer.strategy.autotune.summary()
        results.append(record)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1) + "\n")


def local_phases(model: dict[str, Any], steps: int = 20) -> dict[str, float]:
    """Median milliseconds of forward, backward and optimizer step of `model`'s CharGPT in this process.

    One thread, no communication: what a step of the lab's `local` row is made of, so that the part a
    synchronous strategy cannot overlap with its wire time (the forward and the optimizer step) is known.
    """
    import torch

    from syncline.examples.char_gpt import CharGPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    task = CharGPT(**model)
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-3)
    inputs, targets = next(iter(task.train_dataloader()))
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for step in range(steps + 3):
        t0 = time.perf_counter()
        loss = task._loss(task(inputs), targets)  # the training step's loss, without the Trainer's logging
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t3 = time.perf_counter()
        if step >= 3:  # the first steps allocate
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(seconds * 1e3)
    return {name: round(statistics.median(values), 1) for name, values in times.items()}


# ------------------------------------------------------------------ the parent
def run_strategies(
    nodes: int,
    rate: str | None,
    strategies: list[tuple[str, str, dict[str, Any]]] | None = None,
    steps: int = 12,
    warmup: int = 4,
    model: dict[str, Any] | None = None,
    timeout: float = 1800.0,
    slow_start_after_idle: bool = True,
    phases_ms: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Run every strategy on a lab cluster of `nodes` nodes at `rate`; return one row per strategy.

    `phases_ms` splits the local step into forward, backward and optimizer step for the algorithmic bound.
    """
    spec = {"steps": steps, "warmup": warmup, "model": model or DEFAULT_MODEL}

    def job(some: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
        return run_worker_job(
            lab_worker("strategies"), {**spec, "strategies": some}, nodes, rate, timeout, slow_start_after_idle
        )

    records = run_isolating(job, strategies or DEFAULT_STRATEGIES, TORCH_ROWS)
    return lab_rows(records, nodes, rate, phases_ms)


def phase_fractions(phases_ms: dict[str, float] | None) -> dict[str, float]:
    """The shares of the local step spent in the forward and the backward (the rest is the optimizer step)."""
    phases = phases_ms or DEFAULT_PHASES_MS
    total = sum(phases.values())
    return {"forward": phases["forward"] / total, "backward": phases["backward"] / total}


def wire_phases_of(name: str, options: dict[str, Any]) -> tuple[Any, ...]:
    """The registered strategy's wire phases with these options (built, not set up)."""
    from syncline.strategies import STRATEGIES

    from .bound import wire_phases

    return wire_phases(STRATEGIES[name](**options))


def lab_rows(
    records: list[dict[str, Any]], nodes: int, rate: str | None, phases_ms: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Add to each strategy's record the busiest node's bytes, the link bound and measured/bound, and the
    algorithmic bound and measured/algorithmic bound (`phases_ms` splits the local step; None: the documented one)."""
    from .bound import algorithmic_bound

    rate_bps = parse_rate(rate) if rate else None
    fractions = phase_fractions(phases_ms)
    local = min((r["step_s"] for r in records if r["label"] in LOCAL_LABELS), default=None)
    rows = []
    for record in records:
        if record.get("failed"):
            cell = {"nodes": nodes, "rate": rate or "unshaped"}
            rows.append({"label": record["label"], **cell, "failed": True, "error": record["error"]})
            continue
        sent = [r["sent_per_step"] for r in record["ranks"]]
        comm = [r["comm_bytes_per_step"] for r in record["ranks"]]
        row = {
            "label": record["label"],
            "nodes": nodes,
            "rate": rate or "unshaped",
            "step_s": round(record["step_s"], 4),
            "busiest_sent_per_step": max(sent),
            "comm_bytes_per_step": max(comm),
            "wire_over_comm": round(max(sent) / max(comm), 3) if max(comm) else None,
        }
        if "autotune" in record:
            row["autotune"] = record["autotune"]
        if "cores" in record:  # runs from before 2026-11-25 did not count the busy CPU
            busy = max(r["busy_cpu_per_step"] for r in record["ranks"])
            row["cpu_floor_s"] = round(busy / record["cores"], 4)
        if "thread_cpu_per_step" in record["ranks"][0]:  # from 2026-11-26 on: the busiest rank's, per thread
            row["thread_cpu_per_step"] = max(
                (r["thread_cpu_per_step"] for r in record["ranks"]), key=lambda threads: sum(threads.values())
            )
        if local is not None:
            bound = link_bound(local, sent, rate_bps) if rate_bps else local
            row["bound_s"] = round(bound, 4)
            row["measured_over_bound"] = round(record["step_s"] / bound, 3)
            if "strategy" in record and record["label"] not in LOCAL_LABELS:
                wire = max(sent) * 8.0 / rate_bps if rate_bps else 0.0
                phases = wire_phases_of(record["strategy"], record.get("options", {}))
                algorithmic = algorithmic_bound(phases, local, wire, fractions)
                row["algorithmic_bound_s"] = round(algorithmic, 4)
                row["measured_over_algorithmic"] = round(record["step_s"] / algorithmic, 3)
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = "| strategy | nodes | link | s/step | busiest node sent/step | comm/bytes | wire/comm | bound s | measured/bound | algorithmic bound s | measured/algorithmic | CPU floor s |"  # noqa: E501
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['label']} | {r['nodes']} | {r['rate']} | failed: {r['error'][-80:]} |" + " |" * 8)
            continue
        ratio = r["wire_over_comm"] if r["wire_over_comm"] is not None else "-"
        cells = [
            r["label"],
            r["nodes"],
            r["rate"],
            f"{r['step_s']:.3f}",
            f"{r['busiest_sent_per_step'] / 1e6:.2f} MB",
            f"{r['comm_bytes_per_step'] / 1e6:.2f} MB",
            ratio,
            f"{r.get('bound_s', float('nan')):.3f}",
            f"{r.get('measured_over_bound', float('nan')):.2f}",
            f"{r['algorithmic_bound_s']:.3f}" if "algorithmic_bound_s" in r else "-",
            f"{r['measured_over_algorithmic']:.2f}" if "measured_over_algorithmic" in r else "-",
            f"{r['cpu_floor_s']:.3f}" if "cpu_floor_s" in r else "-",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def grid_table(rows: list[dict[str, Any]]) -> str:
    """One row per strategy, one column per (nodes, link) cell: seconds per step, measured/link bound and
    measured/algorithmic bound."""
    order = {"unshaped": 0, "1gbit": 1, "100mbit": 2, "10mbit": 3}
    cells = sorted(dict.fromkeys((r["nodes"], r["rate"]) for r in rows), key=lambda c: (c[0], order.get(c[1], 3)))
    labels = list(dict.fromkeys(r["label"] for r in rows if r["label"] != "local (end)"))
    found = {(r["nodes"], r["rate"], r["label"]): r for r in rows}
    lines = [
        "| strategy | " + " | ".join(f"{n} nodes, {rate}" for n, rate in cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for label in labels:
        line = [label]
        for nodes, rate in cells:
            r = found.get((nodes, rate, label))
            if r is None or r.get("failed"):
                line.append("failed" if r else "-")
                continue
            cell = f"{r['step_s']:.3f} s, {r.get('measured_over_bound', float('nan')):.2f}x"
            if "measured_over_algorithmic" in r:
                cell += f" (alg. {r['measured_over_algorithmic']:.2f}x)"
            line.append(cell)
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def model_overrides(settings: Sequence[str]) -> dict[str, int]:
    """Parse ``KEY=INT`` settings of `DEFAULT_MODEL`, naming the valid keys when one is not."""
    overrides = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or key not in DEFAULT_MODEL or not value.isdigit():
            raise SystemExit(f"--model {setting!r}: expected KEY=INT with KEY one of {', '.join(DEFAULT_MODEL)}.")
        overrides[key] = int(value)
    return overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    add_worker_argument(parser)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--rates", type=lab_rate, nargs="+", default=[None, "1gbit", "100mbit"], help="tc rates, or none"
    )
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per strategy")
    parser.add_argument("--warmup", type=int, default=4, help="untimed optimizer steps before them")
    parser.add_argument("--only", nargs="*", help="labels of the strategies to run (default: all)")
    parser.add_argument(
        "--model",
        nargs="+",
        default=[],
        metavar="KEY=INT",
        help="override CharGPT's settings in DEFAULT_MODEL, e.g. batch_size=2 (a wire-bound step at 1 Gbit)",
    )
    parser.add_argument(
        "--no-slow-start-after-idle",
        action="store_true",
        help="set the nodes' net.ipv4.tcp_slow_start_after_idle=0 (see syncline.lab.cluster.run_lab)",
    )
    parser.add_argument("--out", type=Path, help="also write the runs as JSON to this file (after every cell)")
    parser.add_argument("--phases", action="store_true", help="only time the model's forward/backward/step here")
    parser.add_argument("--table", type=Path, nargs="+", help="only print one table of these runs' JSON files")


def command(args: argparse.Namespace) -> int | None:
    """Run the lab for every node count and rate asked for; print the tables and write the JSON."""
    if run_worker_if_asked(args, _worker):
        return 0
    model = {**DEFAULT_MODEL, **model_overrides(args.model)}
    if args.table:
        rows = []
        for path in args.table:
            run = json.loads(path.read_text())
            rows += _with_algorithmic_bound(run)
        print(grid_table(rows))
        return 0
    if args.phases:
        print(json.dumps({"model": model, "phases_ms": local_phases(model)}))
        return 0
    if lab_unavailable("lab strategies"):
        return UNAVAILABLE
    strategies = select_strategies(args.only or ())
    # Timed here, before any cluster runs: the split of the local step the algorithmic bound needs.
    phases_ms = local_phases(model)
    rows: list[dict[str, Any]] = []
    for nodes in args.nodes:
        for rate in args.rates:
            started = time.monotonic()
            idle_restart = not args.no_slow_start_after_idle
            new = run_strategies(
                nodes,
                rate,
                strategies,
                args.steps,
                args.warmup,
                model=model,
                slow_start_after_idle=idle_restart,
                phases_ms=phases_ms,
            )
            print(
                f"\n{nodes} nodes, {rate or 'unshaped'} ({time.monotonic() - started:.0f} s)\n{_table(new)}", flush=True
            )
            rows += new
            # After every cell: a later cell's failure keeps what was measured.
            run = {"steps": args.steps, "warmup": args.warmup, "model": model, "phases_ms": phases_ms, "rows": rows}
            if args.out is not None:
                write_json(args.out, run)
    return 0


def _with_algorithmic_bound(run: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's rows, with the algorithmic bound added where it was recorded before the bound existed.

    Old rows carry the label but not the registered name and options: they are looked up in `DEFAULT_STRATEGIES`.
    """
    phases = run.get("phases_ms")
    known = {label: (name, options) for label, name, options in DEFAULT_STRATEGIES}
    rows = []
    for row in run["rows"]:
        if "algorithmic_bound_s" not in row and row["label"] in known and "bound_s" in row and not row.get("failed"):
            row = dict(row)
            name, options = known[row["label"]]
            if row["label"] not in LOCAL_LABELS:
                from .bound import algorithmic_bound

                rate_bps = parse_rate(row["rate"]) if row["rate"] != "unshaped" else None
                wire = row["busiest_sent_per_step"] * 8.0 / rate_bps if rate_bps else 0.0
                local = row["bound_s"] if not rate_bps else _local_of(run["rows"], row)
                bound = algorithmic_bound(wire_phases_of(name, options), local, wire, phase_fractions(phases))
                row["algorithmic_bound_s"] = round(bound, 4)
                row["measured_over_algorithmic"] = round(row["step_s"] / bound, 3)
        rows.append(row)
    return rows


def _local_of(rows: list[dict[str, Any]], row: dict[str, Any]) -> float:
    """The local step of `row`'s cell: the faster of its `local` rows."""
    cell = (row["nodes"], row["rate"])
    return min(r["step_s"] for r in rows if r["label"] in LOCAL_LABELS and (r["nodes"], r["rate"]) == cell)
