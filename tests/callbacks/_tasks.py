"""Tiny tasks, data, a recording logger and a fake rank shared by the callback tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncline.callbacks.logger import Logger
from syncline.strategies.single_device import SingleDevice
from syncline.trainer import Task, Trainer


def make_loader(batches: int = 4, batch_size: int = 2, seed: int = 0) -> DataLoader:
    """Return a fixed regression DataLoader of `batches` batches."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch_size, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Scripted(Task):
    """A linear regressor whose monitored metrics follow a script, one value per epoch.

    Args:
        val_values: logged as ``val_metric`` in every validation of epoch i (values[i]).
        train_values: logged as ``train_metric`` (epoch aggregate) during training epoch i.
        lr: SGD learning rate.
        prog_bar: show ``train_loss`` and ``val_loss`` on the progress bar.
    """

    def __init__(
        self,
        val_values: Sequence[float] | None = None,
        train_values: Sequence[float] | None = None,
        lr: float = 0.05,
        prog_bar: bool = False,
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.val_values = val_values
        self.train_values = train_values
        self.lr = lr
        self.prog_bar = prog_bar
        self.losses: list[float] = []
        self.epochs_started: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=self.prog_bar)
        if self.train_values is not None:
            self.log("train_metric", float(self.train_values[self.trainer.current_epoch]), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), prog_bar=self.prog_bar)
        if self.val_values is not None:
            self.log("val_metric", float(self.val_values[self.trainer.current_epoch]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), prog_bar=self.prog_bar)

    def on_train_epoch_start(self) -> None:
        self.epochs_started.append(self.trainer.current_epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_trainer(root: Any, **kwargs: Any) -> Trainer:
    """Return a quiet Trainer writing under `root` (no logger, bar, sanity check or checkpoint unless asked)."""
    from syncline.callbacks import ModelCheckpoint

    callbacks = kwargs.get("callbacks") or []
    options: dict[str, Any] = {
        "default_root_dir": root,
        "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "max_epochs": 1,
    }
    options.update(kwargs)
    return Trainer(**options)


class RecordingLogger(Logger):
    """Keep every `log_metrics` call in memory."""

    def __init__(self, root: str = ".") -> None:
        self.root = root
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.hparams: dict[str, Any] = {}

    @property
    def log_dir(self) -> str:
        return self.root

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)

    def values(self, key: str) -> list[tuple[int, float]]:
        """Return (step, value) of every call that logged `key`."""
        return [(step, metrics[key]) for step, metrics in self.calls if key in metrics]


class FakeRank(SingleDevice):
    """One process posing as global rank `rank`: broadcasts return `broadcasts` in order (what rank 0 sent)."""

    def __init__(self, rank: int = 1, broadcasts: Sequence[Any] = ()) -> None:
        super().__init__("cpu")
        self._rank = rank
        self.broadcasts = list(broadcasts)
        self.sent: list[Any] = []

    @property
    def global_rank(self) -> int:
        return self._rank

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.sent.append(obj)
        return self.broadcasts.pop(0) if self.broadcasts else obj
