"""`Timer`: time the training, validation and test loops, and stop training when a time budget is spent."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from syncline.callbacks.callback import Callback
from syncline.options import MisconfigurationException
from syncline.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["Timer"]

#: The loops a Timer times, by Lightning's names for them (``trainer.state.stage``).
STAGES = ("train", "sanity_check", "validate", "test", "predict")
_DURATION = re.compile(r"(\d+):(\d\d):(\d\d):(\d\d)")


class Timer(Callback):
    """Time the loops, and stop training once `duration` has passed, as Lightning's Timer.

    ``Trainer(max_time=...)`` adds one with ``interval="step"``. The training time spent before a checkpoint
    counts after a resume from it, so a budget holds across restarts.

    Args:
        duration: "DD:HH:MM:SS", a `timedelta`, a dict of `timedelta`'s arguments, or None (time only).
        interval: check after every training batch ("step") or at every epoch's end ("epoch").
        verbose: say when the time is up.

    Raises:
        MisconfigurationException: `duration` or `interval` is not one of these forms.
    """

    reads_parameters = False

    def __init__(
        self, duration: str | timedelta | dict[str, int] | None = None, interval: str = "step", verbose: bool = True
    ) -> None:
        if isinstance(duration, str):
            found = _DURATION.fullmatch(duration.strip())
            if not found:
                raise MisconfigurationException(
                    f"`Timer(duration={duration!r})` is not a valid duration. Expected a string in the format "
                    "DD:HH:MM:SS."
                )
            days, hours, minutes, seconds = (int(part) for part in found.groups())
            duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        elif isinstance(duration, dict):
            duration = timedelta(**duration)
        elif duration is not None and not isinstance(duration, timedelta):
            raise MisconfigurationException(
                f"`Timer(duration={duration!r})`: pass a 'DD:HH:MM:SS' string, a timedelta or a dict of its arguments."
            )
        if interval not in ("step", "epoch"):
            raise MisconfigurationException(
                f"Unsupported parameter value `Timer(interval={interval})`. Possible choices are: step, epoch"
            )
        self._duration = duration.total_seconds() if duration is not None else None
        self._interval = interval
        self._verbose = verbose
        self._start: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(STAGES)
        #: Training seconds spent before the checkpoint this run resumed from.
        self._offset = 0.0

    def start_time(self, stage: str = "train") -> float | None:
        """Return when `stage` last started (`time.monotonic()` seconds), or None."""
        return self._start[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """Return when `stage` last ended (`time.monotonic()` seconds), or None."""
        return self._end[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Return the seconds `stage` has run (until now if it is running); training includes the resumed time."""
        stage = _stage(stage)
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        """Return the seconds left of `duration` for `stage` (None without a duration)."""
        return None if self._duration is None else self._duration - self.time_elapsed(stage)

    def on_train_start(self, trainer: Trainer, task: Task) -> None:
        """Start the training clock."""
        self._start["train"] = time.monotonic()

    def on_train_end(self, trainer: Trainer, task: Task) -> None:
        """Stop the training clock."""
        self._end["train"] = time.monotonic()

    def on_validation_start(self, trainer: Trainer, task: Task) -> None:
        """Start the validation clock."""
        self._start["validate"] = time.monotonic()

    def on_validation_end(self, trainer: Trainer, task: Task) -> None:
        """Stop the validation clock."""
        self._end["validate"] = time.monotonic()

    def on_test_start(self, trainer: Trainer, task: Task) -> None:
        """Start the test clock."""
        self._start["test"] = time.monotonic()

    def on_test_end(self, trainer: Trainer, task: Task) -> None:
        """Stop the test clock."""
        self._end["test"] = time.monotonic()

    def on_fit_start(self, trainer: Trainer, task: Task) -> None:
        """Stop at once when a resumed run has spent its budget already."""
        if self._duration is not None:
            self._check_time_remaining(trainer)

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Check the budget after every batch (``interval="step"``)."""
        if self._interval == "step" and self._duration is not None:
            self._check_time_remaining(trainer)

    def on_train_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Check the budget at the epoch's end (``interval="epoch"``)."""
        if self._interval == "epoch" and self._duration is not None:
            self._check_time_remaining(trainer)

    def state_dict(self) -> dict[str, Any]:
        """Return the seconds each stage has run."""
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Count the checkpoint's training time toward the budget."""
        self._offset = state_dict.get("time_elapsed", {}).get("train", 0.0)

    def _check_time_remaining(self, trainer: Trainer) -> None:
        assert self._duration is not None
        stop = self.time_elapsed() >= self._duration
        if trainer.world_size > 1:
            # Collective: rank 0's clock decides, so every rank stops at the same step.
            stop = trainer.strategy.broadcast_object(stop)
        trainer.should_stop = trainer.should_stop or stop
        if stop and self._verbose:
            elapsed = timedelta(seconds=int(self.time_elapsed()))
            rank_zero_info(f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.")


def _stage(stage: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"{stage!r} is not a stage the Timer knows: {', '.join(STAGES)}.")
    return stage
