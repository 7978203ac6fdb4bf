"""The Trainer's progress, as one typed object that checkpoints save and restore."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainerState"]


@dataclass
class TrainerState:
    """Where training stands.

    Attributes:
        fn: the Trainer method running or last run: "fit", "validate", "test", "predict"; None before any
            (Lightning's ``trainer.state.fn``; the strings compare equal to Lightning's `TrainerFn` values).
        stage: the loop running now: "train", "sanity_check", "validate", "test", "predict"; None between
            runs (Lightning's ``RunningStage``).
        status: "initializing", "running", "finished" or "interrupted" (Ctrl-C or a preemption signal);
            "running" also after a stage failed with an error, as Lightning leaves it.
        current_epoch: epochs finished so far, as Lightning counts them: the index of the epoch in progress
            (its hooks see it), advanced once the epoch's last event is done, so a fit of 3 epochs ends at 3.
        global_step: optimizer steps taken so far.
        batch_idx: training micro-batches completed in the current epoch.
        validated_after: the batch index after which validation last ran in this epoch (-1: none yet).
        batches_done: the current epoch has consumed its last batch (or was asked to stop); its final
            validation, epoch-end hooks and epoch schedulers may still be ahead.
        epoch_hooks_done: the epoch-end hooks have run; only the plateau schedulers' step is ahead.
        sanity_checking: the sanity validation is running (its metrics are discarded).
        should_stop: a callback asked training to stop at the next opportunity.
    """

    fn: str | None = None
    stage: str | None = None
    status: str = "initializing"
    current_epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    validated_after: int = -1
    batches_done: bool = False
    epoch_hooks_done: bool = False
    sanity_checking: bool = False
    should_stop: bool = False
    #: RNG states taken just before the current epoch's training iterator was created; a mid-epoch
    #: resume replays the epoch's data order from them.
    epoch_start_rng: dict[str, Any] = field(default_factory=dict, repr=False)

    def state_dict(self) -> dict[str, Any]:
        """Return the progress fields that a resume needs."""
        state = dataclasses.asdict(self)
        # The epoch's RNG is per process: checkpoints gather it from every rank with the current RNG.
        for transient in ("fn", "stage", "status", "sanity_checking", "epoch_start_rng"):
            state.pop(transient)
        return state

    @property
    def finished(self) -> bool:
        """Whether the last stage ran to its end."""
        return self.status == "finished"

    @property
    def stopped(self) -> bool:
        """Whether the last stage ended, normally or interrupted."""
        return self.status in ("finished", "interrupted")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        state = dict(state)
        # Written before the epoch counter advanced at the epoch's end (format of syncline <= 0.1): such a
        # checkpoint said `epoch_finished` where the counter now has moved on to the next epoch.
        finished = state.pop("epoch_finished", False)
        if "batches_done" not in state:
            state["batches_done"] = state["epoch_hooks_done"] = finished
        for name, value in state.items():
            setattr(self, name, value)
        if finished:
            self.finish_epoch()

    def finish_epoch(self) -> None:
        """Count the current epoch as done and move to the next one's first batch."""
        self.current_epoch += 1
        self.batch_idx, self.validated_after = 0, -1
        self.batches_done = self.epoch_hooks_done = False
