"""`Task`: the user's model together with the steps that train, evaluate and use it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor, nn

from syncline.trainer.hooks import DataHooks
from syncline.trainer.hparams import AttributeDict, HyperparametersMixin, build_from_hparams, read_for_loading

if TYPE_CHECKING:
    from torchmetrics import Metric

    from syncline.trainer.trainer import Trainer

__all__ = ["AttributeDict", "Task"]

TaskT = TypeVar("TaskT", bound="Task")


class Task(DataHooks, HyperparametersMixin, nn.Module):
    """Subclass this and override the steps you need, as with a LightningModule.

    `training_step` returns a loss tensor or a dict with a ``"loss"`` entry; `configure_optimizers`
    returns an optimizer in any of Lightning's forms: an optimizer, a list, ``([optimizer], [schedulers])``,
    a dict with ``"optimizer"`` and optionally ``"lr_scheduler"`` (a scheduler or a dict with ``"scheduler"``,
    ``"interval"`` ("epoch" or "step"), ``"frequency"``, ``"monitor"``, ``"strict"``, ``"name"``) and
    ``"monitor"``, or a list of such dicts; one optimizer, as Lightning's automatic optimization allows.
    Hooks with the names of `callbacks.Callback`'s, minus its `trainer` and `task` arguments, are called
    before the callbacks' of the same event.
    """

    #: Lightning's switch: False lets a resume start state the checkpoint lacks (a strategy's) afresh.
    strict_loading: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self._init_hparams()

    # ------------------------------------------------------------ environment
    @property
    def trainer(self) -> Trainer:
        """The Trainer running this task.

        Raises:
            RuntimeError: the task is not attached to a Trainer.
        """
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; call it from a step.")
        return self._trainer

    @property
    def global_rank(self) -> int:
        """Rank of this process (0 outside a Trainer)."""
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def world_size(self) -> int:
        """Number of processes (1 outside a Trainer)."""
        return self._trainer.world_size if self._trainer is not None else 1

    @property
    def current_epoch(self) -> int:
        """Index of the current training epoch (0 outside a Trainer)."""
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (0 outside a Trainer)."""
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def device(self) -> torch.device:
        """Device of the task's first parameter or buffer (CPU when it has none)."""
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @classmethod
    def load_from_checkpoint(
        cls: type[TaskT],
        checkpoint_path: str | os.PathLike[str],
        map_location: Any = None,
        hparams_file: str | os.PathLike[str] | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> TaskT:
        """Build the task from a checkpoint's saved hyperparameters and load its weights, as Lightning does.

        The constructor gets the hyperparameters `save_hyperparameters` recorded, updated from `hparams_file`
        (a YAML file, e.g. a logger's ``hparams.yaml``), with `kwargs` taking precedence; arguments the
        constructor does not take are dropped (unless it takes ``**kwargs``), as in Lightning. Then the task's
        ``on_load_checkpoint`` sees the checkpoint and the weights are loaded (`strict`, by default the task's
        `strict_loading`; False tolerates missing and unexpected keys). The task is returned in training
        mode on the device `map_location` names (the CPU by default); call ``.eval()`` for inference.

        Raises:
            CheckpointError: the file is missing, unreadable or not a syncline checkpoint.
            TypeError: the saved hyperparameters (or `kwargs`) do not fit the constructor.
            ValueError: `hparams_file` is not a YAML file.
        """
        from syncline.trainer.checkpoint import require_entries

        checkpoint = read_for_loading(checkpoint_path, map_location)
        require_entries(checkpoint, ("state_dict",), checkpoint_path)
        task = build_from_hparams(cls, checkpoint, "", checkpoint_path, hparams_file, kwargs)
        task.on_load_checkpoint(checkpoint)
        task.load_state_dict(checkpoint["state_dict"], strict=task.strict_loading if strict is None else strict)
        if isinstance(map_location, (str, int, torch.device)):
            task.to(map_location)
        return task

    def optimizers(self, use_pl_optimizer: bool = True) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """Return the optimizer `configure_optimizers` gave the Trainer (Lightning's shape: the one, or a list).

        syncline returns the torch optimizer itself; `use_pl_optimizer` is accepted for Lightning's code.
        """
        found = self.trainer.optimizers
        return found[0] if len(found) == 1 else found

    def lr_schedulers(self) -> Any:
        """Return the learning-rate schedulers being used: None without any, the one, or a list."""
        found = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        if not found:
            return None
        return found[0] if len(found) == 1 else found

    # ---------------------------------------------------------------- logging
    def log(
        self,
        name: str,
        value: Tensor | float | int | Metric,
        *,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        logger: bool = True,
        sync_dist: bool = False,
        reduce_fx: str | Callable[..., Any] = "mean",
        batch_size: int | None = None,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Record a metric for the loggers, the progress bar and `trainer.callback_metrics`.

        Args:
            name: key of the metric.
            value: a scalar tensor, a number, or a torchmetrics `Metric` (its batch value per step; its
                `compute()` at epoch end, after which it is reset).
            on_step: log the value of every step; default True in `training_step` and the training batch
                hooks, else False (Lightning's default for each hook; epoch-end hooks log epoch values only).
            on_epoch: log the epoch's aggregate; the opposite default.
                With both, the keys ``name_step`` and ``name_epoch`` are logged.
            prog_bar: show it on the progress bar.
            logger: send it to the loggers.
            sync_dist: reduce it across processes (`reduce_fx`) before it is used.
            reduce_fx: how steps are aggregated into the epoch value: "mean" (or "avg"; weighted by batch
                size), "sum", "max", "min", or torch.mean / torch.sum / torch.max / torch.min.
            batch_size: weight of this value in the epoch mean; inferred from the batch when None.
            add_dataloader_idx: with several evaluation loaders, log under ``name/dataloader_idx_<i>``.
        """
        self.trainer.results.log(
            name,
            value,
            on_step=on_step,
            on_epoch=on_epoch,
            prog_bar=prog_bar,
            logger=logger,
            sync_dist=sync_dist,
            reduce_fx=reduce_fx,
            batch_size=batch_size,
            add_dataloader_idx=add_dataloader_idx,
        )

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        """Call `log` for every entry of `metrics` with the same options."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | dict[str, Any]:
        """Compute and return the loss of one training micro-batch."""
        raise NotImplementedError(
            f"{type(self).__name__} must override `training_step(batch, batch_idx)` to be trained."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one validation batch; log metrics with `self.log`."""

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one test batch; log metrics with `self.log`."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the prediction for one batch; the default calls the task on the batch."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer (and schedulers) in one of Lightning's forms (see the class's docstring)."""
        raise NotImplementedError(
            f"{type(self).__name__} must override `configure_optimizers()` and return an optimizer "
            "(or a dict with 'optimizer' and 'lr_scheduler')."
        )

    # ----------------------------------------------------------- task hooks
    # prepare_data, setup, teardown and the *_dataloader methods are `DataHooks`'.
    # Same names as `callbacks.Callback`'s hooks; the dispatcher calls only those a subclass overrides.
    def on_fit_start(self) -> None:
        """Called when fit starts."""

    def on_fit_end(self) -> None:
        """Called when fit ends."""

    def on_train_start(self) -> None:
        """Called before the first training epoch."""

    def on_train_end(self) -> None:
        """Called after the last training epoch."""

    def on_train_epoch_start(self) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self) -> None:
        """Called at the end of each training epoch; `trainer.callback_metrics` holds the epoch's values."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Called before each training micro-batch."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training micro-batch."""

    def on_before_backward(self, loss: Tensor) -> None:
        """Called before backward."""

    def on_after_backward(self) -> None:
        """Called after backward."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before clipping and the optimizer step."""

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before gradients are reset, at the start of each accumulation window."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Reset the gradients before the first backward of an accumulation window (override to change how)."""
        self.trainer.strategy.zero_grad(optimizer)

    def on_validation_start(self) -> None:
        """Called when a validation run begins."""

    def on_validation_end(self) -> None:
        """Called when a validation run ends, after its metrics are logged."""

    def on_validation_epoch_start(self) -> None:
        """Called before the first validation batch."""

    def on_validation_epoch_end(self) -> None:
        """Called after the last validation batch; `trainer.callback_metrics` holds this run's values."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each validation batch."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each validation batch."""

    def on_test_start(self) -> None:
        """Called when testing begins."""

    def on_test_end(self) -> None:
        """Called when testing ends."""

    def on_test_epoch_start(self) -> None:
        """Called before the first test batch."""

    def on_test_epoch_end(self) -> None:
        """Called after the last test batch."""

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each test batch."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each test batch."""

    def on_predict_start(self) -> None:
        """Called when prediction begins."""

    def on_predict_end(self) -> None:
        """Called when prediction ends."""

    def on_predict_epoch_start(self) -> None:
        """Called before the first predict batch."""

    def on_predict_epoch_end(self) -> None:
        """Called after the last predict batch."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each predict batch."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each predict batch."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add entries to a checkpoint being written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read entries from a checkpoint being restored."""
