"""The `Callback` base class and the one dispatcher through which the Trainer fires every hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

import torch
from torch import Tensor

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["Callback", "CallbackDispatcher"]

P = ParamSpec("P")


class Callback:
    """Observe training: override the hooks you need; every hook here does nothing.

    The hooks and their order follow Lightning. Within one event the task's hook of the same name runs
    first, then the callbacks in the order given to the Trainer, so a callback sees what the task logged.
    """

    @property
    def state_key(self) -> str:
        """Key under which this callback's state is stored in a checkpoint."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        """Return what must survive a resume."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    # ---------------------------------------------------------------- lifecycle
    def setup(self, trainer: Trainer, task: Task, stage: str) -> None:
        """Called when fit, validate, test or predict begins, before the task is on its device."""

    def teardown(self, trainer: Trainer, task: Task, stage: str) -> None:
        """Called when fit, validate, test or predict ends, also after an exception."""

    def on_fit_start(self, trainer: Trainer, task: Task) -> None:
        """Called once the task is set up and any checkpoint restored, before sanity validation."""

    def on_fit_end(self, trainer: Trainer, task: Task) -> None:
        """Called when fit ends normally."""

    def on_sanity_check_start(self, trainer: Trainer, task: Task) -> None:
        """Called before the sanity validation batches."""

    def on_sanity_check_end(self, trainer: Trainer, task: Task) -> None:
        """Called after the sanity validation batches."""

    def on_exception(self, trainer: Trainer, task: Task, exception: BaseException) -> None:
        """Called when any stage raises, before teardown."""

    # ----------------------------------------------------------------- training
    def on_train_start(self, trainer: Trainer, task: Task) -> None:
        """Called before the first training epoch."""

    def on_train_end(self, trainer: Trainer, task: Task) -> None:
        """Called after the last training epoch."""

    def on_train_epoch_start(self, trainer: Trainer, task: Task) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Called at the end of each training epoch, after its validation and epoch metrics."""

    def on_train_batch_start(self, trainer: Trainer, task: Task, batch: Any, batch_idx: int) -> None:
        """Called before each training micro-batch."""

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training micro-batch, after its optimizer step when there was one."""

    def on_before_backward(self, trainer: Trainer, task: Task, loss: Tensor) -> None:
        """Called before `backward` with the loss as it will be back-propagated."""

    def on_after_backward(self, trainer: Trainer, task: Task) -> None:
        """Called after `backward`; gradients are synchronized when this micro-batch ends a window."""

    def on_before_optimizer_step(self, trainer: Trainer, task: Task, optimizer: torch.optim.Optimizer) -> None:
        """Called before clipping and the optimizer step, with unscaled gradients."""

    def on_before_zero_grad(self, trainer: Trainer, task: Task, optimizer: torch.optim.Optimizer) -> None:
        """Called after the optimizer step, before gradients are reset."""

    # --------------------------------------------------------------- validation
    def on_validation_start(self, trainer: Trainer, task: Task) -> None:
        """Called when a validation run begins."""

    def on_validation_end(self, trainer: Trainer, task: Task) -> None:
        """Called when a validation run ends, after its epoch metrics."""

    def on_validation_epoch_start(self, trainer: Trainer, task: Task) -> None:
        """Called before the first validation batch."""

    def on_validation_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Called after the last validation batch, once its epoch metrics are computed."""

    def on_validation_batch_start(
        self, trainer: Trainer, task: Task, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before each validation batch."""

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        task: Task,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each validation batch."""

    # --------------------------------------------------------------------- test
    def on_test_start(self, trainer: Trainer, task: Task) -> None:
        """Called when testing begins."""

    def on_test_end(self, trainer: Trainer, task: Task) -> None:
        """Called when testing ends."""

    def on_test_epoch_start(self, trainer: Trainer, task: Task) -> None:
        """Called before the first test batch."""

    def on_test_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Called after the last test batch, once its epoch metrics are computed."""

    def on_test_batch_start(
        self, trainer: Trainer, task: Task, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before each test batch."""

    def on_test_batch_end(
        self,
        trainer: Trainer,
        task: Task,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each test batch."""

    # ------------------------------------------------------------------ predict
    def on_predict_start(self, trainer: Trainer, task: Task) -> None:
        """Called when prediction begins."""

    def on_predict_end(self, trainer: Trainer, task: Task) -> None:
        """Called when prediction ends."""

    def on_predict_epoch_start(self, trainer: Trainer, task: Task) -> None:
        """Called before the first predict batch."""

    def on_predict_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Called after the last predict batch."""

    def on_predict_batch_start(
        self, trainer: Trainer, task: Task, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before each predict batch."""

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        task: Task,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each predict batch."""

    # --------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, trainer: Trainer, task: Task, checkpoint: dict[str, Any]) -> None:
        """Called while a checkpoint is assembled; may add entries to `checkpoint`."""

    def on_load_checkpoint(self, trainer: Trainer, task: Task, checkpoint: dict[str, Any]) -> None:
        """Called after a checkpoint is read, before the trainer restores from it."""


Hook = Callable[..., None]


class CallbackDispatcher:
    """Fire hooks on the task and the callbacks, skipping those that do not override a hook.

    A hook is named by the `Callback` method itself (`dispatcher.fire(Callback.on_fit_start, ...)`), so a
    misspelled hook is an AttributeError where it is written, not a silently skipped event. Which
    callbacks override which hook is worked out once, so an event nobody listens to costs one dict
    lookup.
    """

    def __init__(self, trainer: Trainer, task: Task, callbacks: Sequence[Callback]) -> None:
        self.trainer = trainer
        self.task = task
        self.callbacks = list(callbacks)
        self._listeners: dict[Hook, tuple[list[Callable[..., None]], list[Callable[..., None]]]] = {}

    def _resolve(self, hook: Hook) -> tuple[list[Callable[..., None]], list[Callable[..., None]]]:
        from syncline.trainer.task import Task

        name = hook.__name__
        task_listeners: list[Callable[..., None]] = []
        task_hook = getattr(type(self.task), name, None)
        if task_hook is not None and task_hook is not getattr(Task, name, None):
            bound = getattr(self.task, name)
            task_listeners.append(lambda _trainer, _task, *args, **kwargs: bound(*args, **kwargs))
        callback_listeners = [
            getattr(callback, name) for callback in self.callbacks if getattr(type(callback), name) is not hook
        ]
        return task_listeners, callback_listeners

    def _listeners_of(self, hook: Hook) -> tuple[list[Callable[..., None]], list[Callable[..., None]]]:
        listeners = self._listeners.get(hook)
        if listeners is None:
            listeners = self._listeners[hook] = self._resolve(hook)
        return listeners

    def fire(
        self,
        hook: Callable[Concatenate[Callback, Trainer, Task, P], None],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        """Call `hook` on the task (if it overrides it), then on every callback that overrides it."""
        task_listeners, callback_listeners = self._listeners_of(hook)
        for listener in task_listeners:
            listener(self.trainer, self.task, *args, **kwargs)
        for listener in callback_listeners:
            listener(self.trainer, self.task, *args, **kwargs)

    def fire_task(
        self,
        hook: Callable[Concatenate[Callback, Trainer, Task, P], None],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        """Call only the task's version of `hook` (for events where the trainer acts in between)."""
        for listener in self._listeners_of(hook)[0]:
            listener(self.trainer, self.task, *args, **kwargs)

    def fire_callbacks(
        self,
        hook: Callable[Concatenate[Callback, Trainer, Task, P], None],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        """Call only the callbacks' versions of `hook`."""
        for listener in self._listeners_of(hook)[1]:
            listener(self.trainer, self.task, *args, **kwargs)
