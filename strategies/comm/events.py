"""Spans of a training step that a strategy reports to a timeline; nothing is recorded, or paid, otherwise.

`callbacks.CommunicationTimeline` gives the strategy a `CommEvents` (`strategy.comm_events = events`)
for the steps it records, and takes it away (None) for the others. While it is there:

- the reducer records each bucket's collective, from the comm hook's launch to the completion of the
  future it returned (`Future.add_done_callback`: the time the collective completed on this rank, taken
  on the thread that completes it), and the exposed wait of `finalize_backward`;
- strategies with other collectives (model averaging, QAdam's compressed momentum) wrap them in
  `collective_span(strategy.comm_events, name)`;
- the callback records what every strategy has: forward, backward and optimizer step.

Times are `time.perf_counter()` seconds of this process; the callback turns them into a trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch.futures import Future

__all__ = ["CommEvents", "Span", "collective_span"]

#: The lane (trace thread) of forward, backward, exposed wait and optimizer step.
STEP_LANE = "step"
#: The lane of a strategy's collectives that are not gradient buckets.
COLLECTIVE_LANE = "collective"


@dataclass
class Span:
    """Something that took time on one rank: `name` on `lane`, from `start` to `end` (perf_counter s)."""

    name: str
    lane: str
    start: float
    end: float
    step: int
    args: dict[str, Any] = field(default_factory=dict)


class CommEvents:
    """The spans one rank recorded, each tagged with the optimizer step it belongs to.

    Attributes:
        spans: what was recorded, in the order it ended.
        step: the optimizer step being recorded (the trainer's `global_step`); set by the timeline.
    """

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.step = 0

    def span(self, name: str, start: float, end: float, lane: str = STEP_LANE, **args: Any) -> None:
        """Record `name` on `lane` from `start` to `end`."""
        self.spans.append(Span(name, lane, start, end, self.step, args))

    def bucket(self, index: int, nbytes: int, launched: float, future: Future[Any]) -> None:
        """Record bucket `index`'s collective, launched at `launched`, when `future` completes."""
        step = self.step

        def completed(_: Future[Any]) -> None:
            # Runs on the thread that completes the future (a list append is atomic under the GIL).
            end = time.perf_counter()
            self.spans.append(Span(f"bucket {index}", f"bucket {index}", launched, end, step, {"bytes": nbytes}))

        future.add_done_callback(completed)

    @contextmanager
    def timed(self, name: str, lane: str = COLLECTIVE_LANE) -> Iterator[None]:
        """Record the time the block takes as `name` on `lane`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(name, start, time.perf_counter(), lane)


def collective_span(events: CommEvents | None, name: str) -> AbstractContextManager[None]:
    """Time the block as a collective named `name` when a timeline listens (`events` not None)."""
    return nullcontext() if events is None else events.timed(name)
