"""What `Task.log` records: step values, epoch aggregates, and where each one goes."""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.options import MisconfigurationException

if TYPE_CHECKING:
    from torchmetrics import Metric

    from syncline.strategies.strategy import ReduceOp, Strategy

__all__ = ["LOG_OPTIONS", "ResultCollection", "infer_batch_size", "is_metric"]

#: The spellings of `reduce_fx` that Lightning accepts, each with the reduction it means.
_REDUCE_FX: dict[Any, str] = {
    "mean": "mean",
    "avg": "mean",
    "sum": "sum",
    "max": "max",
    "min": "min",
    torch.mean: "mean",
    torch.sum: "sum",
    builtins.sum: "sum",
    torch.max: "max",
    builtins.max: "max",
    torch.min: "min",
    builtins.min: "min",
}


def is_metric(value: Any) -> bool:
    """Whether `value` is a torchmetrics `Metric`.

    A Metric exists only once torchmetrics is imported, so the check imports nothing: a run that logs no Metric
    never pays for importing torchmetrics (half a second of every process's start, a third of syncline's).
    """
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


#: Where `self.log` may be called, as in Lightning: per hook, the allowed `on_step` and `on_epoch`
#: values and their defaults. Hooks not listed (setup, on_fit_start, predict_step, ...) cannot log.
_STEP = ((False, True), (False, True), True, False)
_EVAL_STEP = ((False, True), (False, True), False, True)
_EPOCH = ((False,), (True,), False, True)
LOG_OPTIONS: dict[str, tuple[tuple[bool, ...], tuple[bool, ...], bool, bool]] = {
    **dict.fromkeys(
        (
            "training_step",
            "on_train_batch_start",
            "on_train_batch_end",
            "on_before_backward",
            "on_after_backward",
            "on_before_optimizer_step",
            "on_before_zero_grad",
            "optimizer_zero_grad",
        ),
        _STEP,
    ),
    **dict.fromkeys(
        (
            "validation_step",
            "test_step",
            "on_validation_batch_start",
            "on_validation_batch_end",
            "on_test_batch_start",
            "on_test_batch_end",
        ),
        _EVAL_STEP,
    ),
    **dict.fromkeys(
        (
            "on_train_start",
            "on_train_epoch_start",
            "on_train_epoch_end",
            "on_validation_start",
            "on_validation_epoch_start",
            "on_validation_epoch_end",
            "on_test_start",
            "on_test_epoch_start",
            "on_test_epoch_end",
        ),
        _EPOCH,
    ),
}


@dataclass
class _Entry:
    """One logged name: its options, its latest step value, and its running epoch aggregate."""

    name: str
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    sync_dist: bool
    reduce_fx: ReduceOp
    metric: Metric | None = None
    total: Tensor | None = None
    weight: float = 0.0
    #: Logged since its epoch value was last resolved.
    pending: bool = False

    def __post_init__(self) -> None:
        #: The key of its step values: ``name_step`` when it has epoch values too, else its name.
        self.step_key = f"{self.name}_step" if self.on_epoch else self.name


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
    reduced across processes. `hook` names the hook running now; it decides `self.log`'s defaults.

    Args:
        training: whether this collects the training stage's logs.
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
        #: The hook (or step method) running now, set by the dispatcher and the loops.
        self.hook = ""
        #: The evaluation loader in progress when there are several (names get ``/dataloader_idx_<i>``).
        self.dataloader_idx: int | None = None
        #: Step values for the loggers since they were last flushed.
        self.pending_step_logs: dict[str, Tensor] = {}
        #: Epoch values for the loggers since they were last flushed.
        self.pending_epoch_logs: dict[str, Tensor] = {}
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
        reduce_fx: str | Callable[..., Any],
        batch_size: int | None,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Record `value` under `name`; see `Task.log` for the options."""
        if self.dataloader_idx is not None and add_dataloader_idx:
            name = f"{name}/dataloader_idx_{self.dataloader_idx}"
        entry = self.entries.get(name)
        if entry is None:
            entry = self._new_entry(name, value, on_step, on_epoch, prog_bar, logger, sync_dist, reduce_fx)
        if isinstance(value, Tensor):  # the common case first: Metric's isinstance check is an ABC's, slower
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log scalars only "
                    "(reduce it first, e.g. `.mean()`), or log a torchmetrics Metric."
                )
        elif is_metric(value):
            entry.pending = entry.on_epoch
            if entry.on_step:
                # The value of the batch the metric was last called on, as Lightning logs it.
                step_value = value._forward_cache
                if step_value is not None:
                    self._record_step(entry, step_value)
            return
        else:
            value = torch.tensor(float(value))
        value = value.detach()
        if entry.on_step:
            step_value = self._sync(value, entry) if entry.sync_dist else value
            self._record_step(entry, step_value)
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
        reduce_fx: str | Callable[..., Any],
    ) -> _Entry:
        reduce = _REDUCE_FX.get(reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx)
        if reduce is None:
            raise MisconfigurationException(
                f"self.log({name!r}, reduce_fx={reduce_fx!r}): use 'mean' (or 'avg'), 'sum', 'max', 'min' or "
                "torch.mean/sum/max/min; for another reduction log a torchmetrics Metric."
            )
        on_step, on_epoch = self._levels(name, on_step, on_epoch)
        entry = _Entry(name, on_step, on_epoch, prog_bar, logger, sync_dist, reduce)  # type: ignore[arg-type]
        if is_metric(value):
            entry.metric = value
        restored = self._restored_aggregates.pop(name, None)
        if restored is not None:
            entry.total, entry.weight = restored["total"], restored["weight"]
        self.entries[name] = entry
        return entry

    def _levels(self, name: str, on_step: bool | None, on_epoch: bool | None) -> tuple[bool, bool]:
        """Return `on_step` and `on_epoch` with the hook's defaults, refusing what the hook does not allow."""
        options = LOG_OPTIONS.get(self.hook)
        if options is None:
            raise MisconfigurationException(
                f"self.log({name!r}, ...) cannot be called in {self.hook or 'this method'} (as in Lightning); log "
                "from a step or a batch or epoch hook, or write to a logger directly (trainer.logger)."
            )
        allowed_step, allowed_epoch, default_step, default_epoch = options
        on_step = default_step if on_step is None else on_step
        on_epoch = default_epoch if on_epoch is None else on_epoch
        for option, chosen, allowed in (("on_step", on_step, allowed_step), ("on_epoch", on_epoch, allowed_epoch)):
            if chosen not in allowed:
                raise MisconfigurationException(
                    f"self.log({name!r}, {option}={chosen}) is not possible in {self.hook}; "
                    f"{option} must be {' or '.join(map(str, allowed))} there."
                )
        if not (on_step or on_epoch):
            raise MisconfigurationException(
                f"self.log({name!r}, ...) with on_step=False and on_epoch=False logs nothing."
            )
        return on_step, on_epoch

    def _record_step(self, entry: _Entry, value: Tensor) -> None:
        key = entry.step_key
        if self.training:
            # As in Lightning, evaluation step values reach the loggers and the bar, not callback_metrics.
            self.callback_metrics[key] = value
            if entry.on_epoch:
                self.callback_metrics[entry.name] = value
        if entry.prog_bar:
            self.progress_bar_metrics[key] = value
        if entry.logger:
            self.pending_step_logs[key] = value

    def _accumulate(self, entry: _Entry, value: Tensor, batch_size: int | None) -> None:
        entry.pending = True
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

    def epoch_end(self) -> None:
        """Resolve the epoch aggregates logged since the last call and publish them.

        Called when an epoch's batches are done, before its epoch-end hooks (so they see the epoch's values
        in `callback_metrics`, as Lightning's hooks do), and again after them, for what the hooks logged.
        The values for the loggers wait in `pending_epoch_logs`.
        """
        self._restored_aggregates = {}
        for name, entry in self.entries.items():
            if not entry.pending:
                continue
            entry.pending = False
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
                self.pending_epoch_logs[key] = value
            entry.total, entry.weight = None, 0.0

    def pop_step_logs(self) -> dict[str, Tensor]:
        """Return and clear the step values waiting for the loggers."""
        logs, self.pending_step_logs = self.pending_step_logs, {}
        return logs

    def pop_epoch_logs(self) -> dict[str, Tensor]:
        """Return and clear the epoch values waiting for the loggers."""
        logs, self.pending_epoch_logs = self.pending_epoch_logs, {}
        return logs

    def reset(self) -> None:
        """Forget every entry (between evaluation runs, and before each stage)."""
        for entry in self.entries.values():
            if entry.metric is not None:
                entry.metric.reset()
        self.entries.clear()
        self.pending_step_logs.clear()
        self.pending_epoch_logs.clear()
        self._restored_aggregates = {}

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, task: torch.nn.Module) -> dict[str, Any]:
        """Return every entry (its options and running aggregate) and the state of logged metrics.

        Metrics are named by their module path in `task`, so the resumed task's own metric objects take it.
        """
        module_names = {id(module): name for name, module in task.named_modules()}
        entries: dict[str, dict[str, Any]] = {}
        metrics: dict[str, dict[str, Any]] = {}
        for name, entry in self.entries.items():
            metric_name = module_names.get(id(entry.metric)) if entry.metric is not None else None
            if entry.metric is not None and metric_name is None:
                continue  # a metric outside the task cannot be found again on resume
            entries[name] = {
                "options": [entry.on_step, entry.on_epoch, entry.prog_bar, entry.logger, entry.sync_dist],
                "reduce_fx": entry.reduce_fx,
                "total": entry.total,
                "weight": entry.weight,
                "pending": entry.pending,
                "metric": metric_name,
            }
            if entry.metric is not None and metric_name is not None:
                metrics[metric_name] = {
                    "state": dict(entry.metric.metric_state),
                    "update_count": entry.metric._update_count,
                }
        return {"entries": entries, "metrics": metrics}

    def load_state_dict(self, state: dict[str, Any], task: torch.nn.Module) -> None:
        """Restore what `state_dict` returned: the entries with their aggregates, and the metrics' states."""
        modules = dict(task.named_modules())
        for module_name, saved in state.get("metrics", {}).items():
            metric = modules.get(module_name)
            if is_metric(metric):
                for attr, value in saved["state"].items():
                    setattr(metric, attr, value)
                metric._update_count = saved["update_count"]
                metric._computed = None
        for name, saved in state.get("entries", {}).items():
            metric = modules.get(saved["metric"]) if saved["metric"] is not None else None
            entry = _Entry(name, *saved["options"], saved["reduce_fx"], metric)  # type: ignore[arg-type]
            entry.total, entry.weight, entry.pending = saved["total"], saved["weight"], saved["pending"]
            self.entries[name] = entry
        # Checkpoints of syncline <= 0.1 kept bare aggregates, attached when their names are logged again.
        self._restored_aggregates = dict(state.get("aggregates", {}))
