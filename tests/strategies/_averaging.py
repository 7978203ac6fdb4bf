"""What the tests of the model-averaging strategies share: a small task, a fit on every rank, its results."""

from __future__ import annotations

import torch
from torch import nn

from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class PlainSGD(Regressor):
    """The shared regressor with plain SGD (no momentum), so local SGD with period 1 is data parallel."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(strategy, task_class: type = Regressor, max_steps: int = 16, **trainer_kwargs) -> tuple[Trainer, nn.Module]:
    """Fit a fresh `task_class` (seeded: the same start every time) on 64 samples, batch 4 per rank."""
    torch.manual_seed(0)
    task = task_class(lr=0.05)
    data = regression_data(64)
    kwargs = {**quiet(), "max_steps": max_steps, "num_sanity_val_steps": 0, **trainer_kwargs}
    trainer = Trainer(strategy=strategy, **kwargs)
    trainer.fit(task, loader(data, 4), loader(data, 16))
    return trainer, task


def flat_params(task: nn.Module) -> torch.Tensor:
    """Every parameter, flat, as a CPU copy."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in task.parameters()])


def model_bytes(task: nn.Module) -> int:
    """Bytes of one copy of the trainable parameters (what one averaging all-reduces)."""
    return sum(p.numel() * p.element_size() for p in task.parameters() if p.requires_grad)
