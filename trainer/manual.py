"""Manual optimization (Lightning's ``automatic_optimization = False``) and the optimizer step both modes share.

A task in manual optimization back-propagates and steps its own optimizers inside `training_step`:

    opt_g, opt_d = self.optimizers()          # TrainerOptimizer wrappers, in configure_optimizers' order
    self.manual_backward(loss)                # precision's scaling, the strategy's synchronized backward
    self.clip_gradients(opt_d, 1.0, "norm")   # optional
    opt_d.step(); opt_d.zero_grad()           # take_step below; counts toward global_step

The Trainer then does no backward, no step, no clipping, no accumulation and steps no scheduler: each is the
task's. Every `manual_backward` synchronizes gradients, so only strategies that average every backward's
gradients exactly can follow (`Strategy.manual_optimization_refused` says why the others cannot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.callbacks.callback import Callback
from syncline.options import OptionError

if TYPE_CHECKING:
    from syncline.trainer.fit_loop import FitLoop
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["TrainerOptimizer", "check_optimization_mode", "manual_outputs", "take_step", "train_batch_manually"]

#: The exact strategies, named in the refusal of the others.
_EXACT = "bucketed_ddp, native_ddp, tensor_fusion, parameter_server or sharded_parameter_server"


def check_optimization_mode(trainer: Trainer, task: Task) -> None:
    """Apply Lightning's rules for the task's optimization mode and tell the strategy, before anything runs.

    Raises:
        ValueError: manual optimization with `Trainer(gradient_clip_val=...)` or `accumulate_grad_batches` > 1
            (Lightning's MisconfigurationException), or with ``uneven_inputs="join"``.
        OptionError: manual optimization with a strategy that cannot synchronize it, naming the strategy and why.
    """
    manual = not task.automatic_optimization
    trainer.strategy.manual_optimization = manual
    if not manual:
        return
    if trainer.gradient_clip_val is not None and trainer.gradient_clip_val > 0:
        raise ValueError(
            "Automatic gradient clipping is not supported for manual optimization. Remove "
            f"`Trainer(gradient_clip_val={trainer.gradient_clip_val})` or switch to automatic optimization "
            "(clip in training_step with self.clip_gradients(optimizer, gradient_clip_val=...))."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "Automatic gradient accumulation is not supported for manual optimization. Remove "
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` or switch to automatic "
            "optimization (accumulate in training_step: step the optimizer every N batches)."
        )
    if trainer.uneven_inputs == "join":
        raise ValueError(
            "uneven_inputs='join' cannot shadow a manual training step (its backwards and steps are the task's); "
            "use uneven_inputs='check' with even data, or automatic optimization."
        )
    reason = trainer.strategy.manual_optimization_refused
    if reason:
        name = trainer.strategy.name or type(trainer.strategy).__name__
        raise OptionError(
            f"strategy={name!r} cannot train {type(task).__name__}, which uses manual optimization "
            f"(automatic_optimization = False): {reason}. Use an exact strategy ({_EXACT}), or automatic "
            "optimization with this strategy."
        )


def take_step(trainer: Trainer, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
    """Take one step of `optimizer` as Lightning's precision plugin does: the closure, unscaling,
    ``on_before_optimizer_step``, clipping (automatic optimization only), then the strategy's step.

    Returns:
        What the closure returned (None without one).
    """
    output = closure() if closure is not None else None
    precision, loop = trainer.precision, trainer.fit_loop
    assert precision is not None
    if precision.scaler is not None:
        precision.unscale(optimizer)
    if loop.fire_before_optimizer_step is not None:
        loop.fire_before_optimizer_step(optimizer)
    if loop.clips:  # automatic optimization, and a clipping hook that would clip (decided per fit)
        trainer.task.configure_gradient_clipping(optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
    step = loop.step_functions.get(optimizer)  # made once per fit
    trainer.strategy.optimizer_step(optimizer, step if step is not None else precision.step(optimizer))
    return output


class TrainerOptimizer:
    """An optimizer as `Task.optimizers()` gives it (Lightning's ``LightningOptimizer``).

    `step()` goes through the Trainer (`take_step`: the loss scaler, ``on_before_optimizer_step``, the strategy's
    step) and, under manual optimization, counts toward `global_step`; everything else is the wrapped
    optimizer's. It is an instance of the optimizer's class too, so ``isinstance(opt, torch.optim.Adam)`` holds.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer) -> None:
        self._optimizer = optimizer
        self._trainer = trainer
        kind = type(optimizer)
        self.__class__ = type(f"Trainer{kind.__name__}", (TrainerOptimizer, kind), {})

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer this wraps."""
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Take the optimizer step through the Trainer; `closure` runs first (its result is returned).

        Raises:
            TypeError: `closure` is not callable, or `kwargs` are given (syncline's step takes none).
        """
        if closure is not None and not callable(closure):
            raise TypeError("When `optimizer.step(closure)` is called, the closure should be callable.")
        if kwargs:
            raise TypeError(f"optimizer.step() through the Trainer takes no keyword arguments, got {sorted(kwargs)}.")
        trainer = self._trainer
        output = take_step(trainer, self._optimizer, closure)
        if trainer.fit_loop.manual:
            # Lightning counts every manual step toward global_step (two optimizers: two per batch).
            trainer.state.global_step += 1
            trainer.fit_loop.stepped = True
        return output

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the wrapped optimizer's gradients (to None by default, through the strategy)."""
        if set_to_none:
            self._trainer.strategy.zero_grad(self._optimizer)
        else:
            self._optimizer.zero_grad(set_to_none=False)

    def __getattr__(self, name: str) -> Any:
        if name == "_optimizer":  # not set yet (a copy being built): never recurse
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"TrainerOptimizer({self._optimizer!r})"


def manual_outputs(outputs: Any, task_name: str) -> Any:
    """Return what a manual `training_step` returned, its loss detached (Lightning's ``ManualResult``).

    Raises:
        TypeError: neither None, a tensor nor a dict.
    """
    if outputs is None:
        return None
    if isinstance(outputs, Tensor):
        return {"loss": outputs.detach()}
    if isinstance(outputs, dict):
        loss = outputs.get("loss")
        return {**outputs, "loss": loss.detach()} if isinstance(loss, Tensor) else dict(outputs)
    raise TypeError(
        f"{task_name}.training_step returned {type(outputs).__name__}; in manual optimization, `training_step` "
        "must either return a Tensor (or a dict) or have no return."
    )


def train_batch_manually(loop: FitLoop, batch: Any, batch_idx: int) -> None:
    """Run one batch of manual optimization: the task's `training_step` does the backwards and steps."""
    trainer, task, state = loop.trainer, loop.trainer.task, loop.state
    batch = loop.transfer(batch)
    trainer.results.new_batch(batch)
    loop.fire(Callback.on_train_batch_start, batch, batch_idx)
    steps_before = state.global_step
    trainer.strategy.sync_next_backward = True  # every manual_backward synchronizes
    trainer.results.hook = "training_step"
    with trainer.precision.autocast():
        outputs = trainer.strategy.training_step(task, batch, batch_idx)
    trainer.results.hook = ""
    outputs = manual_outputs(outputs, type(task).__name__)
    # Counted before the batch-end hooks, so a checkpoint taken there resumes after this batch.
    state.batch_idx = batch_idx + 1
    loop.fire(Callback.on_train_batch_end, outputs, batch, batch_idx)
    every = trainer.log_every_n_steps
    if state.global_step // every != steps_before // every or state.should_stop:
        loop.flush_step_logs()
