"""`DataHooks`: the data methods a `Task` and a `DataModule` share, as Lightning's ``core/hooks.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = ["DataHooks"]


class DataHooks:
    """`prepare_data`, `setup`, `teardown` and the DataLoader of every stage; override those you need."""

    def prepare_data(self) -> None:
        """Download or write data to disk; called on local rank 0 of each node before `setup`, while the
        other processes wait, so assign no state here."""

    def setup(self, stage: str) -> None:
        """Build what `stage` ("fit", "validate", "test" or "predict") needs, on every process."""

    def teardown(self, stage: str) -> None:
        """Release what `setup` built."""

    def train_dataloader(self) -> DataLoader:
        """Return the training DataLoader, unless one is passed to `Trainer.fit`."""
        raise NotImplementedError(
            "No training data: pass `train_dataloaders` to Trainer.fit (or `datamodule=`), or override "
            f"`{type(self).__name__}.train_dataloader()`."
        )

    def val_dataloader(self) -> DataLoader | None:
        """Return the validation DataLoader(s), or None for no validation."""
        return None

    def test_dataloader(self) -> DataLoader | None:
        """Return the test DataLoader(s)."""
        return None

    def predict_dataloader(self) -> DataLoader | None:
        """Return the predict DataLoader(s)."""
        return None
