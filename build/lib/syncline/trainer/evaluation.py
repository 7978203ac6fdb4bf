"""Validation, test and predict: one loop over evaluation batches, parametrized by the stage's hooks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from syncline.callbacks.callback import Callback
from syncline.trainer.data import epoch_batches

if TYPE_CHECKING:
    from syncline.trainer.trainer import Trainer

__all__ = ["EVAL_STAGES", "EvalStage", "run_evaluation"]


@dataclass(frozen=True)
class EvalStage:
    """The step method and the hooks of one evaluation stage."""

    step: str
    start: Callable[..., None]
    epoch_start: Callable[..., None]
    batch_start: Callable[..., None]
    batch_end: Callable[..., None]
    epoch_end: Callable[..., None]
    end: Callable[..., None]


EVAL_STAGES: dict[str, EvalStage] = {
    "validate": EvalStage(
        "validation_step",
        Callback.on_validation_start,
        Callback.on_validation_epoch_start,
        Callback.on_validation_batch_start,
        Callback.on_validation_batch_end,
        Callback.on_validation_epoch_end,
        Callback.on_validation_end,
    ),
    "test": EvalStage(
        "test_step",
        Callback.on_test_start,
        Callback.on_test_epoch_start,
        Callback.on_test_batch_start,
        Callback.on_test_batch_end,
        Callback.on_test_epoch_end,
        Callback.on_test_end,
    ),
    "predict": EvalStage(
        "predict_step",
        Callback.on_predict_start,
        Callback.on_predict_epoch_start,
        Callback.on_predict_batch_start,
        Callback.on_predict_batch_end,
        Callback.on_predict_epoch_end,
        Callback.on_predict_end,
    ),
}


def run_evaluation(
    trainer: Trainer, stage: str, loaders: Sequence[Any], num_batches: Sequence[int | float]
) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """Run `stage` over `loaders` without gradients and return (epoch metrics, predictions).

    The task is in eval mode for the duration and returns to the mode it had. Predictions are collected
    only for the predict stage.
    """
    hooks = EVAL_STAGES[stage]
    task, strategy, dispatcher = trainer.task, trainer.strategy, trainer.dispatcher
    step_fn = getattr(task, hooks.step)
    predictions: list[Any] = []
    trainer.num_eval_batches = list(num_batches)
    was_training = task.training
    task.eval()
    dispatcher.fire(hooks.start)
    dispatcher.fire(hooks.epoch_start)
    with torch.no_grad():
        for dataloader_idx, (loader, limit) in enumerate(zip(loaders, num_batches)):
            extra = (dataloader_idx,) if len(loaders) > 1 else ()
            for batch_idx, batch in enumerate(epoch_batches(loader, limit)):
                batch = strategy.batch_to_device(batch)
                trainer.results.new_batch(batch)
                dispatcher.fire(hooks.batch_start, batch, batch_idx, dataloader_idx)
                with trainer.precision.autocast():
                    outputs = step_fn(batch, batch_idx, *extra)
                if stage == "predict":
                    predictions.append(outputs)
                dispatcher.fire(hooks.batch_end, outputs, batch, batch_idx, dataloader_idx)
    dispatcher.fire_task(hooks.epoch_end)
    metrics = trainer.results.epoch_end()
    dispatcher.fire_callbacks(hooks.epoch_end)
    dispatcher.fire(hooks.end)
    task.train(was_training)
    return metrics, predictions
