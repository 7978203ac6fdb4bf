"""Preemption: a signal to any rank stops every rank at the same optimizer step, after a checkpoint.

Clusters announce preemption with a signal (SIGTERM from SLURM or Kubernetes, SIGUSR1 when asked for
with ``--signal``), and a user stops a run with Ctrl-C (SIGINT). `PreemptionWatch` catches the signal
during `fit` and only raises a flag: the loop keeps going. At the end of every optimizer step the
ranks all-reduce their flags (one element, max; asynchronously, so the round trip overlaps the next
step), and at the end of the next step every rank has the same answer: if any rank was signalled, all
write ``last.ckpt`` and stop with `TrainingPreempted`, a `SystemExit` whose status is
`PREEMPTED_EXIT_CODE`. A run therefore stops one or two steps after the signal. ``ckpt_path="last"``
then finishes the run as if it had never stopped.

A second signal of the same kind aborts at once: after the first, the signal's default action is back
in place, so the kernel ends the process even while it waits inside a collective.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from syncline.strategies.comm import worker_guard

if TYPE_CHECKING:
    from syncline.strategies.strategy import Strategy

__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS", "PreemptionWatch", "TrainingPreempted"]

#: Exit status of a process that stopped on a preemption signal after writing its checkpoint
#: (EX_TEMPFAIL of sysexits.h: "try again later").
PREEMPTED_EXIT_CODE = 75

#: The signals `Trainer(preemption_signal=...)` accepts (None: only Ctrl-C stops gracefully).
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")


class TrainingPreempted(SystemExit):
    """Training stopped on a preemption signal after writing a checkpoint; exits with `PREEMPTED_EXIT_CODE`."""

    def __init__(self, message: str, announced: bool = False) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message
        #: Whether rank 0 has printed the message already (the command line then does not repeat it).
        self.announced = announced

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.announced))


class PreemptionWatch:
    """Catch the preemption signals while training runs, and tell the loop when every rank should stop.

    Args:
        signal_name: "SIGTERM", "SIGUSR1", "SIGUSR2", or None; SIGINT (Ctrl-C) is always watched.
    """

    def __init__(self, signal_name: str | None) -> None:
        names = ["SIGINT"] + ([signal_name] if signal_name else [])
        self.signals = [signal.Signals[name] for name in names]
        #: The first signal received (0 if none yet).
        self.received = 0
        self._previous: dict[signal.Signals, Any] = {}
        #: Waits for the flag reduction started at the previous step and returns it.
        self._pending: Callable[[], torch.Tensor] | None = None
        #: Whether a stop may be asked from outside the process (decided by `install`, once per fit).
        self._external = True

    def install(self) -> None:
        """Start watching (only the main thread can receive Python signal handlers)."""
        # Workers are watched before their stage starts: a plain script's steps skip the outside check.
        self._external = worker_guard.watched()
        if threading.current_thread() is not threading.main_thread():
            return
        self.received = 0
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Put back the handlers that were in place before `install`."""
        # After a failure a reduction may still be in flight; its peers may never join it: drop it.
        self._pending = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = signum
        # A second signal of this kind takes the default action: the process ends at once.
        signal.signal(signum, signal.SIG_DFL)

    def should_stop(self, strategy: Strategy) -> int:
        """Return the signal that any rank had received one step ago (0 if none). A collective.

        Call it on every rank at the same points (the end of every optimizer step). The flags are
        all-reduced asynchronously: each call starts the reduction of this rank's flag and reads the one
        started at the previous call, so the round trip hides behind a step's compute and every rank
        stops after the same step, one step after the signal.
        """
        if not self.received and self._external:
            # The launching process was signalled, or the agent that started this worker is gone.
            self.received = worker_guard.external_stop_request()
        if not strategy.multi_process or strategy.world_size == 1:  # one process: no flag to agree on
            return self.received
        if self._pending is not None:
            # Host sync: the flags reduced during this step (already arrived unless the step was tiny).
            agreed = int(self._pending().item())
            self._pending = None
            if agreed:
                return agreed
        flag = torch.tensor([float(self.received)], device=strategy.root_device)
        # Collective: one-element all-reduce (max) of the flag, so every rank learns that one rank was signalled.
        self._pending = strategy.reduce_async(flag, "max")
        return 0

    def forget_pending(self) -> None:
        """Drop the flag reduction in flight (its process group was replaced: live recovery)."""
        self._pending = None

    def finish(self) -> None:
        """Wait for the flag reduction still in flight (every rank calls it when training ends normally)."""
        if self._pending is not None:
            self._pending()
            self._pending = None
