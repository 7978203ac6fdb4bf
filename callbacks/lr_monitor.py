"""`LearningRateMonitor`: send the optimizer's learning rates to the loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from syncline.callbacks.callback import Callback
from syncline.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["LearningRateMonitor"]

_INTERVALS = (None, "step", "epoch")


class LearningRateMonitor(Callback):
    """Log the optimizer's learning rates under Lightning's names, and put them in `callback_metrics`.

    A scheduler configured with ``{"name": ...}`` logs under that name as given; otherwise the name is
    ``lr-<Optimizer>``. With several parameter groups each gets a suffix: its ``"name"`` entry, or
    ``pg<i>`` counted from 1 (``lr-Adam/pg1``, ``lr-Adam/pg2``); a single group with a ``"name"`` is
    ``lr-Adam/<name>``. The values are also in `trainer.callback_metrics`, so a callback can monitor them.

    Step values are logged before the optimizer step that uses them, at Lightning's logging steps
    (`Trainer.log_every_n_steps`); epoch values at the start of each epoch.

    With `log_momentum`, each rate's momentum is logged beside it as ``<name>-momentum`` (Adam's and every
    optimizer's with ``betas``: ``betas[0]``; 0 for an optimizer without momentum, with Lightning's warning);
    with `log_weight_decay`, its weight decay as ``<name>-weight_decay``.

    Args:
        logging_interval: "step" or "epoch"; None follows the scheduler's interval ("step" without one).
        log_momentum: also log the momentum of every parameter group.
        log_weight_decay: also log the weight decay of every parameter group.
    """

    #: Counts, times or logs; never reads the weights.
    reads_parameters = False

    def __init__(
        self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in _INTERVALS:
            raise ValueError(
                f"LearningRateMonitor logging_interval must be None, 'step' or 'epoch', got {logging_interval!r}."
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._interval = logging_interval or "step"

    def on_train_start(self, trainer: Trainer, task: Task) -> None:
        """Check there is somewhere to log, and resolve the interval from the scheduler."""
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor needs a logger; the Trainer was created with logger=False.")
        configs = trainer.lr_scheduler_configs
        if self.log_momentum and any(not {"momentum", "betas"} & set(o.defaults) for o in trainer.optimizers):
            rank_zero_warn(
                "You have set log_momentum=True, but some optimizers do not have momentum. This will log a value 0 "
                "for the momentum.",
                RuntimeWarning,
            )
        if self.logging_interval is None and configs:
            self._interval = configs[0].interval

    def on_train_batch_start(self, trainer: Trainer, task: Task, batch: Any, batch_idx: int) -> None:
        """Log at the first micro-batch of the window whose step is a logging step."""
        if self._interval != "step" or batch_idx % trainer.accumulate_grad_batches:
            return
        if (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            self._log(trainer)

    def on_train_epoch_start(self, trainer: Trainer, task: Task) -> None:
        """Log at the start of each epoch, when the interval is "epoch"."""
        if self._interval == "epoch":
            self._log(trainer)

    def _log(self, trainer: Trainer) -> None:
        rates = self.learning_rates(trainer)
        # The rate of the coming step, under the step its batch's values are logged at (Lightning's).
        trainer.log_metrics(rates, step=trainer.global_step)
        trainer.callback_metrics.update({name: torch.tensor(rate) for name, rate in rates.items()})

    def learning_rates(self, trainer: Trainer) -> dict[str, float]:
        """Return the current learning rate of every parameter group, by logged name (and with `log_momentum`
        and `log_weight_decay`, its momentum and weight decay)."""
        rates: dict[str, float] = {}
        for optimizer, name in zip(trainer.optimizers, _optimizer_names(trainer)):
            groups = optimizer.param_groups
            betas = "betas" in optimizer.defaults
            for i, group in enumerate(groups):
                group_name = _group_name(name, groups, i)
                # float() of a tensor lr (capturable optimizers) is a host sync: logging steps only.
                rates[group_name] = float(group["lr"])
                if self.log_momentum:
                    rates[f"{group_name}-momentum"] = float(group["betas"][0] if betas else group.get("momentum", 0))
                if self.log_weight_decay:
                    rates[f"{group_name}-weight_decay"] = float(group.get("weight_decay", 0))
        return rates


def _optimizer_names(trainer: Trainer) -> list[str]:
    """Return each optimizer's curve name, as Lightning's: the ``"name"`` its scheduler was configured with, else
    ``lr-<class>``, with ``-1``, ``-2``, ... for later optimizers of the same class (a GAN's two Adams)."""
    named = {id(getattr(c.scheduler, "optimizer", None)): c.name for c in trainer.lr_scheduler_configs if c.name}
    if len(trainer.optimizers) == 1 and named:
        return [next(iter(named.values()))]  # a scheduler without an `optimizer` attribute names the only one
    seen: dict[str, int] = {}
    names = []
    for optimizer in trainer.optimizers:
        if id(optimizer) in named:
            names.append(named[id(optimizer)])
            continue
        kind = type(optimizer).__name__
        count = seen.get(kind, 0)
        seen[kind] = count + 1
        names.append(f"lr-{kind}-{count}" if count else f"lr-{kind}")
    return names


def _group_name(name: str, groups: list[dict[str, Any]], index: int) -> str:
    """Return `name` with Lightning's suffix for parameter group `index` of `groups`."""
    group_name = groups[index].get("name")
    if len(groups) > 1:
        return f"{name}/{group_name or f'pg{index + 1}'}"
    return f"{name}/{group_name}" if group_name else name
