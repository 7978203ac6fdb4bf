"""Small tasks and data shared by the trainer tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncline.trainer import Task


def reference_device() -> torch.device:
    """Where ``accelerator="auto"`` trains one process: a hand-written reference runs there too, so a comparison
    with tolerance 0 compares the same kernels (the CPU's and a GPU's float results differ in the last bits).

    A function, not a constant: a module-level CUDA query would run in every rank `run_distributed` starts
    (unpickling a test's function imports its module), before the rank hides the GPUs it does not get.
    """
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def regression_data(n: int = 64, features: int = 8, seed: int = 0) -> TensorDataset:
    """Return a fixed random regression data set."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


class Regressor(Task):
    """An MLP with dropout, so that results depend on the random stream as well as the data order."""

    def __init__(self, features: int = 8, dropout: float = 0.0, lr: float = 0.1, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))
        self.lr = lr
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loader(dataset: TensorDataset, batch_size: int = 8, shuffle: bool = False) -> DataLoader:
    """Return a DataLoader over `dataset`."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def quiet(**kwargs):
    """Trainer arguments with no files and no output, for tests that check only the math."""
    return {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
