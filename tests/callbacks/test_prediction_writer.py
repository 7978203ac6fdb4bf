"""BasePredictionWriter as Lightning's: per batch and per epoch, the samples' indices, every rank its own part;
and `trainer.predict(return_predictions=False)`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from syncline.callbacks import BasePredictionWriter
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, regression_data

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}


class Recorder(BasePredictionWriter):
    """Keeps what it is asked to write."""

    def __init__(self, write_interval: str = "batch") -> None:
        super().__init__(write_interval)
        self.batches: list[tuple[list[int] | None, torch.Tensor, int, int]] = []
        self.epochs: list[tuple[list, list]] = []

    def write_on_batch_end(self, trainer, task, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((batch_indices, prediction, batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, task, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


class Predictor(Regressor):
    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])


def _model_and_data(n: int = 20):
    torch.manual_seed(0)
    return Predictor(), regression_data(n)


def test_batch_writer_gets_each_batch_with_its_samples_indices_in_a_shuffled_loader():
    task, data = _model_and_data()
    writer = Recorder("batch")
    shuffled = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    Trainer(**QUIET, callbacks=[writer]).predict(task, shuffled)
    assert [(batch_idx, loader_idx) for _, _, batch_idx, loader_idx in writer.batches] == [(0, 0), (1, 0), (2, 0)]
    indices = [index for batch_indices, _, _, _ in writer.batches for index in batch_indices]
    assert sorted(indices) == list(range(20)) and indices != list(range(20))
    x = data.tensors[0]
    with torch.no_grad():
        for batch_indices, prediction, _, _ in writer.batches:
            # the indices are those samples (the writer gets the step's output where it was computed, as Lightning's)
            torch.testing.assert_close(prediction.cpu(), task(x[batch_indices]))
    assert writer.epochs == []


def test_epoch_writer_gets_all_predictions_and_the_indices_per_loader():
    task, data = _model_and_data()
    writer = Recorder("epoch")
    trainer = Trainer(**QUIET, callbacks=[writer])
    returned = trainer.predict(task, [loader(data, 8), loader(data, 16)])
    ((predictions, batch_indices),) = writer.epochs
    # Lightning's shapes: a list of batches per loader, and per loader a list of each batch's indices.
    assert [len(p) for p in predictions] == [3, 2]
    assert batch_indices == [
        [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))],
        [list(range(16)), [16, 17, 18, 19]],
    ]
    assert all(torch.equal(a, b) for a, b in zip(returned[0], predictions[0]))
    assert writer.batches == []


def test_batch_and_epoch_writes_both_and_one_loader_is_not_nested():
    task, data = _model_and_data()
    writer = Recorder("batch_and_epoch")
    Trainer(**QUIET, callbacks=[writer]).predict(task, loader(data, 8))
    assert len(writer.batches) == 3
    ((predictions, batch_indices),) = writer.epochs
    assert len(predictions) == 3 and isinstance(predictions[0], torch.Tensor)
    assert batch_indices == [[list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]]


def test_return_predictions_false_returns_none_and_epoch_writers_still_get_them():
    task, data = _model_and_data()
    writer = Recorder("epoch")
    # Lightning's positional order: (model, dataloaders, datamodule, return_predictions, ckpt_path).
    assert Trainer(**QUIET, callbacks=[writer]).predict(task, loader(data, 8), None, False) is None
    assert len(writer.epochs[0][0]) == 3
    # Without a writer at the epoch's end nothing is kept; the default returns them.
    trainer = Trainer(**QUIET, callbacks=[Recorder("batch")])
    assert trainer.predict(task, loader(data, 8), return_predictions=False) is None
    assert trainer.evaluation.predictions == []
    assert len(Trainer(**QUIET).predict(task, loader(data, 8))) == 3


def test_unknown_write_interval_is_named():
    with pytest.raises(ValueError, match=r"write_interval='step'\): use one of batch, epoch, batch_and_epoch"):
        Recorder("step")


class RankFiles(BasePredictionWriter):
    """Each rank saves its part: its predictions and their indices, in a file named by its rank."""

    def __init__(self, directory: str) -> None:
        super().__init__("epoch")
        self.directory = directory

    def write_on_epoch_end(self, trainer, task, predictions, batch_indices):
        indices = [index for batch in batch_indices[0] for index in batch]
        torch.save((torch.cat(predictions), indices), Path(self.directory, f"predictions_{trainer.global_rank}.pt"))


def _predict_on_rank(rank, world_size, directory):
    task, data = _model_and_data(21)
    trainer = Trainer(**QUIET, strategy="bucketed_ddp", callbacks=[RankFiles(directory)])
    return trainer.predict(task, loader(data, 4), return_predictions=False)


def test_two_ranks_each_write_their_part_and_together_the_whole_data_set(tmp_path):
    assert run_distributed(_predict_on_rank, world_size=2, args=(str(tmp_path),), timeout=120) == [None, None]
    parts = [torch.load(tmp_path / f"predictions_{rank}.pt") for rank in range(2)]
    assert parts[0][1] == list(range(0, 21, 2)) and parts[1][1] == list(range(1, 21, 2))  # no sample twice
    task, data = _model_and_data(21)
    with torch.no_grad():
        for predictions, indices in parts:
            torch.testing.assert_close(predictions, task(data.tensors[0][indices]))
