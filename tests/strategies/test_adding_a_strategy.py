"""docs/strategies.md's worked example, "Adding a strategy", run as it stands on the page.

The page's algorithm file (signSGD with majority vote on the core) is written to a module, registered
by its name, and trained on two ranks through the Trainer; its gradients after the warm-up are the sign
of the ranks' vote, computed here by hand, and it hands one byte per value to the collective.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from torch import nn

from syncline.strategies.registry import STRATEGIES, register_strategy, resolve_strategy
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from syncline.trainer.config import strategy_config
from tests.trainer._tasks import loader, quiet, regression_data

PAGE = Path(__file__).resolve().parents[2] / "docs" / "strategies.md"
WARMUP = 2
STEPS = 5


def _example_source() -> str:
    """The first Python block under the page's "Adding a strategy" heading: the algorithm file."""
    section = PAGE.read_text().split("### Adding a strategy", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def _load(path: str):
    """Import the example from `path` and register its strategy, as the registry line does."""
    spec = importlib.util.spec_from_file_location("sign_sgd", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sign_sgd"] = module
    spec.loader.exec_module(module)
    register_strategy(module.SignSGD)
    return module


class _Task(nn.Module):
    """A task-shaped module for the hand-written loop: one linear layer, a loss of the rank's batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)


def _by_hand(rank: int, world_size: int, path: str) -> dict:
    module = _load(path)
    strategy = resolve_strategy("sign_sgd", warmup_steps=WARMUP)
    assert isinstance(strategy, module.SignSGD)
    strategy.setup_environment()
    model = _Task()
    strategy.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, sent = [], []
    for step in range(STEPS):
        strategy.backward(strategy.training_step(model, _batch(step, rank), step), sync=True)
        grads.append([p.grad.clone() for p in model.parameters()])
        strategy.optimizer_step(optimizer, optimizer.step)
        sent.append(strategy.communication_stats()["comm/bytes"])
        strategy.zero_grad(optimizer)
    # Through the Trainer, by its registered name: it learns, and its stage is in the checkpointed state.
    torch.manual_seed(0)
    from tests.trainer._tasks import Regressor

    trainer = Trainer(max_steps=6, strategy="sign_sgd", **quiet(seed=0))
    task = Regressor(lr=0.01)
    trainer.fit(task, loader(regression_data(64), 4, shuffle=True))
    return {
        "grads": grads,
        "sent": sent,
        "state": trainer.strategy.state_dict(),
        "name": type(trainer.strategy).__name__,
    }


def test_the_documented_example_trains_votes_and_counts_its_bytes(tmp_path):
    path = tmp_path / "sign_sgd.py"
    path.write_text(_example_source())
    ranks = run_distributed(_by_hand, 2, args=(str(path),), timeout=120)
    reference = _Task()
    numel = sum(p.numel() for p in reference.parameters())
    for step in range(STEPS):
        local = []
        for rank in range(2):
            reference.zero_grad()
            reference.training_step(_batch(step, rank), step).backward()
            local.append([p.grad.clone() for p in reference.parameters()])
        if step < WARMUP:
            expected = [(a + b) / 2 for a, b in zip(*local)]
        else:
            expected = [(a.sign() + b.sign()).sign() for a, b in zip(*local)]
        for result in ranks:
            for got, want in zip(result["grads"][step], expected):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        # Keep the reference on the replicas' path: the update every rank took.
        with torch.no_grad():
            for param, grad in zip(reference.parameters(), ranks[0]["grads"][step]):
                param.sub_(0.1 * grad)
    assert ranks[0]["sent"] == [4 * numel] * WARMUP + [numel] * (STEPS - WARMUP)
    assert ranks[0]["name"] == "SignSGD" and ranks[0]["state"] == {"steps": 6}
    assert "sign_sgd" not in STRATEGIES  # registered in the worker processes only


def test_the_documented_example_needs_no_config_step(tmp_path):
    """Its Hydra config comes from the constructor: typed options, their defaults and docstring help."""
    path = tmp_path / "sign_sgd.py"
    path.write_text(_example_source())
    spec = importlib.util.spec_from_file_location("sign_sgd_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sign_sgd_config"] = module
    try:
        spec.loader.exec_module(module)
        conf = OmegaConf.structured(strategy_config(module.SignSGD))
    finally:
        del sys.modules["sign_sgd_config"]
    assert OmegaConf.to_container(conf) == {
        "_target_": "sign_sgd_config.SignSGD",
        "warmup_steps": 10,
        "bucket_cap_mb": 25.0,
        "backend": None,
        "timeout": 300.0,
    }
    with pytest.raises(ValidationError, match="warmup_steps"):
        conf.warmup_steps = "ten"
    fields = {field.name: field for field in dataclasses.fields(strategy_config(module.SignSGD))}
    assert fields["warmup_steps"].metadata["help"] == "optimizer steps of exact all-reduce before the votes."
