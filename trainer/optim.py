"""Interpret `configure_optimizers()` and step learning-rate schedulers when they are due."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["OptimizerSetup", "SchedulerConfig", "parse_optimizers"]


@dataclass
class SchedulerConfig:
    """A learning-rate scheduler and when to step it."""

    scheduler: Any
    interval: Literal["epoch", "step"] = "epoch"
    frequency: int = 1
    monitor: str | None = None
    name: str | None = None

    @property
    def needs_metric(self) -> bool:
        """Whether `step()` takes a metric value (ReduceLROnPlateau)."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


@dataclass
class OptimizerSetup:
    """The optimizer and schedulers a task configured."""

    optimizer: torch.optim.Optimizer
    schedulers: list[SchedulerConfig]

    def step_schedulers(self, interval: str, count: int, metrics: dict[str, Tensor], plateau: bool) -> None:
        """Step every scheduler of `interval` whose frequency divides `count` (steps or epochs).

        `plateau` picks the ReduceLROnPlateau schedulers (which read a metric, so the loop steps them after
        validation) or the others, as Lightning separates them.
        """
        for config in self.schedulers:
            if config.interval != interval or config.needs_metric != plateau or count % config.frequency:
                continue
            if config.needs_metric:
                if config.monitor not in metrics:
                    available = ", ".join(sorted(metrics)) or "none"
                    raise KeyError(
                        f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged. "
                        f"Logged metrics: {available}."
                    )
                config.scheduler.step(metrics[config.monitor].item())
            else:
                config.scheduler.step()

    def state_dict(
        self, optimizer_state_dict: Callable[[torch.optim.Optimizer], dict[str, Any]] = torch.optim.Optimizer.state_dict
    ) -> dict[str, Any]:
        """Return optimizer and scheduler states; `optimizer_state_dict` reads the optimizer's (the strategy's hook)."""
        return {
            "optimizer": optimizer_state_dict(self.optimizer),
            "lr_schedulers": [config.scheduler.state_dict() for config in self.schedulers],
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        load_optimizer_state_dict: Callable[[torch.optim.Optimizer, dict[str, Any]], None] = (
            torch.optim.Optimizer.load_state_dict
        ),
    ) -> None:
        """Restore what `state_dict` returned; `load_optimizer_state_dict` (the strategy's hook) loads the optimizer."""
        load_optimizer_state_dict(self.optimizer, state["optimizer"])
        saved = state["lr_schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(
                f"The checkpoint has {len(saved)} lr scheduler(s) but configure_optimizers() returned "
                f"{len(self.schedulers)}."
            )
        for config, scheduler_state in zip(self.schedulers, saved):
            config.scheduler.load_state_dict(scheduler_state)


def _parse_scheduler(value: Any) -> SchedulerConfig:
    if isinstance(value, dict):
        unknown = set(value) - {"scheduler", "interval", "frequency", "monitor", "name"}
        if "scheduler" not in value or unknown:
            raise ValueError(
                "An lr_scheduler dict needs 'scheduler' and may have 'interval', 'frequency', 'monitor'; "
                f"got keys {sorted(value)}."
            )
        config = SchedulerConfig(
            value["scheduler"],
            value.get("interval", "epoch"),
            int(value.get("frequency", 1)),
            value.get("monitor"),
            value.get("name"),
        )
    else:
        config = SchedulerConfig(value)
    if config.interval not in ("epoch", "step"):
        raise ValueError(f"lr_scheduler interval must be 'epoch' or 'step', got {config.interval!r}.")
    if config.needs_metric and config.monitor is None:
        raise ValueError(
            "ReduceLROnPlateau needs a metric: return {'scheduler': ..., 'monitor': '<logged key>'} "
            "as the lr_scheduler."
        )
    return config


def parse_optimizers(returned: Any, task_name: str) -> OptimizerSetup:
    """Turn what `configure_optimizers()` returned into an `OptimizerSetup`.

    Accepts an optimizer, a one-element list of one, or a dict with ``"optimizer"`` and optionally
    ``"lr_scheduler"``.

    Raises:
        TypeError: the value is none of these; the message says what was returned.
    """
    if isinstance(returned, (list, tuple)) and len(returned) == 1:
        returned = returned[0]
    if isinstance(returned, torch.optim.Optimizer):
        return OptimizerSetup(returned, [])
    if isinstance(returned, dict) and isinstance(returned.get("optimizer"), torch.optim.Optimizer):
        scheduler = returned.get("lr_scheduler")
        return OptimizerSetup(returned["optimizer"], [] if scheduler is None else [_parse_scheduler(scheduler)])
    raise TypeError(
        f"{task_name}.configure_optimizers() returned {type(returned).__name__}; return one "
        "torch.optim.Optimizer, or a dict {'optimizer': ..., 'lr_scheduler': ...}. "
        "syncline trains with one optimizer per task."
    )
