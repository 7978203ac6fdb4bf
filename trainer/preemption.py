"""Preemption: a signal to any rank stops every rank at the same optimizer step, after a checkpoint.

Clusters announce preemption with a signal (SIGTERM from SLURM or Kubernetes, SIGUSR1 when asked for
with ``--signal``), and a user stops a run with Ctrl-C (SIGINT). `PreemptionWatch` catches the signal
during `fit` and only raises a flag: the loop keeps going to the end of the optimizer step. There the
ranks agree, with a one-element all-reduce of the flag (every rank learns that one rank was
signalled, whichever it was), write ``last.ckpt`` and stop with `TrainingPreempted`, a `SystemExit`
whose status is `PREEMPTED_EXIT_CODE`. ``ckpt_path="last"`` then finishes the run as if it had never
stopped.

A second signal of the same kind aborts at once: after the first, the signal's default action is back
in place, so the kernel ends the process even while it waits inside a collective.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

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

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


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

    def install(self) -> None:
        """Start watching (only the main thread can receive Python signal handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.received = 0
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Put back the handlers that were in place before `install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = signum
        # A second signal of this kind takes the default action: the process ends at once.
        signal.signal(signum, signal.SIG_DFL)

    def should_stop(self, strategy: Strategy) -> int:
        """Return the signal any rank received (0 if none). A collective in a group of processes.

        Call it on every rank at the same points (the end of every optimizer step).
        """
        if strategy.world_size == 1:
            return self.received
        flag = torch.tensor([float(self.received)], device=strategy.root_device)
        # Collective: one-element all-reduce (max), so every rank learns that one rank was signalled.
        # Host sync: the loop needs the answer now.
        return int(strategy.reduce(flag, "max").item())
