"""Interpret `configure_optimizers()` and step learning-rate schedulers when they are due."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from syncline.rank_zero import rank_zero_warn

__all__ = ["OptimizerSetup", "SchedulerConfig", "parse_optimizers"]


@dataclass
class SchedulerConfig:
    """A learning-rate scheduler and when to step it."""

    scheduler: Any
    interval: Literal["epoch", "step"] = "epoch"
    frequency: int = 1
    monitor: str | None = None
    name: str | None = None
    #: ReduceLROnPlateau only: a `monitor` not logged is an error (True) or skips the step with a warning.
    strict: bool = True

    @property
    def needs_metric(self) -> bool:
        """Whether `step()` takes a metric value (ReduceLROnPlateau)."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


@dataclass
class OptimizerSetup:
    """The optimizers and schedulers a task configured (one optimizer under automatic optimization)."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list[SchedulerConfig]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first optimizer: the one automatic optimization steps."""
        return self.optimizers[0]

    def step_schedulers(
        self,
        interval: str,
        count: int,
        metrics: dict[str, Tensor],
        plateau: bool,
        step: Callable[[Any, Any], None],
    ) -> None:
        """Step every scheduler of `interval` whose frequency divides `count` (steps or epochs), through `step`
        (the task's `lr_scheduler_step`: the scheduler, and the monitored value or None).

        `plateau` picks the ReduceLROnPlateau schedulers (which read a metric, so the loop steps them after
        validation) or the others, as Lightning separates them.
        """
        for config in self.schedulers:
            if config.interval != interval or config.needs_metric != plateau or count % config.frequency:
                continue
            if config.needs_metric:
                if config.monitor not in metrics:
                    available = ", ".join(sorted(metrics)) or "none"
                    if not config.strict:
                        rank_zero_warn(
                            f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged, and strict is "
                            f"False: its step is skipped. Logged metrics: {available}."
                        )
                        continue
                    raise KeyError(
                        f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged. "
                        f"Logged metrics: {available}. Log it, or set 'strict': False in the lr_scheduler dict."
                    )
                step(config.scheduler, metrics[config.monitor])
            else:
                step(config.scheduler, None)

    def state_dict(
        self, optimizer_state_dict: Callable[[torch.optim.Optimizer], dict[str, Any]] = torch.optim.Optimizer.state_dict
    ) -> dict[str, Any]:
        """Return optimizer and scheduler states; `optimizer_state_dict` reads an optimizer's (the strategy's hook).

        ``"optimizer"`` is the first optimizer's state (the only entry of checkpoints written before several
        optimizers existed); ``"optimizers"`` has every optimizer's, the first one being the same object.
        """
        states = [optimizer_state_dict(optimizer) for optimizer in self.optimizers]
        return {
            "optimizer": states[0],
            "optimizers": states,
            "lr_schedulers": [config.scheduler.state_dict() for config in self.schedulers],
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        load_optimizer_state_dict: Callable[[torch.optim.Optimizer, dict[str, Any]], None] = (
            torch.optim.Optimizer.load_state_dict
        ),
    ) -> None:
        """Restore what `state_dict` returned; `load_optimizer_state_dict` (the strategy's hook) loads an optimizer.

        Raises:
            ValueError: the checkpoint has another number of optimizers or schedulers than the task configured.
        """
        optimizer_states = state.get("optimizers", [state["optimizer"]])
        if len(optimizer_states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint has {len(optimizer_states)} optimizer(s) but configure_optimizers() returned "
                f"{len(self.optimizers)}."
            )
        for optimizer, optimizer_state in zip(self.optimizers, optimizer_states):
            load_optimizer_state_dict(optimizer, optimizer_state)
        saved = state["lr_schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(
                f"The checkpoint has {len(saved)} lr scheduler(s) but configure_optimizers() returned "
                f"{len(self.schedulers)}."
            )
        for config, scheduler_state in zip(self.schedulers, saved):
            config.scheduler.load_state_dict(scheduler_state)


#: The keys of a scheduler dict, as Lightning's ``LRSchedulerConfig`` has them.
_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")
#: The keys of an optimizer dict.
_OPTIMIZER_KEYS = ("optimizer", "lr_scheduler", "monitor")

_FORMS = (
    "return one of: an optimizer; a list of optimizers; ([optimizers], [schedulers]); a dict "
    "{'optimizer': ..., 'lr_scheduler': scheduler or {'scheduler': ..., 'interval': ..., ...}, 'monitor': ...}; "
    "a list of such dicts"
)


def _parse_scheduler(value: Any, monitor: str | None, manual: bool) -> SchedulerConfig:
    """Return the config of one scheduler (a scheduler, or a dict of `_SCHEDULER_KEYS`); `monitor` is the
    optimizer dict's, which a bare ReduceLROnPlateau uses; under `manual` optimization the task steps it."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(_SCHEDULER_KEYS))
        if "scheduler" not in value or unknown:
            raise ValueError(
                f"An lr_scheduler dict needs 'scheduler' and may have {', '.join(map(repr, _SCHEDULER_KEYS[1:]))}; "
                f"got keys {sorted(value)}."
            )
        ignored = [key for key in ("monitor", "strict") if key in value]
        if manual and ignored:
            rank_zero_warn(
                f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be ignored. You need to "
                "call `lr_scheduler.step()` manually in manual optimization."
            )
        config = SchedulerConfig(
            value["scheduler"],
            value.get("interval", "epoch"),
            value.get("frequency", 1),
            value.get("monitor"),
            value.get("name"),
            bool(value.get("strict", True)),
        )
    else:
        config = SchedulerConfig(value)
        config.monitor = monitor if config.needs_metric else None
    if config.interval not in ("epoch", "step"):
        raise ValueError(f"lr_scheduler interval must be 'epoch' or 'step', got {config.interval!r}.")
    if isinstance(config.frequency, bool) or not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"lr_scheduler frequency must be an int >= 1, got {config.frequency!r}.")
    if config.needs_metric and config.monitor is None and not manual:
        raise ValueError(
            "ReduceLROnPlateau needs a metric: return {'scheduler': ..., 'monitor': '<logged key>'} "
            "as the lr_scheduler (or 'monitor' beside 'optimizer')."
        )
    return config


def _optimizer_dict(value: dict[str, Any], task_name: str) -> tuple[Any, list[Any], str | None]:
    """Return the optimizer, schedulers and monitor of one optimizer dict."""
    unknown = sorted(set(value) - set(_OPTIMIZER_KEYS))
    if "optimizer" not in value or unknown:
        raise ValueError(
            f"{task_name}.configure_optimizers() returned a dict with keys {sorted(value)}; it needs 'optimizer' "
            "and may have 'lr_scheduler' and 'monitor'."
        )
    schedulers = [value["lr_scheduler"]] if value.get("lr_scheduler") is not None else []
    return value["optimizer"], schedulers, value.get("monitor")


def _split(returned: Any, task_name: str) -> tuple[list[Any], list[Any], str | None]:
    """Return the optimizers, the schedulers and the top-level monitor of any of Lightning's forms."""
    if isinstance(returned, torch.optim.Optimizer):
        return [returned], [], None
    if isinstance(returned, dict):
        optimizer, schedulers, monitor = _optimizer_dict(returned, task_name)
        return [optimizer], schedulers, monitor
    if isinstance(returned, (list, tuple)) and returned:
        if len(returned) == 2 and isinstance(returned[0], (list, tuple)):
            schedulers = returned[1] if isinstance(returned[1], (list, tuple)) else [returned[1]]
            return list(returned[0]), list(schedulers), None
        if all(isinstance(item, dict) for item in returned):
            parts = [_optimizer_dict(item, task_name) for item in returned]
            return [opt for opt, _, _ in parts], [s for _, found, _ in parts for s in found], None
        return list(returned), [], None
    raise TypeError(f"{task_name}.configure_optimizers() returned {type(returned).__name__}; {_FORMS}.")


def parse_optimizers(
    returned: Any, task_name: str, manual: bool = False, own_scheduler_step: bool = False
) -> OptimizerSetup:
    """Turn what `configure_optimizers()` returned, in any of Lightning's forms, into an `OptimizerSetup`.

    `manual`: the task steps its optimizers itself (Lightning's manual optimization), which allows several.
    `own_scheduler_step`: the task overrides `lr_scheduler_step`, so a scheduler may have an API of its own.

    Raises:
        TypeError: the value is none of the forms, or holds something that is not an optimizer; a scheduler
            without `state_dict`/`load_state_dict`, or not torch's kind while `lr_scheduler_step` is the default.
        RuntimeError: several optimizers under automatic optimization (Lightning's error).
        ValueError: a bad scheduler dict, or a scheduler of an optimizer that was not returned.
    """
    optimizers, schedulers, monitor = _split(returned, task_name)
    bad = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if bad or not optimizers:
        raise TypeError(
            f"{task_name}.configure_optimizers() returned {', '.join(bad) or 'no optimizer'} where a "
            f"torch.optim.Optimizer belongs; {_FORMS}."
        )
    if len(optimizers) > 1 and not manual:
        raise RuntimeError(
            f"{task_name}.configure_optimizers() returned {len(optimizers)} optimizers. Training with multiple "
            "optimizers is only supported with manual optimization. Set `self.automatic_optimization = False`, "
            "then access your optimizers in `training_step` with `opt1, opt2, ... = self.optimizers()` "
            "(Lightning's rule); or return one optimizer, with a parameter group per part of the model."
        )
    configs = [_parse_scheduler(scheduler, monitor, manual) for scheduler in schedulers]
    for config in configs:
        _check_scheduler_api(config.scheduler, task_name, own_scheduler_step)
        attached = getattr(config.scheduler, "optimizer", optimizers[0])
        if not any(attached is optimizer for optimizer in optimizers):
            raise ValueError(
                f"{task_name}.configure_optimizers(): a {type(config.scheduler).__name__} is attached to an "
                "optimizer that was not returned; build it on a returned optimizer."
            )
    return OptimizerSetup(list(optimizers), configs)


def _check_scheduler_api(scheduler: Any, task_name: str, own_step: bool) -> None:
    """Refuse a scheduler checkpoints cannot keep, or whose `step` the default `lr_scheduler_step` cannot call."""
    kind = type(scheduler).__name__
    if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
        raise TypeError(
            f"{task_name}.configure_optimizers() returned the lr scheduler {kind}, which checkpoints cannot keep: "
            "it needs `state_dict()` and `load_state_dict()` methods."
        )
    torch_kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not own_step and not isinstance(scheduler, torch_kinds):
        raise TypeError(
            f"The lr scheduler {kind} returned by {task_name}.configure_optimizers() is not one of torch's "
            f"(LRScheduler, ReduceLROnPlateau); override {task_name}.lr_scheduler_step(scheduler, metric) to say "
            "how to step it."
        )
