"""`Task`: the user's model together with the steps that train, evaluate and use it."""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor, nn

from syncline.rank_zero import rank_zero_warn
from syncline.trainer.hooks import DataHooks, ModelHooks
from syncline.trainer.hparams import AttributeDict, HyperparametersMixin, build_from_hparams, read_for_loading
from syncline.trainer.results import is_metric

if TYPE_CHECKING:
    from torchmetrics import Metric

    from syncline.callbacks.callback import Callback
    from syncline.callbacks.logger import Logger
    from syncline.trainer.trainer import Trainer

__all__ = ["AttributeDict", "Task"]

TaskT = TypeVar("TaskT", bound="Task")


class Task(DataHooks, ModelHooks, HyperparametersMixin, nn.Module):
    """Subclass this and override the steps you need, as with a LightningModule.

    `training_step` returns a loss tensor or a dict with a ``"loss"`` entry; `configure_optimizers`
    returns an optimizer in any of Lightning's forms: an optimizer, a list, ``([optimizer], [schedulers])``,
    a dict with ``"optimizer"`` and optionally ``"lr_scheduler"`` (a scheduler or a dict with ``"scheduler"``,
    ``"interval"`` ("epoch" or "step"), ``"frequency"``, ``"monitor"``, ``"strict"``, ``"name"``) and
    ``"monitor"``, or a list of such dicts; one optimizer, as Lightning's automatic optimization allows, or
    several with manual optimization (``self.automatic_optimization = False``: `training_step` calls
    `manual_backward` and steps ``self.optimizers()`` itself; see trainer/manual.py).
    Hooks with the names of `callbacks.Callback`'s, minus its `trainer` and `task` arguments, are called
    before the callbacks' of the same event.
    """

    #: Lightning's switch: False lets a resume start state the checkpoint lacks (a strategy's) afresh.
    strict_loading: bool = True
    _automatic_optimization: bool = True
    #: True while torch traces the task (`TensorBoardLogger.log_graph`): the tracer reads every property.
    _jit_is_scripting: bool = False

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self._param_requires_grad_state: dict[Tensor, bool] = {}
        self._init_hparams()

    # ------------------------------------------------------------ environment
    @property
    def trainer(self) -> Trainer:
        """The Trainer running this task.

        Raises:
            RuntimeError: the task is not attached to a Trainer.
        """
        if self._trainer is None and not self._jit_is_scripting:
            raise RuntimeError(f"{type(self).__name__} is not attached to a `Trainer`; call it from a step.")
        return self._trainer  # type: ignore[return-value]

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        # As in Lightning, tasks nested in this one are attached too.
        for child in self.children():
            if isinstance(child, Task):
                child.trainer = trainer
        self._trainer = trainer

    @property
    def logger(self) -> Logger | None:
        """The Trainer's first logger (None without a Trainer or a logger); ``self.logger.experiment`` is its
        writer."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Logger]:
        """The Trainer's loggers (empty without a Trainer)."""
        return self._trainer.loggers if self._trainer is not None else []

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine (0 outside a Trainer)."""
        return self._trainer.local_rank if self._trainer is not None else 0

    def freeze(self) -> None:
        """Stop every parameter from requiring gradients and put the task in eval mode (for inference)."""
        for param in self.parameters():
            param.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Let every parameter require gradients again and put the task in training mode."""
        for param in self.parameters():
            param.requires_grad = True
        self.train()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

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
        from syncline.checkpoint_file import require_entries

        checkpoint = read_for_loading(checkpoint_path, map_location)
        require_entries(checkpoint, ("state_dict",), checkpoint_path)
        task = build_from_hparams(cls, checkpoint, "", checkpoint_path, hparams_file, kwargs)
        task.on_load_checkpoint(checkpoint)
        task.load_state_dict(checkpoint["state_dict"], strict=task.strict_loading if strict is None else strict)
        if isinstance(map_location, (str, int, torch.device)):
            task.to(map_location)
        return task

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """Return the optimizers `configure_optimizers` gave the Trainer: the one, or a list (Lightning's shape).

        With `use_pl_optimizer` (the default) each is a `TrainerOptimizer`, whose ``step()`` goes through the
        Trainer (and counts toward `global_step` under manual optimization); False gives the torch optimizers.
        """
        found = self.trainer.fit_loop.trainer_optimizers if use_pl_optimizer else self.trainer.optimizers
        return found[0] if len(found) == 1 else list(found)

    def lr_schedulers(self) -> Any:
        """Return the learning-rate schedulers being used: None without any, the one, or a list."""
        found = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        if not found:
            return None
        return found[0] if len(found) == 1 else found

    # ----------------------------------------------------- manual optimization
    @property
    def automatic_optimization(self) -> bool:
        """False when `training_step` back-propagates and steps the optimizers itself (Lightning's switch)."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, automatic: bool) -> None:
        self._automatic_optimization = automatic

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate `loss` in manual optimization: the loss scaler's scaling, ``on_before_backward``, the
        strategy's backward (which synchronizes gradients across processes, through the `backward` hook, given
        `args` and `kwargs`, e.g. ``retain_graph=True``), ``on_after_backward``.

        Raises:
            RuntimeError: the task uses automatic optimization.
        """
        from syncline.callbacks.callback import Callback

        if self.automatic_optimization:
            raise RuntimeError(
                "To use manual_backward, please disable automatic optimization: set the task's property "
                "`automatic_optimization` to False."
            )
        trainer = self.trainer
        assert trainer.precision is not None
        retain_graph = bool(kwargs.pop("retain_graph", False))
        strategy = trainer.strategy
        hook = strategy.backward_hook
        if args or kwargs:
            strategy.backward_hook = lambda tensor, **more: self.backward(tensor, *args, **kwargs, **more)
        try:
            trainer.dispatcher.fire(Callback.on_before_backward, loss)
            strategy.backward(trainer.precision.scale_loss(loss), sync=True, retain_graph=retain_graph)
        finally:
            strategy.backward_hook = hook
        trainer.dispatcher.fire(Callback.on_after_backward)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Let only `optimizer`'s parameters require grad: the other optimizers' parameters stop requiring it
        until `untoggle_optimizer`, so a backward for this optimizer computes no gradient for them."""
        parameters_of = self.trainer.strategy.optimizer_parameters
        states: dict[Tensor, bool] = {}
        for other in self.trainer.optimizers:
            for param in parameters_of(other):
                if param not in states:
                    states[param] = param.requires_grad
                    param.requires_grad = False
        for param in parameters_of(getattr(optimizer, "optimizer", optimizer)):
            param.requires_grad = states[param]
        self._param_requires_grad_state = states

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give the other optimizers' parameters back the `requires_grad` they had before `toggle_optimizer`."""
        mine = getattr(optimizer, "optimizer", optimizer)
        for other in self.trainer.optimizers:
            if other is mine:
                continue
            for param in self.trainer.strategy.optimizer_parameters(other):
                if param in self._param_requires_grad_state:
                    param.requires_grad = self._param_requires_grad_state[param]
        self._param_requires_grad_state = {}

    @contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """`toggle_optimizer` inside the block, `untoggle_optimizer` after it (even on an error)."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients of `optimizer`'s parameters, after unscaling them (fp16): their global 2-norm to
        `gradient_clip_val` ("norm"), or every element to [-val, val] ("value"); None or 0 clips nothing.
        Defaults are the Trainer's `gradient_clip_val` and `gradient_clip_algorithm`, as in Lightning.

        Raises:
            ValueError: a value or algorithm that contradicts the Trainer's, or an unknown algorithm.
            TypeError: `gradient_clip_val` is not a number.
        """
        trainer = self.trainer
        configured = trainer.gradient_clip_val is not None
        if gradient_clip_val is None:
            gradient_clip_val = trainer.gradient_clip_val or 0.0
        elif configured and trainer.gradient_clip_val != gradient_clip_val:
            raise ValueError(
                f"You have set `Trainer(gradient_clip_val={trainer.gradient_clip_val!r})` and have passed "
                f"`clip_gradients(gradient_clip_val={gradient_clip_val!r})`. Please use only one of them."
            )
        if gradient_clip_algorithm is None:
            gradient_clip_algorithm = trainer.gradient_clip_algorithm
        elif configured and trainer.gradient_clip_algorithm != gradient_clip_algorithm.lower():
            raise ValueError(
                f"You have set `Trainer(gradient_clip_algorithm={trainer.gradient_clip_algorithm!r})` and have "
                f"passed `clip_gradients(gradient_clip_algorithm={gradient_clip_algorithm!r})`. Please use only "
                "one of them."
            )
        algorithm = gradient_clip_algorithm.lower()
        if isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float)):
            raise TypeError(f"`gradient_clip_val` should be an int or a float. Got {gradient_clip_val!r}.")
        if algorithm not in ("norm", "value"):
            raise ValueError(f"`gradient_clip_algorithm` {algorithm!r} is invalid. Allowed: 'norm', 'value'.")
        if gradient_clip_val <= 0:
            return
        optimizer = getattr(optimizer, "optimizer", optimizer)
        assert trainer.precision is not None
        trainer.precision.unscale(optimizer)
        if self.automatic_optimization:
            # The strategy's own view of the task's parameters (a sharded one clips its slices).
            parameters = trainer.fit_loop.parameters
        else:
            parameters = trainer.strategy.optimizer_parameters(optimizer)
        trainer.strategy.clip_gradients(parameters, float(gradient_clip_val), algorithm)

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

        Raises:
            ValueError: `value` is not a number, a one-element tensor or a torchmetrics `Metric`.
            MisconfigurationException: the hook cannot log, or cannot log at this level (Lightning's rules).
        """
        if self._trainer is None:
            # Not an error, as in Lightning: a step may be tested without a Trainer.
            rank_zero_warn(
                f"self.log({name!r}, ...) outside a Trainer records nothing: the task is not attached to one."
            )
            return
        # One isinstance at a time: a tuple with the Number ABC costs three times the Tensor check alone.
        if not isinstance(value, Tensor) and not isinstance(value, numbers.Number) and not is_metric(value):
            kind = "nested dictionaries" if isinstance(value, dict) else f"`{type(value).__name__}` values"
            raise ValueError(f"`self.log({name}, {value})` was called, but {kind} cannot be logged")
        self._trainer.results.log(
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

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Return the prediction for one batch; the default calls the task on the batch."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer (and schedulers) in one of Lightning's forms (see the class's docstring)."""
        raise NotImplementedError(
            f"{type(self).__name__} must override `configure_optimizers()` and return an optimizer "
            "(or a dict with 'optimizer' and 'lr_scheduler')."
        )

    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        """Return callbacks this task needs (a list, or one): at the start of every stage they join the Trainer's,
        each replacing the Trainer's callbacks of exactly its type, and ModelCheckpoints run last (Lightning's
        rule)."""
        return []

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
