"""An experiment in the network lab: can the optimizer step and the next forward overlap the wire?

At 1 Gbit/s the lab's `bucketed_ddp` stays well above its link bound (docs/performance.md, section 9): a
synchronous step overlaps only the backward with communication, because the optimizer step needs every
averaged gradient and the next forward needs every updated parameter. ByteScheduler (Peng et al., SOSP
2019) lifts both limits: it applies each layer's update just before the next forward uses the layer, and
sends the front layers' gradients first so that the next forward can start while the back layers' are
still on the wire. This script measures what that buys here, exactly, without making it a strategy:
`DeferredUpdateDDP` is `BucketedDDP` whose reducer it drives by hand (reaching into it on purpose; an
experiment, not an API).

- During the backward, the buckets launch as they become ready, except the last `hold` fraction of them
  (the model's front layers, ready last): those launch after autograd returns, front-most first. The
  launch order depends only on the bucket index, so it is the same on every rank.
- Nothing waits at the end of the backward. `optimizer_step` records each parameter group's
  hyperparameters (the learning rate the scheduler is about to change) and returns.
- A forward pre-hook on every module with parameters of its own waits for their buckets; for each, it
  steps the optimizer on that bucket's parameters alone, with the recorded hyperparameters, and zeroes the
  bucket. Whatever the forward did not reach is applied before the next backward, and at teardown.

Every run ends by printing a checksum of the trained weights: the deferred runs must match `bucketed_ddp`'s
bit for bit (per-parameter optimizers such as AdamW update a subset exactly as they update all).

    python -m benchmarks lab deferred-update --rate 1gbit --batch-sizes 2 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from syncline.lab.cluster import (
    UNAVAILABLE,
    add_worker_argument,
    lab_unavailable,
    run_worker_if_asked,
    run_worker_job,
)
from syncline.lab.strategies import DEFAULT_MODEL

from .common import CHECKOUT_ENV, QUIET_TRAINER, paper_worker, write_json

__all__ = ["HOLDS", "run_deferred"]

#: Fractions of the buckets held back to the end of the backward (None: plain `bucketed_ddp`).
HOLDS: list[float | None] = [None, 0.0, 0.25, 0.5, 0.75]


def _worker(spec: dict[str, Any]) -> None:
    """Train CharGPT with plain and deferred updates, in order and reversed; rank 0 writes the times."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from syncline.callbacks import Callback, CommunicationTimeline
    from syncline.examples.char_gpt import CharGPT
    from syncline.strategies.bucketed_ddp import BucketedDDP
    from syncline.trainer import Trainer

    torch.set_num_threads(1)
    caps = {"bucket_cap_mb": 1, "first_bucket_mb": 1}

    class DeferredUpdateDDP(BucketedDDP):
        """`BucketedDDP` whose optimizer step runs bucket by bucket inside the next forward."""

        def __init__(self, hold: float) -> None:
            super().__init__(**caps)
            self.hold = hold
            self.optimizer: torch.optim.Optimizer | None = None
            self.hyper: list[dict[str, Any]] = []
            self.waiting: set[int] = set()  # buckets launched and not yet applied
            self.deferred = False  # the last backward left its buckets in flight

        def setup(self, task: nn.Module) -> None:
            super().setup(task)
            for module in task.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    module.register_forward_pre_hook(self._before_forward)

        def teardown(self) -> None:
            self.apply_all()
            super().teardown()

        def _before_forward(self, module: nn.Module, args: Any) -> None:
            if not self.waiting or self.deferred:
                return
            reducer = self.reducer
            for param in module.parameters(recurse=False):
                index = reducer._index_of.get(id(param))
                if index is not None and reducer._bucket_of[index] in self.waiting:
                    self._apply(reducer._bucket_of[index])

        def _apply(self, index: int) -> None:
            reducer, optimizer = self.reducer, self.optimizer
            assert optimizer is not None
            bucket = reducer._buckets[index]
            result = reducer._wait(bucket)
            bucket.future = None
            if result.data_ptr() != bucket.grad.buffer.data_ptr():
                bucket.grad.buffer.copy_(result)
            mine = {id(reducer._params[i]) for i in bucket.param_indices}
            saved = [dict(group) for group in optimizer.param_groups]
            for group, hyper in zip(optimizer.param_groups, self.hyper):
                group.update(hyper)
                group["params"] = [p for p in group["params"] if id(p) in mine]
            optimizer.step()
            for group, original in zip(optimizer.param_groups, saved):
                group.clear()
                group.update(original)
            bucket.grad.buffer.zero_()
            self.waiting.discard(index)

        def apply_all(self) -> None:
            self.deferred = False
            for index in sorted(self.waiting):
                self._apply(index)

        def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool = False) -> None:
            reducer = self.reducer
            self.apply_all()
            if not (sync and reducer._rebuilt):  # the first step observes the gradient order
                super().backward(loss, sync=sync, retain_graph=retain_graph)
                return
            count = len(reducer._buckets)
            early = count - round(self.hold * count)
            reducer.prepare_for_backward(sync=True)
            launched: list[int] = []

            def launch(index: int) -> None:
                bucket = reducer._buckets[index]
                bucket.future = reducer._hook(reducer._state, bucket.grad)
                if reducer.events is not None:
                    reducer.events.bucket(index, bucket.nbytes, time.perf_counter(), bucket.future)
                reducer._count_collective(0)
                launched.append(index)

            def launch_early() -> None:
                while reducer._next_bucket < early and reducer._pending[reducer._next_bucket] == 0:
                    launch(reducer._next_bucket)
                    reducer._next_bucket += 1

            reducer._launch_ready_buckets = launch_early  # the hooks' launcher, for this backward
            try:
                loss.backward(retain_graph=retain_graph)
            finally:
                del reducer._launch_ready_buckets
            reducer._armed = reducer._sync = False
            reducer._skipped_backwards = 0
            reducer._process_arrivals()
            launch_early()
            for index in range(count - 1, early - 1, -1):  # front layers first
                launch(index)
            reducer._next_bucket = count
            reducer._stats = reducer._step_stats
            assert sorted(launched) == list(range(count))
            self.waiting = set(launched)
            self.deferred = True
            self._buffers_stale = True

        def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
            if not self.deferred:
                super().optimizer_step(optimizer, step)
                return
            self.optimizer = optimizer
            self.hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            self.deferred = False  # from here the next forward applies the buckets
            self.comm_counter.close_step()

        def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
            if not self.waiting:  # applied buckets are zeroed as they are applied
                super().zero_grad(optimizer)

    class StepClock(Callback):
        reads_parameters = False  # a step in flight stays in flight

        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
            self.marks.append(time.perf_counter())

    holds = spec["holds"]
    results = []
    for position, hold in enumerate(holds + holds[::-1]):
        torch.manual_seed(0)
        clock = StepClock()
        strategy = BucketedDDP(**caps) if hold is None else DeferredUpdateDDP(hold)
        task = CharGPT(**spec["model"])
        warmup, steps = spec["warmup"], spec["steps"]
        callbacks: list[Callback] = [clock]
        if spec.get("timeline") and position == 0:  # the first plain run: a trace of 3 of its timed steps
            callbacks.append(CommunicationTimeline(spec["timeline"], start_step=warmup + 2, num_steps=3))
        trainer = Trainer(
            max_steps=warmup + steps, strategy=strategy, callbacks=callbacks, limit_val_batches=0, **QUIET_TRAINER
        )
        trainer.fit(task)
        mine = torch.tensor([(clock.marks[-1] - clock.marks[warmup - 1]) / steps])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # collective: the slowest rank's time per step
        weights = torch.nn.utils.parameters_to_vector(task.parameters()).double()
        results.append({"hold": hold, "step_s": mine.item(), "weights_sum": weights.sum().item()})
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1) + "\n")


def step_phases(trace: Path, rank: int = 0) -> dict[str, float]:
    """Median milliseconds per recorded step of `rank` in a `CommunicationTimeline` trace.

    forward, autograd (the backward less its exposed wait), exposed wait, optimizer step, and wire: from
    the first bucket's launch to the last bucket's completion.
    """
    events = sorted(
        (e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e["pid"] == rank),
        key=lambda e: e["ts"],
    )
    steps: list[list[dict[str, Any]]] = []
    for event in events:
        if event["name"] == "forward":
            steps.append([])
        if steps:
            steps[-1].append(event)
    phases: dict[str, list[float]] = {}
    for step in steps:
        spans = {e["name"]: e["dur"] / 1e3 for e in step if not e["name"].startswith("bucket")}
        buckets = [e for e in step if e["name"].startswith("bucket")]
        if not buckets or "optimizer step" not in spans:
            continue
        mine = {
            "forward": spans["forward"],
            "autograd": spans["backward"] - spans.get("exposed wait", 0.0),
            "exposed wait": spans.get("exposed wait", 0.0),
            "optimizer step": spans["optimizer step"],
            "wire": (max(e["ts"] + e["dur"] for e in buckets) - min(e["ts"] for e in buckets)) / 1e3,
        }
        for name, value in mine.items():
            phases.setdefault(name, []).append(value)
    return {name: round(statistics.median(values), 1) for name, values in phases.items()}


def run_deferred(
    rate: str,
    batch_size: int,
    nodes: int = 2,
    steps: int = 14,
    warmup: int = 6,
    timeout: float = 900.0,
    timeline: Path | None = None,
) -> dict[str, Any]:
    """Time plain and deferred updates on a lab cluster; medians per hold and whether weights match.

    With `timeline`, the first plain `bucketed_ddp` run also writes a `CommunicationTimeline` trace there.
    """
    spec = {
        "model": {**DEFAULT_MODEL, "batch_size": batch_size},
        "holds": HOLDS,
        "steps": steps,
        "warmup": warmup,
        "timeline": None if timeline is None else str(timeline.resolve()),
    }
    runs = run_worker_job(paper_worker("deferred-update"), spec, nodes, rate, timeout, env=CHECKOUT_ENV)
    reference = next(r["weights_sum"] for r in runs if r["hold"] is None)
    rows = []
    for hold in HOLDS:
        mine = [r for r in runs if r["hold"] == hold]
        rows.append(
            {
                "hold": hold,
                "step_s": round(statistics.median(r["step_s"] for r in mine), 4),
                "runs_s": [round(r["step_s"], 4) for r in mine],
                "weights_equal": all(r["weights_sum"] == reference for r in mine),
            }
        )
    cell: dict[str, Any] = {"nodes": nodes, "rate": rate, "batch_size": batch_size, "rows": rows}
    if timeline is not None:
        cell["bucketed_ddp_phases_ms"] = step_phases(timeline)
    return cell


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    add_worker_argument(parser)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 8], help="CharGPT windows per rank")
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    parser.add_argument(
        "--timeline", type=Path, metavar="DIR", help="write a Chrome trace of plain bucketed_ddp per batch size here"
    )


def command(args: argparse.Namespace) -> int | None:
    """Run the experiment for each batch size; print a table and write the JSON."""
    if run_worker_if_asked(args, _worker):
        return 0
    if lab_unavailable("lab deferred-update"):
        return UNAVAILABLE
    cells = []
    for batch_size in args.batch_sizes:
        trace = None if args.timeline is None else args.timeline / f"bucketed_ddp_batch{batch_size}.json"
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
        cell = run_deferred(args.rate, batch_size, args.nodes, timeline=trace)
        cells.append(cell)
        plain = cell["rows"][0]["step_s"]
        print(f"\n{args.nodes} nodes, {args.rate}, batch {batch_size} per rank")
        if "bucketed_ddp_phases_ms" in cell:
            print(f"bucketed_ddp's step on rank 0 (ms, medians): {cell['bucketed_ddp_phases_ms']}")
        print("| held back | s/step | / bucketed_ddp | weights equal bucketed_ddp's |\n|---|---|---|---|")
        for row in cell["rows"]:
            label = "bucketed_ddp (none deferred)" if row["hold"] is None else f"{row['hold']:.0%} of the buckets"
            print(f"| {label} | {row['step_s']:.3f} | {row['step_s'] / plain:.2f} | {row['weights_equal']} |")
    if args.out is not None:
        write_json(args.out, {"cells": cells})
    return 0
