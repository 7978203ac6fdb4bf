"""`Task`: the user's model together with the steps that train, evaluate and use it."""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from torchmetrics import Metric

    from syncline.trainer.trainer import Trainer

__all__ = ["AttributeDict", "Task"]

TaskT = TypeVar("TaskT", bound="Task")


class AttributeDict(dict):
    """A dict whose keys read as attributes too: ``hparams.lr`` is ``hparams["lr"]``, as in Lightning."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"no hyperparameter {key!r}; saved: {', '.join(map(str, self)) or 'none'}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class Task(nn.Module):
    """Subclass this and override the steps you need, as with a LightningModule.

    `training_step` returns a loss tensor or a dict with a ``"loss"`` entry; `configure_optimizers`
    returns an optimizer, or a dict with ``"optimizer"`` and optionally ``"lr_scheduler"`` (a scheduler or
    a dict with ``"scheduler"``, ``"interval"`` ("epoch" or "step"), ``"frequency"`` and ``"monitor"``).
    Hooks with the names of `callbacks.Callback`'s, minus its `trainer` and `task` arguments, are called
    before the callbacks' of the same event.
    """

    #: Lightning's switch: False lets a resume start state the checkpoint lacks (a strategy's) afresh.
    strict_loading: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self.hparams = AttributeDict()

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

    def save_hyperparameters(self, **hparams: Any) -> None:
        """Record the arguments of the caller's `__init__` (or the given keywords) in `self.hparams`.

        They are logged by the loggers and stored in checkpoints.
        """
        if not hparams:
            frame = inspect.currentframe()
            caller = frame.f_back if frame is not None else None
            if caller is not None:
                arg_info = inspect.getargvalues(caller)
                hparams = {name: arg_info.locals[name] for name in arg_info.args if name != "self"}
                if arg_info.keywords:
                    hparams.update(arg_info.locals[arg_info.keywords])
        self.hparams.update(hparams)

    @classmethod
    def load_from_checkpoint(
        cls: type[TaskT], checkpoint_path: str | os.PathLike[str], map_location: Any = None, **overrides: Any
    ) -> TaskT:
        """Build the task from a checkpoint's saved hyperparameters and load its weights, as Lightning does.

        The constructor gets the hyperparameters `save_hyperparameters` recorded, with `overrides` taking
        precedence; the weights are then loaded strictly. The task is returned in training mode on the
        device `map_location` names (the CPU by default); call ``.eval()`` for inference.

        Raises:
            CheckpointError: the file is missing, unreadable or not a syncline checkpoint.
            TypeError: the saved hyperparameters (or `overrides`) do not fit the constructor.
        """
        from syncline.trainer.checkpoint import load_checkpoint, require_entries

        checkpoint = load_checkpoint(checkpoint_path, map_location=map_location or "cpu")
        require_entries(checkpoint, ("state_dict",), checkpoint_path)
        arguments = {**checkpoint.get("hparams", {}), **overrides}
        try:
            task = cls(**arguments)
        except TypeError as error:
            raise TypeError(
                f"{cls.__name__}.load_from_checkpoint({str(checkpoint_path)!r}): {error}. The checkpoint's "
                f"hyperparameters are {sorted(checkpoint.get('hparams', {}))}; pass missing ones as keywords."
            ) from error
        task.load_state_dict(checkpoint["state_dict"])
        if isinstance(map_location, (str, int, torch.device)):
            task.to(map_location)
        return task

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
        reduce_fx: str = "mean",
        batch_size: int | None = None,
    ) -> None:
        """Record a metric for the loggers, the progress bar and `trainer.callback_metrics`.

        Args:
            name: key of the metric.
            value: a scalar tensor, a number, or a torchmetrics `Metric` (its batch value per step; its
                `compute()` at epoch end, after which it is reset).
            on_step: log the value of every step; default True in `training_step`, else False.
            on_epoch: log the epoch's aggregate; default False in `training_step`, else True.
                With both, the keys ``name_step`` and ``name_epoch`` are logged.
            prog_bar: show it on the progress bar.
            logger: send it to the loggers.
            sync_dist: reduce it across processes (`reduce_fx`) before it is used.
            reduce_fx: how steps are aggregated into the epoch value: "mean" (weighted by batch size),
                "sum", "max" or "min".
            batch_size: weight of this value in the epoch mean; inferred from the batch when None.
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
        """Return an optimizer, or a dict with ``"optimizer"`` and ``"lr_scheduler"``."""
        raise NotImplementedError(
            f"{type(self).__name__} must override `configure_optimizers()` and return an optimizer "
            "(or a dict with 'optimizer' and 'lr_scheduler')."
        )

    def train_dataloader(self) -> DataLoader:
        """Return the training DataLoader, unless one is passed to `Trainer.fit`."""
        raise NotImplementedError(
            f"No training data: pass `train_dataloaders` to Trainer.fit or override "
            f"`{type(self).__name__}.train_dataloader()`."
        )

    def val_dataloader(self) -> DataLoader | None:
        """Return the validation DataLoader, or None for no validation."""
        return None

    def test_dataloader(self) -> DataLoader | None:
        """Return the test DataLoader."""
        return None

    def predict_dataloader(self) -> DataLoader | None:
        """Return the predict DataLoader."""
        return None

    # ----------------------------------------------------------- task hooks
    # Same names as `callbacks.Callback`'s hooks; the dispatcher calls only those a subclass overrides.
    def setup(self, stage: str) -> None:
        """Build what needs the stage or the process (data, layers sized by data)."""

    def teardown(self, stage: str) -> None:
        """Release what `setup` built."""

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
        """Called at the end of each training epoch; epoch aggregates are computed after it."""

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
        """Called before gradients are reset."""

    def on_validation_epoch_start(self) -> None:
        """Called before the first validation batch."""

    def on_validation_epoch_end(self) -> None:
        """Called after the last validation batch; epoch aggregates are computed after it."""

    def on_test_epoch_start(self) -> None:
        """Called before the first test batch."""

    def on_test_epoch_end(self) -> None:
        """Called after the last test batch."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add entries to a checkpoint being written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read entries from a checkpoint being restored."""
