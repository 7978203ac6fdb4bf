"""`BasePredictionWriter`: write `predict`'s outputs as they come, on every rank, as Lightning's callback does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from syncline.callbacks.callback import Callback

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["WRITE_INTERVALS", "BasePredictionWriter"]

#: When a writer writes: after every batch, once at the end of the predict epoch, or both.
WRITE_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Subclass it and override `write_on_batch_end` and/or `write_on_epoch_end` to save predictions.

    Every rank calls its own writer with its own part of the data (the one place where every rank writes
    files): with several processes, rank r predicts samples r, r + W, r + 2W... of each loader, and the
    `batch_indices` say which, so the parts together are the whole data set, each sample once. Name the
    files by `trainer.global_rank`. The indices are known for DataLoaders with a batch size (or a batch
    sampler); other loaders give None.

    Args:
        write_interval: "batch", "epoch" or "batch_and_epoch".
    """

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in WRITE_INTERVALS:
            raise ValueError(
                f"BasePredictionWriter(write_interval={write_interval!r}): use one of {', '.join(WRITE_INTERVALS)}."
            )
        self.interval = write_interval

    @property
    def on_batch(self) -> bool:
        """Whether this writer writes after every batch."""
        return self.interval in ("batch", "batch_and_epoch")

    @property
    def on_epoch(self) -> bool:
        """Whether this writer writes at the end of the predict epoch."""
        return self.interval in ("epoch", "batch_and_epoch")

    def write_on_batch_end(
        self,
        trainer: Trainer,
        task: Task,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's `prediction`; `batch_indices` are its samples' indices in the data set."""
        raise NotImplementedError(f"{type(self).__name__} writes per batch: override write_on_batch_end.")

    def write_on_epoch_end(
        self, trainer: Trainer, task: Task, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        """Write this rank's `predictions` (a list of batches; a list of those per loader with several) and
        `batch_indices` (one list per loader, of one list of sample indices per batch), as Lightning passes them."""
        raise NotImplementedError(f"{type(self).__name__} writes per epoch: override write_on_epoch_end.")

    def on_predict_batch_end(
        self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Hand the batch's prediction to `write_on_batch_end` (with "batch" and "batch_and_epoch")."""
        if self.on_batch:
            indices = trainer.evaluation.current_batch_indices
            self.write_on_batch_end(trainer, task, outputs, indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Hand every prediction of this rank to `write_on_epoch_end` (with "epoch" and "batch_and_epoch")."""
        if self.on_epoch:
            evaluation = trainer.evaluation
            self.write_on_epoch_end(trainer, task, evaluation.predictions, evaluation.epoch_batch_indices)
