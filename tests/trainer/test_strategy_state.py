"""Every rank's part of a strategy's state (and its own replica, where replicas differ) survives a checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from syncline.checkpoint_file import CheckpointError
from syncline.strategies import BucketedDDP
from syncline.testing import run_distributed, run_ranks
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class Drifting(BucketedDDP):
    """Exact gradients, then a rank-dependent nudge after every step: replicas differ, like local SGD's.

    Its per-rank state is a step counter and a tensor that depends on the rank and the steps taken.
    """

    name = "bucketed_ddp"  # a test double: keep the registered name's configs out of it
    replicas_differ = True

    def setup(self, task: Any) -> None:
        super().setup(task)
        self.task, self.steps, self.memory = task, 0, torch.zeros(3)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        super().optimizer_step(optimizer, step)
        self.steps += 1
        self.memory = self.memory * 0.5 + self.global_rank + self.steps
        with torch.no_grad():
            for param in self.task.parameters():
                param.add_(1e-3 * (self.global_rank + 1) * self.memory.sum())

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "memory": self.memory.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.memory = state["steps"], state["memory"].clone()


def _train(rank: int, world_size: int, tmp: str, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    task = Regressor()
    data = loader(regression_data(64), batch_size=4, shuffle=True)
    if mode == "straight":
        Trainer(max_steps=6, strategy=Drifting(), **quiet(default_root_dir=tmp, seed=0)).fit(task, data)
    else:
        first = Trainer(max_steps=3, strategy=Drifting(), **quiet(default_root_dir=tmp, seed=0))
        first.fit(task, data)
        first.save_checkpoint(f"{tmp}/mid.ckpt")
        torch.manual_seed(1)
        task = Regressor()  # other initial weights: only the checkpoint can make the result equal
        second = Trainer(max_steps=6, strategy=Drifting(), **quiet(default_root_dir=tmp, seed=0))
        second.fit(task, loader(regression_data(64), batch_size=4, shuffle=True), ckpt_path=f"{tmp}/mid.ckpt")
    strategy_state = task.trainer.strategy.state_dict()
    return {"weights": {k: v.clone() for k, v in task.state_dict().items()}, "strategy": strategy_state}


def test_replicas_that_differ_resume_bit_exactly_each_from_its_own_state(tmp_path):
    straight = run_distributed(_train, world_size=2, args=(str(tmp_path / "a"), "straight"), timeout=120)
    resumed = run_distributed(_train, world_size=2, args=(str(tmp_path / "b"), "resumed"), timeout=120)
    # The replicas really differ, so rank 0's weights alone could not have restored rank 1.
    assert not torch.equal(straight[0]["weights"]["net.0.weight"], straight[1]["weights"]["net.0.weight"])
    for rank in (0, 1):
        assert resumed[rank]["strategy"]["steps"] == straight[rank]["strategy"]["steps"] == 6
        assert torch.equal(resumed[rank]["strategy"]["memory"], straight[rank]["strategy"]["memory"])
        for name, value in straight[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], value), (rank, name)
    checkpoint = torch.load(tmp_path / "b" / "mid.ckpt", weights_only=True)
    assert [s["steps"] for s in checkpoint["strategy"]["by_rank"]] == [3, 3]
    assert len(checkpoint["replicas_by_rank"]) == 2


def _resume_alone(rank: int, world_size: int, path: str) -> None:
    Trainer(max_steps=6, strategy=Drifting(), **quiet()).fit(
        Regressor(), loader(regression_data(64), batch_size=4), ckpt_path=path
    )


def test_per_rank_state_on_another_world_size_is_a_clear_error(tmp_path):
    run_distributed(_train, world_size=2, args=(str(tmp_path), "resumed"), timeout=120)
    outcomes = run_ranks(_resume_alone, world_size=1, args=(str(tmp_path / "mid.ckpt"),), timeout=120)
    assert outcomes[0].error is not None
    assert CheckpointError.__name__ in outcomes[0].error
    assert "Drifting keeps per-rank state, which cannot move from 2 to 1 processes" in outcomes[0].error


def test_a_strategy_without_state_checkpoints_empty_parts(tmp_path):
    trainer = Trainer(max_steps=2, **quiet(default_root_dir=tmp_path))
    trainer.fit(Regressor(), loader(regression_data(16), batch_size=4))
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    checkpoint = torch.load(tmp_path / "x.ckpt", weights_only=True)
    assert checkpoint["strategy"] == {"name": "single", "by_rank": [{}]}
    assert "replicas_by_rank" not in checkpoint


@pytest.mark.parametrize("saved_name", ["powersgd"])
def test_state_of_another_strategy_is_refused(tmp_path, saved_name):
    trainer = Trainer(max_steps=2, **quiet(default_root_dir=tmp_path))
    trainer.fit(Regressor(), loader(regression_data(16), batch_size=4))
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    checkpoint = torch.load(tmp_path / "x.ckpt", weights_only=True)
    checkpoint["strategy"] = {"name": saved_name, "by_rank": [{"memory": torch.zeros(1)}]}
    torch.save(checkpoint, tmp_path / "y.ckpt")
    with pytest.raises(CheckpointError, match="per-rank state of strategy 'powersgd', not of 'single'"):
        Trainer(max_steps=4, **quiet(default_root_dir=tmp_path)).fit(
            Regressor(), loader(regression_data(16), batch_size=4), ckpt_path=tmp_path / "y.ckpt"
        )
