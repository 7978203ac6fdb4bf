"""Validation, test and predict: one loop over evaluation batches, parametrized by the stage's hooks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from syncline.callbacks.callback import Callback
from syncline.strategies.strategy import move_to_device
from syncline.trainer.data import BatchIndexRecorder, batch_mover, epoch_batches

if TYPE_CHECKING:
    from syncline.trainer.trainer import Trainer

__all__ = ["EVAL_STAGES", "EvalStage", "EvaluationLoop", "ModuleModes"]


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


class ModuleModes:
    """The train/eval mode of every submodule of a module, captured so it can be put back as it was.

    A frozen encoder the user put in `.eval()` stays in eval mode through training, and evaluation hands
    every submodule back in the mode it found it in, as Lightning does.
    """

    def __init__(self, module: nn.Module) -> None:
        self.modes = [(submodule, submodule.training) for submodule in module.modules()]

    def restore(self) -> None:
        """Put every submodule back in the mode it had when captured."""
        for submodule, training in self.modes:
            submodule.training = training


class EvaluationLoop:
    """Run one evaluation stage (validate, test, predict, or the sanity check) over its loaders.

    Args:
        trainer: the Trainer whose task, strategy, precision and results it uses.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        #: Batches evaluated per loader in this stage call: the step at which step values are logged.
        self.seen_batches: dict[int, int] = {}
        #: In predict, for prediction writers (Lightning's ``predict_loop`` attributes): the sample indices of
        #: the batch in progress, and of every batch so far (a list per loader); None where they are unknown.
        self.current_batch_indices: list[int] | None = None
        self.epoch_batch_indices: list[list[list[int]]] = []
        self._predictions: list[list[Any]] = []
        #: The loaders of the last run of each stage ("validate", "test", "predict"), as Lightning's Trainer
        #: shows them (``trainer.test_dataloaders``).
        self.loaders: dict[str, list[Any]] = {}

    def reset(self) -> None:
        """Start counting logged evaluation steps again (at the start of each stage)."""
        self.seen_batches.clear()

    @property
    def predictions(self) -> list[Any]:
        """The predictions of the predict run in progress: a list of batches, or one such list per loader."""
        return self._predictions[0] if len(self._predictions) == 1 else self._predictions

    def run(
        self, stage: str, loaders: Sequence[Any], num_batches: Sequence[int | float], keep_predictions: bool = True
    ) -> tuple[list[dict[str, float]], list[Any]]:
        """Run `stage` over `loaders` without gradients; return (epoch metrics per loader, predictions).

        Nothing runs, not even a hook, when there are no batches. Predictions are collected for the
        predict stage only, when `keep_predictions`: one list per loader, or one list of batches with a
        single loader.
        """
        trainer = self.trainer
        if not sum(num_batches):
            return [], []
        hooks = EVAL_STAGES[stage]
        task, dispatcher = trainer.task, trainer.dispatcher
        results, logging = trainer.eval_results, not trainer.sanity_checking and stage != "predict"
        step_fn = getattr(task, hooks.step)
        move = batch_mover(trainer)
        several = len(loaders) > 1
        predictions: list[list[Any]] = [[] for _ in loaders]
        self._predictions, self.epoch_batch_indices = predictions, [[] for _ in loaders]
        trainer.num_eval_batches = list(num_batches)
        modes = ModuleModes(task)
        task.eval()
        training_results, trainer.results = trainer.results, results
        results.reset()
        running = trainer.state.stage
        trainer.state.stage = "sanity_check" if trainer.sanity_checking else stage
        no_grad = torch.inference_mode if trainer.inference_mode else torch.no_grad
        try:
            dispatcher.fire(hooks.start)
            dispatcher.fire(hooks.epoch_start)
            with no_grad():
                for dataloader_idx, (loader, limit) in enumerate(zip(loaders, num_batches)):
                    extra = (dataloader_idx,) if several else ()
                    results.dataloader_idx = dataloader_idx if several else None
                    for batch_idx, batch in enumerate(epoch_batches(loader, limit)):
                        batch = move(batch, dataloader_idx)
                        results.new_batch(batch)
                        if stage == "predict":
                            self._note_batch_indices(loader, batch_idx, dataloader_idx)
                        dispatcher.fire(hooks.batch_start, batch, batch_idx, dataloader_idx)
                        results.hook = hooks.step
                        with trainer.precision.autocast():
                            outputs = step_fn(batch, batch_idx, *extra)
                        results.hook = ""
                        if stage == "predict" and keep_predictions:
                            # Lightning keeps them on the CPU, so a long predict run does not fill the GPU.
                            predictions[dataloader_idx].append(move_to_device(outputs, torch.device("cpu")))
                        dispatcher.fire(hooks.batch_end, outputs, batch, batch_idx, dataloader_idx)
                        if logging:
                            self._log_step(dataloader_idx)
            results.dataloader_idx = None
            # Resolved before the epoch-end hooks, so they see this run's values in callback_metrics, and
            # again after them, for what they logged; then the loggers, then the end hooks (checkpoints).
            results.epoch_end()
            dispatcher.fire(hooks.epoch_end)
            results.epoch_end()
            epoch_logs = results.pop_epoch_logs()
            if logging:
                trainer.log_metrics(epoch_logs)
            dispatcher.fire(hooks.end)
        finally:
            trainer.results = training_results
            trainer.state.stage = running
            modes.restore()
        metrics = _per_loader({name: float(value) for name, value in epoch_logs.items()}, len(loaders))
        return metrics, (predictions if several else predictions[0])

    def _note_batch_indices(self, loader: Any, batch_idx: int, dataloader_idx: int) -> None:
        """Record the sample indices of predict batch `batch_idx`, known when its loader records them."""
        recorder = getattr(loader, "batch_sampler", None)
        if isinstance(recorder, BatchIndexRecorder) and batch_idx < len(recorder.seen):
            self.current_batch_indices = recorder.seen[batch_idx]
            self.epoch_batch_indices[dataloader_idx].append(self.current_batch_indices)
        else:
            self.current_batch_indices = None

    def _log_step(self, dataloader_idx: int) -> None:
        """Send this batch's step values to the loggers, at the count of batches seen in this loader."""
        logs = self.trainer.eval_results.pop_step_logs()
        step = self.seen_batches.get(dataloader_idx, 0)
        self.seen_batches[dataloader_idx] = step + 1
        if logs:
            self.trainer.log_metrics(logs, step=step)


def _per_loader(values: dict[str, float], loaders: int) -> list[dict[str, float]]:
    """Split epoch values by their ``/dataloader_idx_N`` suffix: one dict per loader, as Lightning returns them.

    Values without a suffix (logged in epoch-end hooks) belong to every loader's dict.
    """
    if loaders == 1:
        return [values]
    shared = {name: value for name, value in values.items() if "/dataloader_idx_" not in name}
    return [
        {**shared, **{name: value for name, value in values.items() if name.endswith(f"/dataloader_idx_{i}")}}
        for i in range(loaders)
    ]
