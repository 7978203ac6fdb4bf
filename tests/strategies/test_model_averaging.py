"""The averaging family through the Trainer: it learns, under accumulation, clipping and bf16-mixed.

Each strategy trains the shared regressor on 2 real processes beside `bucketed_ddp` with the same options;
its validation loss must be within 25% of bucketed_ddp's at equal steps, and its byte counters must show
exactly the collectives the algorithm prescribes (none inside an accumulation window).
"""

from __future__ import annotations

import time

import pytest
import torch
from _averaging import fit, model_bytes

from syncline.strategies import AsyncModelAverage, BucketedDDP, Decentralized, LocalSGD
from syncline.testing import run_distributed
from tests.trainer._tasks import Regressor, regression_data

STEPS = 24
OPTIONS = {"accumulate_grad_batches": 2, "gradient_clip_val": 2.0, "precision": "bf16-mixed", "max_epochs": 100}

# name -> (strategy factory, total bytes over STEPS optimizer steps in units of the model's bytes)
FAMILY = {
    # Warm-up: 2 gradient all-reduces; then averagings after local steps 4, 8, ..., 20 (5 of them).
    "local_sgd": (lambda: LocalSGD(period=4, warmup_steps=2), 2 + 5),
    # Two ranks: shift_one always pairs them; one exchange every 2 steps.
    "decentralized": (lambda: Decentralized(peers="shift_one", period=2), 12),
    "decentralized_uint8": (lambda: Decentralized(peers="all", compression="uint8"), None),
    "async_model_average": (lambda: AsyncModelAverage(interval_ms=1, warmup_steps=4), None),
}


class SlowRegressor(Regressor):
    """The regressor with a forward of a few milliseconds, as real models have: the averaging thread of
    `async_model_average` gets rounds in while the main thread computes (on a microsecond forward it
    would average only a few times in the whole run)."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.004)
        return super().training_step(batch, batch_idx)


def full_data_loss(task) -> float:
    """Mean squared error of this rank's model on the whole data set (replicas may differ)."""
    x, y = regression_data(64).tensors
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(task(x), y))


def _learn(rank, world_size, name):
    factory, _ = FAMILY[name]
    task_class = SlowRegressor if name == "async_model_average" else Regressor
    reference, reference_task = fit(BucketedDDP(), max_steps=STEPS, **OPTIONS)
    trainer, task = fit(factory(), task_class, max_steps=STEPS, **OPTIONS)
    strategy = trainer.strategy
    return {
        "loss": full_data_loss(task),
        "reference": full_data_loss(reference_task),
        "total": strategy.communication_stats()["comm/total_bytes"],
        "model": model_bytes(task),
        "rounds": getattr(strategy, "rounds", None),
        "thread": getattr(strategy, "_thread", None) is not None,
    }


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_learns_like_bucketed_ddp_and_communicates_as_its_algorithm_says(name):
    ranks = run_distributed(_learn, world_size=2, args=(name,), timeout=120)
    _, units = FAMILY[name]
    # The loss of the replicas (which may differ) is their mean loss on the whole data set.
    loss = sum(r["loss"] for r in ranks) / len(ranks)
    assert loss <= 1.25 * ranks[0]["reference"], ranks
    for result in ranks:
        assert result["total"] > 0
        if units is not None:
            assert result["total"] == units * result["model"]
    if name == "decentralized_uint8":
        # One all-gather of uint8 differences per step: about a quarter of the fp32 model, plus headers.
        assert ranks[0]["total"] < 0.27 * STEPS * ranks[0]["model"]
    if name == "async_model_average":
        # The thread averaged, every rank's thread left after the same round, and none is left running.
        assert ranks[0]["rounds"] > 0
        assert ranks[0]["rounds"] == ranks[1]["rounds"]
        assert ranks[0]["total"] == ranks[1]["total"]
        assert not ranks[0]["thread"] and not ranks[1]["thread"]
