"""The `Callback` base class and the one dispatcher through which the Trainer fires every hook."""

from __future__ import annotations

import functools
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

    The hooks and their order follow Lightning: within one event the callbacks run in the order given to
    the Trainer, then the task's hook of the same name (see `CallbackDispatcher` for the exceptions).
    """

    #: Whether this callback's hooks after an optimizer step (`on_train_batch_end`, `on_train_epoch_end`) may read
    #: the task's parameters. A strategy may still have the step in flight there (a parameter server's prefetched
    #: broadcasts, deferred updates): the loop lands it first when any listener says True. A callback that only
    #: counts, times or logs says False, and the step stays overlapped with the next forward.
    reads_parameters: bool = True
    #: Whether this callback acts on a monitored metric at the end of a training epoch (`ModelCheckpoint`,
    #: `EarlyStopping`): as in Lightning, it runs after the other callbacks and the task there, so it sees what
    #: they logged.
    acts_on_monitor: bool = False

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
        """Called before the gradients are reset, on each accumulation window's first micro-batch (after its
        `training_step`, before its backward), as in Lightning; after a step, use `on_train_batch_end`."""

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
Listener = Callable[..., None]

#: The one hook Lightning calls on the module before the callbacks: a checkpoint being restored is the
#: task's to adapt first (its weights are loaded right after its hook).
_TASK_FIRST = frozenset({"on_load_checkpoint"})


class _Listeners:
    """Who listens to one hook: the task's override (if any) and the callbacks', in firing order."""

    __slots__ = ("callbacks", "monitoring", "name", "ordered", "others", "reads_parameters", "task")

    def __init__(
        self,
        name: str,
        task: list[Listener],
        callbacks: list[Listener],
        monitoring: list[bool],
        reads_parameters: bool = True,
    ) -> None:
        self.name = name
        self.reads_parameters = reads_parameters
        self.task = task
        self.callbacks = callbacks
        self.others = [c for c, monitors in zip(callbacks, monitoring) if not monitors]
        self.monitoring = [c for c, monitors in zip(callbacks, monitoring) if monitors]
        self.ordered = task + callbacks if name in _TASK_FIRST else callbacks + task


def _call_task_hook(hook: Callable[..., None], _trainer: Trainer, _task: Task, *args: Any, **kwargs: Any) -> None:
    """Call the task's own `hook`, which takes the hook's arguments without the trainer and the task."""
    hook(*args, **kwargs)


class CallbackDispatcher:
    """Fire hooks on the callbacks and the task, in Lightning's order, skipping those that do not override a hook.

    As in Lightning, the callbacks' hooks run before the task's, except `on_load_checkpoint` (the task
    first) and `on_train_epoch_end` (the loop calls `fire_epoch_end`: other callbacks, the task, then the
    callbacks that monitor a metric, so that they can act on what the task logged at the epoch's end).

    A hook is named by the `Callback` method itself (`dispatcher.fire(Callback.on_fit_start, ...)`), so a
    misspelled hook is an AttributeError where it is written, not a silently skipped event. Which
    callbacks override which hook is worked out once, so an event nobody listens to costs one dict
    lookup. While a hook runs, `trainer.results.hook` names it: `self.log` takes its defaults from it.
    """

    def __init__(
        self, trainer: Trainer, task: Task | None, callbacks: Sequence[Callback], task_base: type = object
    ) -> None:
        """`task_base` is the class whose hooks are the defaults (`Task`): a task's hook that is its own listens."""
        self.task_base = task_base
        self.trainer = trainer
        self.task = task
        self.callbacks = list(callbacks)
        self._listeners: dict[Hook, _Listeners] = {}

    def bind(self, task: Task, callbacks: Sequence[Callback] | None = None) -> None:
        """Fire the hooks of `task` (and of `callbacks`, when given) from now on (each stage binds its task)."""
        self.task = task
        if callbacks is not None:
            self.callbacks = list(callbacks)
        self._listeners.clear()

    def _resolve(self, hook: Hook) -> _Listeners:
        name = hook.__name__
        task_listeners: list[Listener] = []
        task_hook = getattr(type(self.task), name, None) if self.task is not None else None
        if task_hook is not None and task_hook is not getattr(self.task_base, name, None):
            # A partial, not a lambda: the loop keeps these for a fit, and the Trainer is pickled for workers.
            task_listeners.append(functools.partial(_call_task_hook, getattr(self.task, name)))
        # A class without the hook itself (a `Mock(spec=Callback)`, as Lightning's tests use) listens to every one.
        listening = [callback for callback in self.callbacks if getattr(type(callback), name, None) is not hook]
        return _Listeners(
            name,
            task_listeners,
            [getattr(callback, name) for callback in listening],
            [callback.acts_on_monitor for callback in listening],
            # A task's own hook may read anything.
            bool(task_listeners) or any(callback.reads_parameters for callback in listening),
        )

    def _listeners_of(self, hook: Hook) -> _Listeners:
        listeners = self._listeners.get(hook)
        if listeners is None:
            listeners = self._listeners[hook] = self._resolve(hook)
        return listeners

    def reads_parameters(self, hook: Hook) -> bool:
        """Whether the task or a callback listening to `hook` may read the parameters (`Callback.reads_parameters`)."""
        return self._listeners_of(hook).reads_parameters

    def fire(
        self,
        hook: Callable[Concatenate[Callback, Trainer, Task, P], None],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        """Call `hook` on every callback that overrides it and on the task (if it overrides it)."""
        listeners = self._listeners_of(hook)
        if listeners.ordered:
            # Keyword arguments (``setup(stage=...)``, as Lightning passes them) only on these rare hooks.
            called = [functools.partial(listener, **kwargs) for listener in listeners.ordered] if kwargs else None
            self._call(listeners.name, called or listeners.ordered, *args)

    def caller(self, hook: Hook) -> Callable[..., None] | None:
        """Return what fires `hook` on its listeners as they are now, or None when nobody listens.

        For the hooks of every training step: the loop asks once per fit (its task and callbacks are fixed),
        so a step pays neither for the lookup nor for a hook nobody overrides.
        """
        listeners = self._listeners_of(hook)
        if not listeners.ordered:
            return None
        # A partial, not a closure: the Trainer (and its loop holding this) is pickled to start spawned workers.
        return functools.partial(self._call, listeners.name, tuple(listeners.ordered))

    def fire_epoch_end(self, hook: Callable[Concatenate[Callback, Trainer, Task, P], None], monitoring: bool) -> None:
        """Call `hook` as Lightning calls ``on_train_epoch_end``: with `monitoring` False, the callbacks that
        do not monitor a metric and then the task; with `monitoring` True, ModelCheckpoint and EarlyStopping."""
        listeners = self._listeners_of(hook)
        self._call(listeners.name, listeners.monitoring if monitoring else listeners.others + listeners.task)

    def _call(self, name: str, listeners: Sequence[Listener], *args: Any) -> None:
        # Positional arguments only: the hooks of every step pay for no keyword dictionary per listener.
        trainer, task = self.trainer, self.task
        results = trainer.results
        previous, results.hook = results.hook, name
        for listener in listeners:
            listener(trainer, task, *args)
        results.hook = previous
