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


def fit(
    strategy, task_class: type = Regressor, max_steps: int = 16, ckpt_path=None, **trainer_kwargs
) -> tuple[Trainer, nn.Module]:
    """Fit a fresh `task_class` (seeded: the same start every time) on 64 samples, batch 4 per rank."""
    torch.manual_seed(0)
    task = task_class(lr=0.05)
    data = regression_data(64)
    kwargs = {**quiet(), "max_steps": max_steps, "num_sanity_val_steps": 0, **trainer_kwargs}
    trainer = Trainer(strategy=strategy, **kwargs)
    trainer.fit(task, loader(data, 4), loader(data, 16), ckpt_path=ckpt_path)
    return trainer, task


def flat_params(task: nn.Module) -> torch.Tensor:
    """Every parameter, flat, as a CPU copy."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in task.parameters()])


def model_bytes(task: nn.Module) -> int:
    """Bytes of one copy of the trainable parameters (what one averaging all-reduces)."""
    return sum(p.numel() * p.element_size() for p in task.parameters() if p.requires_grad)


def straight_and_resumed(rank: int, world_size: int, tmp: str, make_strategy, stop: int, steps: int) -> dict:
    """Train `steps` steps straight, and again stopped after `stop` and resumed from its checkpoint.

    Momentum SGD and shuffled data: each rank's optimizer state and data stream matter. Returns each
    run's final weights and strategy state, and the replicas' weights at the checkpoint.
    """
    data = regression_data(64)
    runs = {}
    for mode in ("straight", "resumed"):
        root = f"{tmp}/{mode}"
        torch.manual_seed(0)
        task = Regressor(lr=0.05)
        kwargs = {**quiet(default_root_dir=root, seed=0), "num_sanity_val_steps": 0}
        if mode == "resumed":
            first = Trainer(max_steps=stop, strategy=make_strategy(), **kwargs)
            first.fit(task, loader(data, 4, shuffle=True))
            first.save_checkpoint(f"{root}/mid.ckpt")
            at_checkpoint = flat_params(task)
            torch.manual_seed(1)
            task = Regressor(lr=0.05)  # other weights: only the checkpoint can make the result equal
        trainer = Trainer(max_steps=steps, strategy=make_strategy(), **kwargs)
        trainer.fit(task, loader(data, 4, shuffle=True), ckpt_path=f"{root}/mid.ckpt" if mode == "resumed" else None)
        runs[mode] = {"weights": flat_params(task), "state": trainer.strategy.state_dict()}
    runs["at_checkpoint"] = at_checkpoint
    return runs
