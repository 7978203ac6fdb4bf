"""What each stage does before its loop runs: open the checkpoint, set up the data, the task and the optimizers.

`Trainer` wires these into its stage lifecycle (`Trainer._run`); the loops themselves live in `fit_loop` and
`evaluation`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from syncline.callbacks.callback import Callback
from syncline.callbacks.prediction_writer import BasePredictionWriter
from syncline.options import MisconfigurationException
from syncline.rank_zero import rank_zero_warn
from syncline.trainer import persistence
from syncline.trainer.data import eval_dataloaders, limit_batches, prepare_loader, prepare_loaders, with_batch_indices
from syncline.trainer.datamodule import merged_hparams, prepare_and_setup
from syncline.trainer.hooks import ModelHooks, overrides
from syncline.trainer.optim import parse_optimizers

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["evaluation_stage", "evaluation_target", "fit_stage", "release_device"]

_LIMITS = {"validate": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}


def fit_stage(trainer: Trainer, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: Any) -> None:
    """Set up `trainer.task` for training (resuming from `ckpt_path`) and run the fit loop."""
    task, strategy = trainer.task, trainer.strategy
    checkpoint = persistence.open_checkpoint(trainer, ckpt_path, resume=True)
    prepare_and_setup(trainer, "fit", checkpoint)
    _load_fit_data(trainer, train_dataloaders, val_dataloaders, warn=True)
    if trainer.reload_dataloaders_every_n_epochs:
        loop = trainer.fit_loop
        loop.reload_data = functools.partial(_reload_fit_data, trainer, train_dataloaders, val_dataloaders)
    _check_val_check_interval(trainer)
    task.configure_model()  # after setup, before the weights are restored and the strategy wraps the task
    if checkpoint is not None:
        # As in Lightning: the task's and the callbacks' state before configure_optimizers.
        persistence.restore_model(trainer, checkpoint, callbacks=True)
    strategy.setup(task)
    # The default hook is `loss.backward()`, which the strategy runs itself without the call through the task.
    strategy.backward_hook = task.backward if overrides(task, ModelHooks, "backward") else None
    manual = not task.automatic_optimization
    own_step = overrides(task, ModelHooks, "lr_scheduler_step")
    trainer.optim = parse_optimizers(task.configure_optimizers(), type(task).__name__, manual, own_step)
    for optimizer in trainer.optim.optimizers:
        strategy.setup_optimizer(optimizer)
    trainer.fit_loop.setup(trainer.optim)
    if checkpoint is not None:
        persistence.restore_training(trainer, checkpoint)
    if in_eval := sum(not module.training for module in task.modules()):  # kept so, as Lightning does
        rank_zero_warn(f"Found {in_eval} module(s) in eval mode at the start of training; they train so.")
    trainer.dispatcher.fire(Callback.on_fit_start)
    hparams = merged_hparams(task, trainer.datamodule)
    if trainer.is_global_zero and hparams:
        for logger in trainer.loggers:
            logger.log_hyperparams(hparams)
    trainer.fit_loop.train()
    trainer.dispatcher.fire(Callback.on_fit_end)


def _load_fit_data(trainer: Trainer, train_dataloaders: Any, val_dataloaders: Any, warn: bool) -> None:
    """Ask for the training and validation loaders (those given to `fit`, else the DataModule's or the task's)."""
    task = trainer.task
    source = trainer.datamodule if trainer.datamodule is not None else task
    loader = train_dataloaders if train_dataloaders is not None else source.train_dataloader()
    trainer.train_dataloader = prepare_loader(trainer, loader)
    limit = trainer.limit_train_batches
    trainer.num_training_batches = limit_batches(trainer.train_dataloader, limit, "limit_train_batches")
    val = val_dataloaders if val_dataloaders is not None else source.val_dataloader()
    if val is not None and not has_step(task, "validation_step"):
        if warn:
            rank_zero_warn("You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop.")
        val = None
    trainer.val_dataloaders, trainer.num_val_batches = prepare_loaders(
        trainer, val, trainer.limit_val_batches, "limit_val_batches"
    )


def _reload_fit_data(trainer: Trainer, train_dataloaders: Any, val_dataloaders: Any, epochs_run: int) -> None:
    """Ask for the loaders again when `epochs_run` epochs of this fit are a multiple of
    `reload_dataloaders_every_n_epochs` (Lightning's rule: every n epochs after the fit's first)."""
    every = trainer.reload_dataloaders_every_n_epochs
    if epochs_run and epochs_run % every == 0:
        _load_fit_data(trainer, train_dataloaders, val_dataloaders, warn=False)


def has_step(task: Task, name: str) -> bool:
    """Whether `task` defines the step method `name` (not left at the base class's, and not set to None)."""
    from syncline.trainer.task import Task

    return getattr(task, name, None) is not None and overrides(task, Task, name)


def _check_eval_step(task: Task, stage: str) -> None:
    """Refuse `validate`/`test` without their step, and `predict` with ``predict_step = None``, as Lightning."""
    if stage == "predict":
        if task.predict_step is None:
            raise MisconfigurationException("`predict_step` cannot be None to run `Trainer.predict`")
        return
    name = "validation_step" if stage == "validate" else "test_step"
    if not has_step(task, name):
        raise MisconfigurationException(f"No `{name}()` method defined to run `Trainer.{stage}`.")


def _check_val_check_interval(trainer: Trainer) -> None:
    """Refuse an int `val_check_interval` longer than the epoch when there is validation, as Lightning does."""
    interval, batches = trainer.val_check_interval, trainer.num_training_batches
    counted_per_epoch = trainer.check_val_every_n_epoch is not None
    if isinstance(interval, int) and interval > batches and counted_per_epoch and any(trainer.num_val_batches):
        raise ValueError(
            f"`val_check_interval` ({interval}) must be less than or equal to the number of the training batches "
            f"({batches}). If you want to disable validation set `limit_val_batches` to 0.0 instead. If you want "
            "to validate based on the total training batches, set `check_val_every_n_epoch=None`."
        )


def evaluation_stage(
    trainer: Trainer, stage: str, dataloaders: Any, ckpt_path: Any, return_predictions: bool | None = None
) -> Any:
    """Run validate, test or predict on `trainer.task`: its metrics (a dict per loader) or its predictions.

    Predictions are returned unless `return_predictions` is False (None is True, as in Lightning without a
    spawning launcher: syncline's launcher sends rank 0's predictions back); they are kept as long as a
    prediction writer writes at the epoch's end.
    """
    task = trainer.task
    _check_eval_step(task, stage)
    checkpoint = persistence.open_checkpoint(trainer, ckpt_path, resume=False)
    prepare_and_setup(trainer, stage, checkpoint)
    source = trainer.datamodule if trainer.datamodule is not None else task
    name = _LIMITS[stage]
    loaders, num_batches = prepare_loaders(
        trainer, eval_dataloaders(source, stage, dataloaders), getattr(trainer, name), name
    )
    trainer.evaluation.loaders[stage] = list(loaders)
    writers = [callback for callback in trainer.callbacks if isinstance(callback, BasePredictionWriter)]
    if stage == "predict" and writers:
        loaders = [with_batch_indices(loader) for loader in loaders]  # after sharding: this rank's indices
    task.configure_model()
    if checkpoint is not None:
        persistence.restore_model(trainer, checkpoint, callbacks=False)
    trainer.strategy.setup(task)
    returned = return_predictions is not False
    keep = returned or any(writer.on_epoch for writer in writers)
    metrics, predictions = trainer.evaluation.run(stage, loaders, num_batches, keep_predictions=keep)
    if stage != "predict":
        return metrics
    return predictions if returned else None


def evaluation_target(stage: str, task: Any, model: Any, ckpt_path: Any, fitted: Any) -> tuple[Any, Any]:
    """Return the task `stage` evaluates and the checkpoint it loads, as Lightning chooses them (`fitted`: the
    task of the Trainer's last stage, or None)."""
    if task is not None and model is not None:
        raise TypeError(f"Trainer.{stage} takes one task: pass it positionally or as model=..., not both.")
    if task is not None or model is not None:
        return task if task is not None else model, ckpt_path
    if fitted is None:
        raise TypeError(f"Trainer.{stage} needs a task: pass it (or model=...), or call fit first.")
    if ckpt_path is None:
        rank_zero_warn(
            f"Trainer.{stage}() without a task uses the fitted one with its best checkpoint, as "
            "Lightning does; pass ckpt_path='best', 'last' or a path to silence this."
        )
    return fitted, "best" if ckpt_path is None else ckpt_path


def release_device(task: Task, optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    """After a stage on a GPU, move the task and its optimizers' state to the CPU, as Lightning's teardown does.

    The trained task then sits where the user built it, and the GPU's memory is free for what comes next.
    """
    if device.type == "cpu":
        return
    task.cpu()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.cpu()
    if device.type == "cuda":
        torch.cuda.empty_cache()
