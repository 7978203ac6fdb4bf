"""`CommunicationTimeline`: a Chrome trace of the training steps on every rank, as Horovod's timeline.

For each rank (a trace process, ``pid`` = rank) and each recorded optimizer step it holds, on lanes
(trace threads, ``tid``):

- ``step``: the forward, the backward (the strategy's, so it includes waiting for gradients) and within
  it the **exposed wait** (what `finalize_backward` waited for communication after autograd finished),
  and the optimizer step (clipping included);
- ``bucket <i>``: bucket i's collective from its launch by the comm hook to the completion of its
  future (the completion callback's time, on the thread that completed it), for strategies built on
  the reducer (bucketed_ddp and its compressed variants, the warm-up of the averaging strategies);
- ``collective``: other collectives a strategy reports (model averaging, QAdam's compressed momentum).

The forward, backward and optimizer spans come from the callback hooks, so every strategy has them; the
rest from the strategy through `strategies/comm/events.py`, attached only for the recorded steps. At the
end of fit every rank's spans are gathered to rank 0 (`Strategy.all_gather_object`), which writes one
JSON file in the Trace Event Format (``{"traceEvents": [...]}``, complete "X" events, times in
microseconds from a barrier at the start of fit, so ranks line up to the barrier's skew). Open it in
https://ui.perfetto.dev or chrome://tracing. A fit that raises writes nothing.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from syncline.callbacks.callback import Callback
from syncline.options import check_int
from syncline.rank_zero import rank_zero_only
from syncline.strategies.comm.events import COLLECTIVE_LANE, STEP_LANE, CommEvents

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["CommunicationTimeline", "trace_events"]

#: Where a trace goes when no path is given: this name in the trainer's log folder.
DEFAULT_FILENAME = "timeline.json"


class CommunicationTimeline(Callback):
    """Record forward, backward, per-bucket collectives, exposed wait and optimizer step to a Chrome trace.

    Args:
        path: the JSON file to write; None is ``timeline.json`` in the trainer's `log_dir`.
        start_step: the first optimizer step recorded (`global_step` before it is taken).
        num_steps: optimizer steps recorded from `start_step`; None records to the end of fit.
    """

    #: Counts, times or logs; never reads the weights.
    reads_parameters = False

    def __init__(
        self, path: str | os.PathLike[str] | None = None, start_step: int = 0, num_steps: int | None = 100
    ) -> None:
        check_int("CommunicationTimeline", "start_step", start_step, 0, meaning="first optimizer step recorded")
        check_int("CommunicationTimeline", "num_steps", num_steps, 1, none_ok=True, meaning="steps recorded")
        self.path = None if path is None else os.fspath(path)
        self.start_step = start_step
        self.num_steps = num_steps
        #: Where the trace was written (rank 0, after fit).
        self.written: str | None = None
        self._events = CommEvents()
        self._origin = 0.0
        self._recording = False
        self._started = 0.0
        #: Whether the micro-batch in progress is taking an optimizer step.
        self._stepping = False

    # ------------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Trainer, task: Task) -> None:
        """Start a new recording; the barrier gives every rank the same time origin."""
        self._events = CommEvents()
        # Collective: the ranks leave the barrier together, so their clocks' origins line up.
        trainer.strategy.barrier()
        self._origin = time.perf_counter()

    def teardown(self, trainer: Trainer, task: Task, stage: str) -> None:
        """Detach from the strategy, also after an exception."""
        trainer.strategy.comm_events = None
        self._recording = False

    def on_fit_end(self, trainer: Trainer, task: Task) -> None:
        """Gather every rank's spans on rank 0 and write the trace there."""
        trainer.strategy.comm_events = None
        origin = self._origin
        mine = [(s.name, s.lane, s.start - origin, s.end - origin, s.step, s.args) for s in self._events.spans]
        # Collective: every rank's spans, in rank order (rank 0 keeps them, the others drop them).
        ranks = trainer.strategy.all_gather_object(mine)
        path = self.path or os.path.join(trainer.log_dir, DEFAULT_FILENAME)
        self.written = _write(path, trace_events(ranks))

    # -------------------------------------------------------------------- a step
    def _wants(self, step: int) -> bool:
        return step >= self.start_step and (self.num_steps is None or step < self.start_step + self.num_steps)

    def on_train_batch_start(self, trainer: Trainer, task: Task, batch: Any, batch_idx: int) -> None:
        """Attach the recorder to the strategy for recorded steps only (None costs the strategy nothing)."""
        step = trainer.global_step
        self._recording = self._wants(step)
        self._events.step = step
        trainer.strategy.comm_events = self._events if self._recording else None
        self._started = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, task: Task, loss: Tensor) -> None:
        """End the forward span, start the backward's."""
        if self._recording:
            now = time.perf_counter()
            self._events.span("forward", self._started, now)
            self._started = now

    def on_after_backward(self, trainer: Trainer, task: Task) -> None:
        """End the backward span (autograd, and the strategy's wait for gradients)."""
        if self._recording:
            self._events.span("backward", self._started, time.perf_counter())

    def on_before_optimizer_step(self, trainer: Trainer, task: Task, optimizer: torch.optim.Optimizer) -> None:
        """Start the optimizer step's span (clipping and the strategy's step)."""
        self._started = time.perf_counter()
        self._stepping = True

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        """End the optimizer step's span, when this micro-batch took a step."""
        if self._recording and self._stepping:
            self._events.span("optimizer step", self._started, time.perf_counter())
        self._stepping = False


def trace_events(ranks: list[list[tuple[str, str, float, float, int, dict[str, Any]]]]) -> dict[str, Any]:
    """Return the Trace Event Format object of every rank's spans ((name, lane, start s, end s, step, args))."""
    lanes = sorted({span[1] for spans in ranks for span in spans}, key=_lane_order)
    tid = {lane: index for index, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = []
    for rank, spans in enumerate(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for lane in lanes:
            meta = {"pid": rank, "tid": tid[lane]}
            events.append({"ph": "M", "name": "thread_name", **meta, "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", **meta, "args": {"sort_index": tid[lane]}})
        for name, lane, start, end, step, args in sorted(spans, key=lambda span: span[2]):
            start_us, end_us = round(start * 1e6, 3), round(end * 1e6, 3)
            events.append(
                {
                    "name": name,
                    "cat": lane.split()[0],
                    "ph": "X",
                    "ts": start_us,
                    "dur": round(max(end_us - start_us, 0.0), 3),
                    "pid": rank,
                    "tid": tid[lane],
                    "args": {"step": step, **args},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _lane_order(lane: str) -> tuple[int, int, str]:
    """The step lane first, then other collectives, then the buckets by index, then anything else by name."""
    if lane == STEP_LANE:
        return (0, 0, lane)
    if lane == COLLECTIVE_LANE:
        return (1, 0, lane)
    index = lane.removeprefix("bucket ")
    return (2, int(index), lane) if index.isdigit() else (3, 0, lane)


@rank_zero_only
def _write(path: str, trace: dict[str, Any]) -> str:
    """Write `trace` as JSON to `path` (rank 0 only) and return the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(trace, file)
    return path
