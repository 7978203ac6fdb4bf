"""Joining the process group: a world of one without a launcher; the environment's group otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from syncline.strategies import BucketedDDP, NativeDDP
from syncline.strategies.comm.process_group import init_process_group_from_env
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data
from tests.trainer.test_cli import SMALL, _cli

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _fit(strategy) -> Regressor:
    torch.manual_seed(0)
    task = Regressor(dropout=0.2)
    Trainer(max_epochs=2, strategy=strategy, seed=3, **quiet()).fit(task, loader(regression_data(32), shuffle=True))
    return task


@pytest.mark.parametrize("strategy", [BucketedDDP, NativeDDP])
def test_one_device_with_a_distributed_strategy_runs_in_process(monkeypatch, strategy):
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    reference = _fit("single")
    task = _fit(strategy())
    assert dist.is_initialized() and dist.get_world_size() == 1
    for name, value in reference.state_dict().items():
        assert torch.equal(task.state_dict()[name], value), name


def test_some_launcher_variables_but_not_all_is_the_clear_error(monkeypatch):
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        init_process_group_from_env()


def test_cli_one_device_with_bucketed_ddp(tmp_path):
    result = _cli(
        f"hydra.run.dir={tmp_path / 'run'}", "strategy=bucketed_ddp", "trainer.max_steps=3", *SMALL, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sample after 3 steps" in result.stdout
