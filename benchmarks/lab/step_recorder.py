"""`StepRecorder`: when each optimizer step of a run ended, each validation's time and loss, and the bytes sent.

Training seconds at a step (`step_times`) leave the validations out, so that a run validating every few steps is
timed as the training it did; the network lab's trade-off and the GPT-2 study read runs through it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from syncline.callbacks import Callback

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from syncline.trainer import Task, Trainer

__all__ = ["StepRecorder", "step_times"]


class StepRecorder(Callback):
    """Record, on rank 0, step end times, validation times and losses, and the communication counters."""

    reads_parameters = False  # times and counts only: a step in flight stays in flight

    def __init__(self) -> None:
        self.start = 0.0
        self.step_ends: list[float] = []
        #: (global step, seconds the validation took, validation loss) per validation.
        self.validations: list[tuple[int, float, float]] = []
        self.comm: dict[str, float] = {}
        #: The most bytes one optimizer step handed to collectives (`comm/bytes`).
        self.peak_comm_bytes = 0.0
        self._val_start = 0.0
        self._stepping = False

    def on_train_start(self, trainer: Trainer, task: Task) -> None:
        self.start = time.perf_counter()

    def on_before_optimizer_step(self, trainer: Trainer, task: Task, optimizer: Optimizer) -> None:
        self._stepping = True

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Right after an optimizer step (on_before_zero_grad comes before the next window's backward).
        if self._stepping:
            self.step_ends.append(time.perf_counter())
            self.comm = dict(trainer.strategy.communication_stats())
            self.peak_comm_bytes = max(self.peak_comm_bytes, self.comm.get("comm/bytes", 0.0))
        self._stepping = False

    def on_validation_start(self, trainer: Trainer, task: Task) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, task: Task) -> None:
        if self.validations and self.validations[-1][0] == trainer.global_step:
            # The Trainer validates a second time when max_steps ends the epoch on a validation step.
            return
        loss = float(trainer.callback_metrics["val_loss"])  # host sync: a CPU scalar, once per validation
        self.validations.append((trainer.global_step, time.perf_counter() - self._val_start, loss))

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "step_ends": self.step_ends, "validations": self.validations, "comm": self.comm}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.start, self.step_ends = state_dict["start"], state_dict["step_ends"]
        self.validations, self.comm = [tuple(v) for v in state_dict["validations"]], state_dict["comm"]


def step_times(start: float, ends: list[float], validations: list[tuple[int, float, float]]) -> dict[str, Any]:
    """Each step's seconds without the validation that ran before it, and training seconds at each step's end."""
    val_after = {step: seconds for step, seconds, _ in validations}
    steps_s, train_s, previous, elapsed = [], [], start, 0.0
    for step, end in enumerate(ends, start=1):
        # Validation after step k runs before step k + 1 ends: its time is not training time.
        seconds = end - previous - val_after.get(step - 1, 0.0)
        elapsed += seconds
        steps_s.append(round(seconds, 4))
        train_s.append(round(elapsed, 3))
        previous = end
    return {"step_s": steps_s, "train_s_at_step": train_s}
