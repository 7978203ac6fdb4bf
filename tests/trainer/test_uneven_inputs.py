"""Ranks whose data run out at different batches: the same clear error on every rank within seconds."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from syncline.strategies import BucketedDDP, NativeDDP
from syncline.testing import run_distributed, run_ranks
from syncline.trainer import Trainer
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


class _PlainSGD(Regressor):
    """Plain SGD (torch's joined ranks take no step, so momentum would make its replicas differ), with
    batch-norm buffers (broadcast from the highest rank that has data) and a layer no step uses."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.unused = nn.Linear(3, 3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _fit_join(rank, world_size, per_rank, tmp, strategy="bucketed_ddp"):
    torch.manual_seed(0)
    task = _PlainSGD()
    data = loader(regression_data(per_rank[rank], seed=rank), 4)
    strategy = {"bucketed_ddp": BucketedDDP, "native_ddp": NativeDDP}[strategy](find_unused_parameters=True)
    trainer = Trainer(
        max_epochs=2,
        strategy=strategy,
        use_distributed_sampler=False,
        uneven_inputs="join",
        **quiet(default_root_dir=tmp),
    )
    trainer.fit(task, data)
    state = {k: v.clone() for k, v in task.state_dict().items()}
    return state, trainer.global_step, trainer.strategy.communication_stats()["comm/total_bytes"]


def _torch_join(rank, world_size, per_rank):
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    task = _PlainSGD()
    ddp = DistributedDataParallel(task, find_unused_parameters=True)
    optimizer = torch.optim.SGD(task.parameters(), lr=task.lr)
    for _ in range(2):
        with Join([ddp]):
            for x, y in loader(regression_data(per_rank[rank], seed=rank), 4):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                optimizer.step()
    return {k: v.clone() for k, v in task.state_dict().items()}


def test_join_equals_torch_ddp_join(tmp_path):
    per_rank = (24, 12)  # 6 and 3 batches per epoch
    reference = run_distributed(_torch_join, 2, args=(per_rank,), timeout=60)
    for strategy in ("bucketed_ddp", "native_ddp"):
        # Bit for bit what torch's Join gives: parameters, the last joiner's buffers, the unused layer.
        ours = run_distributed(_fit_join, 2, args=(per_rank, str(tmp_path / strategy), strategy), timeout=60)
        assert [steps for _, steps, _ in ours] == [12, 12], strategy
        # The joined rank takes part in every collective with the same tensors, and counts them alike.
        assert ours[0][2] == ours[1][2] > 0, strategy
        # Both replicas equal torch's Join run (whose joined rank takes the final model by broadcast).
        for rank in range(2):
            for name, value in reference[0].items():
                torch.testing.assert_close(ours[rank][0][name], value, rtol=0, atol=0, msg=strategy)
    # Not the run without the shorter rank's data: the shadowed steps averaged over both ranks.
    alone = run_distributed(_fit_join, 1, args=((24,), str(tmp_path / "alone")), timeout=60)
    assert not torch.allclose(alone[0][0]["net.0.weight"], ours[0][0]["net.0.weight"])


def test_join_needs_a_joinable_strategy():
    with pytest.raises(ValueError, match="uneven_inputs='join'.*'local_sgd' cannot shadow"):
        Trainer(strategy="local_sgd", uneven_inputs="join")
    with pytest.raises(ValueError, match="uneven_inputs='join'.*'bytegrad' cannot shadow"):
        Trainer(strategy="bytegrad", uneven_inputs="join")
    with pytest.raises(ValueError, match="static_graph=True.*uneven_inputs='join'"):
        Trainer(strategy=NativeDDP(static_graph=True), uneven_inputs="join")
