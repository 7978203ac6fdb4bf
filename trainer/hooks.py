"""`DataHooks`: the data methods a `Task` and a `DataModule` share, as Lightning's ``core/hooks.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.strategies.strategy import move_to_device

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from syncline.trainer.trainer import Trainer

__all__ = ["TRANSFER_HOOKS", "DataHooks", "ModelHooks", "overrides"]

#: The batch-transfer hooks, in the order they run for every batch (`data.move_batch`).
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def overrides(obj: object, base: type, name: str) -> bool:
    """Whether `obj` replaces `base`'s method `name`, in its class or on the instance.

    The loop asks once per fit, and calls a hook left at its default straight to what the default does, so a
    step pays for no dispatch it does not need.
    """
    return name in getattr(obj, "__dict__", ()) or getattr(type(obj), name, None) is not getattr(base, name)


class DataHooks:
    """`prepare_data`, `setup`, `teardown`, the DataLoader of every stage and the batch-transfer hooks (a
    DataModule's override the task's); override those you need."""

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

    # The batch-transfer hooks run in this order for every batch of every stage (`move_batch`).
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter the batch before it is moved to the device (e.g. on the CPU, in the main process); return it."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move every tensor of `batch` (in lists, tuples, dicts, namedtuples) to `device`; override for other types."""
        return batch if device.type == "cpu" else move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter the batch once it is on the device (e.g. GPU augmentation); return it."""
        return batch


class ModelHooks:
    """The steps of optimization a task may override, as Lightning's ``ModelHooks`` and ``LightningModule`` have
    them: how it is built (`configure_model`), back-propagates, clips, steps and resets gradients."""

    trainer: Trainer

    def configure_model(self) -> None:
        """Create modules here (e.g. large ones) rather than in ``__init__``: called on every process at the
        start of every stage, after ``setup``, before the strategy moves and wraps the task and before
        `configure_optimizers`; make it idempotent, as it runs again for each stage."""

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate `loss` (the strategy's backward runs this between its synchronization steps)."""
        loss.backward(*args, **kwargs)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Reset the gradients before the first backward of an accumulation window (override to change how)."""
        optimizer.zero_grad()

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: torch.optim.Optimizer,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """Step `optimizer` (automatic optimization) at the end of an accumulation window; override to e.g. warm
        up the learning rate or skip steps. Call ``optimizer.step(closure=optimizer_closure)``: that step goes
        through the Trainer (loss scaling, ``on_before_optimizer_step``, `configure_gradient_clipping`)."""
        optimizer.step(closure=optimizer_closure)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step `scheduler` when the Trainer's schedule says it is due (automatic optimization): `metric` is the
        monitored value for a ReduceLROnPlateau, else None. Override it for a scheduler of another API."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients before each automatic optimizer step; the default applies the Trainer's
        `gradient_clip_val` and `gradient_clip_algorithm` through `clip_gradients`."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
