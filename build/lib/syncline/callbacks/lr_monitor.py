"""`LearningRateMonitor`: send the optimizer's learning rates to the loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from syncline.callbacks.callback import Callback

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["LearningRateMonitor"]

_INTERVALS = (None, "step", "epoch")


class LearningRateMonitor(Callback):
    """Log ``lr-<Optimizer>`` (``lr-<Optimizer>-pg<i>`` per parameter group when there are several).

    Step values are logged before the optimizer step that uses them, at logging steps
    (`Trainer.log_every_n_steps`); epoch values at the start of each epoch.

    Args:
        logging_interval: "step" or "epoch"; None follows the scheduler's interval ("step" without one).
    """

    def __init__(self, logging_interval: str | None = None) -> None:
        if logging_interval not in _INTERVALS:
            raise ValueError(
                f"LearningRateMonitor logging_interval must be None, 'step' or 'epoch', got {logging_interval!r}."
            )
        self.logging_interval = logging_interval
        self._interval = logging_interval or "step"

    def on_train_start(self, trainer: Trainer, task: Task) -> None:
        """Check there is somewhere to log, and resolve the interval from the scheduler."""
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor needs a logger; the Trainer was created with logger=False.")
        configs = trainer.lr_scheduler_configs
        if self.logging_interval is None and configs:
            self._interval = configs[0].interval

    def on_train_batch_start(self, trainer: Trainer, task: Task, batch: Any, batch_idx: int) -> None:
        """Log at the first micro-batch of a logging step's accumulation window."""
        if self._interval != "step" or batch_idx % trainer.accumulate_grad_batches:
            return
        if trainer.global_step % trainer.log_every_n_steps == 0:
            trainer.log_metrics(self.learning_rates(trainer))

    def on_train_epoch_start(self, trainer: Trainer, task: Task) -> None:
        """Log at the start of each epoch, when the interval is "epoch"."""
        if self._interval == "epoch":
            trainer.log_metrics(self.learning_rates(trainer))

    def learning_rates(self, trainer: Trainer) -> dict[str, float]:
        """Return the current learning rate of every parameter group, by logged name."""
        rates: dict[str, float] = {}
        names = [config.name for config in trainer.lr_scheduler_configs if config.name]
        for optimizer in trainer.optimizers:
            # A scheduler configured with {"name": ...} names the curve, as in Lightning.
            name = f"lr-{names[0] if names else type(optimizer).__name__}"
            groups = optimizer.param_groups
            # float() of a tensor lr (capturable optimizers) is a host sync: logging steps only.
            if len(groups) == 1:
                rates[name] = float(groups[0]["lr"])
            else:
                rates.update({f"{name}-pg{i}": float(group["lr"]) for i, group in enumerate(groups)})
        return rates
