"""DataModule behaviour from Lightning 2.x's core/datamodule.py and tests/tests_pytorch/core/test_datamodules.py."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from syncline import Trainer
from syncline.trainer import DataModule
from tests.trainer._tasks import Regressor, quiet, regression_data


class Splits(DataModule):
    def setup(self, stage):
        if stage == "fit":
            self.train, self.val = regression_data(64), regression_data(16)
        if stage == "predict":
            self.pred = regression_data(8)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=8)

    def val_dataloader(self):
        return [DataLoader(self.val, batch_size=8), DataLoader(self.val, batch_size=4)]

    def predict_dataloader(self):
        return DataLoader(self.pred, batch_size=8)


def test_str_names_each_loaders_dataset_size_as_lightning():
    data = Splits()
    assert str(data) == os.linesep.join(
        [
            "{Train dataloader: None}",
            "{Validation dataloader: None}",
            "{Test dataloader: None}",
            "{Predict dataloader: None}",
        ]
    )
    data.setup(stage="fit")
    assert str(data).split(os.linesep)[:2] == [
        "{Train dataloader: size=64}",
        "{Validation dataloader: 1. size=16 ; 2. size=16}",
    ]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(regression_data(6))


class Sized(DataModule):
    def __init__(self, batch_size: int = 1, extra: str = "") -> None:
        super().__init__()
        self.batch_size, self.extra = batch_size, extra


def test_from_datasets_builds_lightnings_loaders():
    data = Sized.from_datasets(
        regression_data(8), val_dataset=[regression_data(4), Stream()], batch_size=2, extra="kept"
    )
    assert (data.batch_size, data.extra) == (2, "kept")  # batch_size reaches a constructor that takes it
    train = data.train_dataloader()
    assert train.batch_size == 2 and isinstance(train.sampler, RandomSampler)
    val = data.val_dataloader()
    assert isinstance(val, list) and isinstance(val[0].sampler, SequentialSampler)
    assert isinstance(val[1].dataset, Stream)  # an IterableDataset is not shuffled
    assert data.test_dataloader() is None


def test_setup_and_teardown_get_the_stage_by_keyword():
    seen = []

    class KeywordOnly(Splits):
        def setup(self, *, stage):
            seen.append(("setup", stage))
            super().setup(stage)

        def teardown(self, *, stage):
            seen.append(("teardown", stage))

    Trainer(**quiet(max_epochs=1, limit_val_batches=0)).fit(Regressor(), datamodule=KeywordOnly())
    assert seen == [("setup", "fit"), ("teardown", "fit")]


def test_predicting_from_an_iterable_dataset():
    task = Regressor()
    predictions = Trainer(**quiet()).predict(task, DataLoader(Stream(), batch_size=4))
    expected = task(regression_data(6).tensors[0])
    torch.testing.assert_close(torch.cat(predictions), expected)
