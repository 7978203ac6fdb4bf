"""What each stage does before its loop runs: open the checkpoint, set up the data, the task and the optimizers.

`Trainer` wires these into its stage lifecycle (`Trainer._run`); the loops themselves live in `fit_loop` and
`evaluation`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from syncline.callbacks.callback import Callback
from syncline.trainer import persistence
from syncline.trainer.data import eval_dataloaders, limit_batches, prepare_loader, prepare_loaders
from syncline.trainer.datamodule import merged_hparams, prepare_and_setup
from syncline.trainer.optim import parse_optimizers
from syncline.trainer.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from syncline.trainer.trainer import Trainer

__all__ = ["evaluation_stage", "fit_stage"]

_LIMITS = {"validate": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}


def fit_stage(trainer: Trainer, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: Any) -> None:
    """Set up `trainer.task` for training (resuming from `ckpt_path`) and run the fit loop."""
    task, strategy = trainer.task, trainer.strategy
    checkpoint = persistence.open_checkpoint(trainer, ckpt_path, resume=True)
    prepare_and_setup(trainer, "fit", checkpoint)
    source = trainer.datamodule if trainer.datamodule is not None else task
    loader = train_dataloaders if train_dataloaders is not None else source.train_dataloader()
    trainer.train_dataloader = prepare_loader(trainer, loader)
    limit = trainer.limit_train_batches
    trainer.num_training_batches = limit_batches(trainer.train_dataloader, limit, "limit_train_batches")
    val = val_dataloaders if val_dataloaders is not None else source.val_dataloader()
    trainer.val_dataloaders, trainer.num_val_batches = prepare_loaders(
        trainer, val, trainer.limit_val_batches, "limit_val_batches"
    )
    if checkpoint is not None:
        # As in Lightning: the task's and the callbacks' state before configure_optimizers.
        persistence.restore_model(trainer, checkpoint, callbacks=True)
    strategy.setup(task)
    trainer.optim = parse_optimizers(task.configure_optimizers(), type(task).__name__)
    strategy.setup_optimizer(trainer.optim.optimizer)
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


def evaluation_stage(trainer: Trainer, stage: str, dataloaders: Any, ckpt_path: Any) -> Any:
    """Run validate, test or predict on `trainer.task`: its metrics (a dict per loader) or its predictions."""
    task = trainer.task
    checkpoint = persistence.open_checkpoint(trainer, ckpt_path, resume=False)
    prepare_and_setup(trainer, stage, checkpoint)
    source = trainer.datamodule if trainer.datamodule is not None else task
    name = _LIMITS[stage]
    loaders, num_batches = prepare_loaders(
        trainer, eval_dataloaders(source, stage, dataloaders), getattr(trainer, name), name
    )
    if checkpoint is not None:
        persistence.restore_model(trainer, checkpoint, callbacks=False)
    trainer.strategy.setup(task)
    metrics, predictions = trainer.evaluation.run(stage, loaders, num_batches)
    return predictions if stage == "predict" else metrics
