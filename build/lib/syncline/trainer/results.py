"""What `Task.log` records: step values, epoch aggregates, and where each one goes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchmetrics import Metric

if TYPE_CHECKING:
    from syncline.strategies.strategy import ReduceOp, Strategy

__all__ = ["ResultCollection", "infer_batch_size"]

_REDUCE_FX = ("mean", "sum", "max", "min")


@dataclass
class _Entry:
    """One logged name: its options, its latest step value, and its running epoch aggregate."""

    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    sync_dist: bool
    reduce_fx: ReduceOp
    metric: Metric | None = None
    total: Tensor | None = None
    weight: float = 0.0


def infer_batch_size(batch: Any) -> int:
    """Return the first dimension of the first tensor found in `batch` (1 if there is none)."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = infer_batch_size(item)
            if size:
                return size
        return 1
    return 1


class ResultCollection:
    """Collect the values logged during one stage (training, or one evaluation run).

    Step values go to `trainer.callback_metrics` at once (no host sync); epoch aggregates are kept as
    running tensors and resolved by `epoch_end`, which is where values logged with ``sync_dist`` are
    reduced across processes.

    Args:
        training: whether this collects `training_step` logs (which default to per-step values).
        strategy: reduces values across processes.
        callback_metrics: the trainer's dict of latest values, updated in place.
        progress_bar_metrics: the trainer's dict of values shown on the progress bar.
    """

    def __init__(
        self,
        training: bool,
        strategy: Strategy,
        callback_metrics: dict[str, Tensor],
        progress_bar_metrics: dict[str, Tensor],
    ) -> None:
        self.training = training
        self.strategy = strategy
        self.callback_metrics = callback_metrics
        self.progress_bar_metrics = progress_bar_metrics
        self.entries: dict[str, _Entry] = {}
        #: Step values for the loggers since they were last flushed.
        self.pending_step_logs: dict[str, Tensor] = {}
        #: Source of the batch size for epoch means: set per batch by the loop, read only when needed.
        self.current_batch: Any = None
        self._batch_size: int | None = None
        #: Running aggregates read from a checkpoint, attached when their names are logged again.
        self._restored_aggregates: dict[str, dict[str, Any]] = {}

    def new_batch(self, batch: Any) -> None:
        """Point batch-size inference at the batch now being processed."""
        self.current_batch = batch
        self._batch_size = None

    def log(
        self,
        name: str,
        value: Tensor | float | int | Metric,
        *,
        on_step: bool | None,
        on_epoch: bool | None,
        prog_bar: bool,
        logger: bool,
        sync_dist: bool,
        reduce_fx: str,
        batch_size: int | None,
    ) -> None:
        """Record `value` under `name`; see `Task.log` for the options."""
        entry = self.entries.get(name)
        if entry is None:
            entry = self._new_entry(name, value, on_step, on_epoch, prog_bar, logger, sync_dist, reduce_fx)
        if isinstance(value, Metric):
            if entry.on_step:
                # The value of the batch the metric was last called on, as Lightning logs it.
                step_value = value._forward_cache
                if step_value is not None:
                    self._record_step(name, entry, step_value)
            return
        if not isinstance(value, Tensor):
            value = torch.tensor(float(value))
        elif value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log scalars only "
                "(reduce it first, e.g. `.mean()`), or log a torchmetrics Metric."
            )
        value = value.detach()
        if entry.on_step:
            step_value = self._sync(value, entry) if entry.sync_dist else value
            self._record_step(name, entry, step_value)
        if entry.on_epoch:
            self._accumulate(entry, value, batch_size)

    def _new_entry(
        self,
        name: str,
        value: Any,
        on_step: bool | None,
        on_epoch: bool | None,
        prog_bar: bool,
        logger: bool,
        sync_dist: bool,
        reduce_fx: str,
    ) -> _Entry:
        if reduce_fx not in _REDUCE_FX:
            raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): use one of {', '.join(_REDUCE_FX)}.")
        if on_step is None:
            on_step = self.training
        if on_epoch is None:
            on_epoch = not self.training
        if not (on_step or on_epoch):
            raise ValueError(f"self.log({name!r}, ...) with on_step=False and on_epoch=False logs nothing.")
        entry = _Entry(on_step, on_epoch, prog_bar, logger, sync_dist, reduce_fx)  # type: ignore[arg-type]
        if isinstance(value, Metric):
            entry.metric = value
        restored = self._restored_aggregates.pop(name, None)
        if restored is not None:
            entry.total, entry.weight = restored["total"], restored["weight"]
        self.entries[name] = entry
        return entry

    def _record_step(self, name: str, entry: _Entry, value: Tensor) -> None:
        key = f"{name}_step" if entry.on_epoch else name
        self.callback_metrics[key] = value
        if entry.on_epoch:
            self.callback_metrics[name] = value
        if entry.prog_bar:
            self.progress_bar_metrics[key] = value
        if entry.logger:
            self.pending_step_logs[key] = value

    def _accumulate(self, entry: _Entry, value: Tensor, batch_size: int | None) -> None:
        if entry.reduce_fx == "mean":
            if batch_size is None:
                if self._batch_size is None:
                    self._batch_size = infer_batch_size(self.current_batch)
                batch_size = self._batch_size
            weighted = value.double() * batch_size
            entry.total = weighted if entry.total is None else entry.total + weighted
            entry.weight += batch_size
        elif entry.total is None:
            entry.total = value.double()
        elif entry.reduce_fx == "sum":
            entry.total = entry.total + value
        elif entry.reduce_fx == "max":
            entry.total = torch.maximum(entry.total, value.double())
        else:
            entry.total = torch.minimum(entry.total, value.double())

    def _sync(self, value: Tensor, entry: _Entry) -> Tensor:
        # Collective: every rank must log the same names in the same order for this to match up.
        return self.strategy.reduce(value.float(), entry.reduce_fx)

    def epoch_end(self) -> dict[str, Tensor]:
        """Resolve every epoch aggregate, publish it, reset metrics and return the values to log."""
        epoch_logs: dict[str, Tensor] = {}
        for name, entry in self.entries.items():
            if not entry.on_epoch:
                continue
            if entry.metric is not None:
                # torchmetrics synchronizes its own state across processes inside compute().
                value = entry.metric.compute().detach()
                entry.metric.reset()
            elif entry.total is None:
                continue
            elif entry.reduce_fx == "mean":
                total, weight = entry.total, torch.tensor(entry.weight, dtype=torch.float64)
                if entry.sync_dist:
                    # Collective: reduce sum and weight, so the mean is over the global set of samples.
                    total = self.strategy.reduce(total, "sum")
                    weight = self.strategy.reduce(weight, "sum")
                value = (total / weight).float()
            else:
                value = self._sync(entry.total, entry) if entry.sync_dist else entry.total.float()
            key = f"{name}_epoch" if entry.on_step else name
            self.callback_metrics[name] = value
            self.callback_metrics[key] = value
            if entry.prog_bar:
                self.progress_bar_metrics[key] = value
            if entry.logger:
                epoch_logs[key] = value
            entry.total, entry.weight = None, 0.0
        return epoch_logs

    def pop_step_logs(self) -> dict[str, Tensor]:
        """Return and clear the step values waiting for the loggers."""
        logs, self.pending_step_logs = self.pending_step_logs, {}
        return logs

    def reset(self) -> None:
        """Forget every entry (between evaluation runs)."""
        for entry in self.entries.values():
            if entry.metric is not None:
                entry.metric.reset()
        self.entries.clear()
        self.pending_step_logs.clear()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, task: torch.nn.Module) -> dict[str, Any]:
        """Return the running epoch aggregates and the state of logged metrics (by module name)."""
        module_names = {id(module): name for name, module in task.named_modules()}
        aggregates = {
            name: {"total": entry.total, "weight": entry.weight}
            for name, entry in self.entries.items()
            if entry.total is not None
        }
        metrics: dict[str, dict[str, Any]] = {}
        for entry in self.entries.values():
            if entry.metric is not None and id(entry.metric) in module_names:
                metrics[module_names[id(entry.metric)]] = {
                    "state": dict(entry.metric.metric_state),
                    "update_count": entry.metric._update_count,
                }
        return {"aggregates": aggregates, "metrics": metrics}

    def load_state_dict(self, state: dict[str, Any], task: torch.nn.Module) -> None:
        """Restore what `state_dict` returned; aggregates attach when their names are logged again."""
        modules = dict(task.named_modules())
        for module_name, saved in state.get("metrics", {}).items():
            metric = modules.get(module_name)
            if isinstance(metric, Metric):
                for attr, value in saved["state"].items():
                    setattr(metric, attr, value)
                metric._update_count = saved["update_count"]
                metric._computed = None
        self._restored_aggregates = dict(state.get("aggregates", {}))
