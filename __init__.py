"""syncline: a PyTorch training framework whose data-parallel strategies are readable Python.

This file is the `syncline` package itself: pyproject.toml maps `syncline` to the repository root, so the
top-level folders install as `syncline.trainer`, `syncline.strategies`, `syncline.callbacks` and
`syncline.examples`, and nothing else lands at the top level of site-packages.
"""

from syncline.options import MisconfigurationException
from syncline.trainer import DataModule, Task, Trainer

#: Lightning's names, so that a Lightning program runs after ``import lightning as L`` becomes ``import syncline as L``.
LightningModule = Task
LightningDataModule = DataModule

__all__ = [
    "DataModule",
    "LightningDataModule",
    "LightningModule",
    "MisconfigurationException",
    "Task",
    "Trainer",
]
