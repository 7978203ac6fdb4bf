"""Ranks whose data run out at different batches: the same clear error on every rank within seconds."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from syncline.trainer import Trainer
from tests.strategies._dist import run_distributed, run_ranks
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class _Stream(IterableDataset):
    """`count` samples of the regression data, of unknown length."""

    def __init__(self, count: int) -> None:
        self.data = regression_data(count)

    def __iter__(self):
        return iter(self.data)


def _fit(rank, world_size, strategy, per_rank, iterable, tmp):
    torch.manual_seed(0)
    count = per_rank[rank]
    data = DataLoader(_Stream(count), batch_size=4) if iterable else loader(regression_data(count), 4)
    trainer = Trainer(max_epochs=1, strategy=strategy, use_distributed_sampler=False, **quiet(default_root_dir=tmp))
    trainer.fit(Regressor(), data)
    return trainer.global_step


@pytest.mark.parametrize(("strategy", "iterable"), [("bucketed_ddp", False), ("native_ddp", True)])
def test_the_rank_that_runs_out_first_is_named_on_every_rank(tmp_path, strategy, iterable):
    start = time.monotonic()
    outcomes = run_ranks(_fit, 2, args=(strategy, (24, 16), iterable, str(tmp_path)), timeout=60)
    assert time.monotonic() - start < 30
    for outcome in outcomes:
        assert outcome.error is not None, f"rank {outcome.rank} did not fail"
        assert (
            "UnevenInputsError: Rank(s) 1 ran out of training data first, at batch 3 of epoch 0, while rank(s) 0 "
            "still have batches" in outcome.error
        ), outcome.error[-800:]


def test_equal_unsharded_data_trains(tmp_path):
    assert run_distributed(_fit, 2, args=("bucketed_ddp", (16, 16), True, str(tmp_path)), timeout=60) == [4, 4]
