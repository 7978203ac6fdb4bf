"""Distributed evaluation sees every sample exactly once: validate on 1, 2 and 3 ranks gives the same metrics."""

from __future__ import annotations

import pytest
import torch
from torchmetrics import MeanSquaredError

from syncline.testing import run_distributed
from syncline.trainer import Trainer
from syncline.trainer.data import UnpaddedShardSampler
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

#: A prime number of samples: it divides by neither 2 nor 3, so DistributedSampler would pad.
SIZE = 101


class Evaluated(Regressor):
    """Logs the mean loss with sync_dist, a torchmetrics metric, and how many samples it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = MeanSquaredError()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        prediction = self(x)
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, y), sync_dist=True)
        self.mse(prediction, y)
        self.log("val_mse", self.mse)
        self.log("samples", float(len(x)), reduce_fx="sum", sync_dist=True)


def _validate(rank: int, world_size: int, strategy: str) -> dict[str, float]:
    torch.manual_seed(0)
    task = Evaluated()
    trainer = Trainer(strategy=strategy, **quiet())
    (metrics,) = trainer.validate(task, loader(regression_data(SIZE), batch_size=8))
    return metrics


def _one_process() -> dict[str, float]:
    torch.manual_seed(0)
    (metrics,) = Trainer(**quiet()).validate(Evaluated(), loader(regression_data(SIZE), batch_size=8))
    return metrics


@pytest.mark.parametrize(("world_size", "strategy"), [(2, "bucketed_ddp"), (3, "bucketed_ddp"), (2, "native_ddp")])
def test_validate_on_several_ranks_equals_one_process_on_a_prime_sized_set(world_size, strategy):
    reference = _one_process()
    assert reference["samples"] == SIZE
    for metrics in run_distributed(_validate, world_size=world_size, args=(strategy,), timeout=120):
        assert metrics["samples"] == SIZE  # no sample counted twice (DistributedSampler: 102 on 2 ranks)
        for name in ("val_loss", "val_mse"):
            # float32 sums in another order: equal to 1e-6 relative (the padded sampler is 1e-2 off)
            assert metrics[name] == pytest.approx(reference[name], rel=1e-6), name


def test_unpadded_shards_cover_every_index_once():
    for replicas in (1, 2, 3, 7):
        shards = [list(UnpaddedShardSampler(SIZE, replicas, rank)) for rank in range(replicas)]
        assert sorted(i for shard in shards for i in shard) == list(range(SIZE))
        assert [len(UnpaddedShardSampler(SIZE, replicas, r)) for r in range(replicas)] == list(map(len, shards))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
