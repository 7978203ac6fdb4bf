"""EquivalenceCheck: the first steps of a distributed run against one process on the global batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.callbacks import EquivalenceCheck, EquivalenceError
from syncline.testing import run_ranks
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class Normalized(Regressor):
    """BatchNorm computes its statistics per rank: not equal to one process on the global batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def _fit(rank: int, world_size: int, strategy: str, task_name: str, strict: bool, accumulate: int) -> tuple:
    torch.manual_seed(rank)  # replicas start apart: the strategy's broadcast at setup must align them
    task = {"plain": Regressor, "batchnorm": Normalized}[task_name]()
    check = EquivalenceCheck(steps=3, strict=strict)
    trainer = Trainer(max_epochs=1, strategy=strategy, accumulate_grad_batches=accumulate, **quiet(callbacks=[check]))
    trainer.fit(task, loader(regression_data(64), batch_size=4, shuffle=True))
    return check.max_abs_diff, check.worst_parameter, float(trainer.callback_metrics["equivalence/max_abs_diff"])


@pytest.mark.parametrize(("strategy", "accumulate"), [("bucketed_ddp", 1), ("bucketed_ddp", 2), ("native_ddp", 1)])
def test_an_exact_strategy_is_reported_equal(strategy, accumulate):
    outcomes = run_ranks(_fit, world_size=2, args=(strategy, "plain", True, accumulate), timeout=120)
    assert [o.error for o in outcomes] == [None, None], outcomes
    for outcome in outcomes:
        diff, name, logged = outcome.value
        assert diff == logged and diff <= 1e-6, (diff, name)


def test_per_rank_batchnorm_is_reported_different_and_strict_fails_every_rank():
    outcomes = run_ranks(_fit, world_size=2, args=("bucketed_ddp", "batchnorm", False, 1), timeout=120)
    assert [o.error for o in outcomes] == [None, None], outcomes
    diffs = {o.value[0] for o in outcomes}
    assert len(diffs) == 1 and diffs.pop() > 1e-4
    strict = run_ranks(_fit, world_size=2, args=("bucketed_ddp", "batchnorm", True, 1), timeout=120)
    assert all(o.error is not None and EquivalenceError.__name__ in o.error for o in strict), strict


def test_one_process_is_trivially_equal(tmp_path):
    check = EquivalenceCheck(steps=2)
    torch.manual_seed(0)
    Trainer(max_epochs=1, **quiet(callbacks=[check], default_root_dir=tmp_path)).fit(
        Regressor(dropout=0.0), loader(regression_data(16), batch_size=4, shuffle=True)
    )
    assert check.max_abs_diff == 0.0


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        EquivalenceCheck(steps=0)
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        EquivalenceCheck(tolerance=-1.0)
