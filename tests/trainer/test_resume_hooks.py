"""A checkpoint from any hook resumes bit-exactly: validation end, train epoch end, with every scheduler kind."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from syncline.callbacks import Callback, ModelCheckpoint
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, regression_data
from tests.trainer.test_resume import NoisyData

BATCHES = 10  # 60 samples in batches of 6


class WithScheduler(Regressor):
    """SGD with momentum and one scheduler: per step, per epoch, or on the validation loss."""

    def __init__(self, kind: str) -> None:
        super().__init__(dropout=0.3)
        self.kind = kind

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.kind == "step":
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self._step_lr(optimizer), "interval": "step"}}
        if self.kind == "epoch":
            return {"optimizer": optimizer, "lr_scheduler": self._step_lr(optimizer)}
        # patience=0 and a large threshold: the lr halves after every epoch, so a missed step shows.
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=10.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    def _step_lr(self, optimizer):
        step_size = 7 if self.kind == "step" else 1
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)


class Killed(Exception):
    """Stands for the process dying between two batches."""


class KillAt(Callback):
    """Stop the run the hard way before training batch `batch_idx` of `epoch`."""

    def __init__(self, epoch: int, batch_idx: int) -> None:
        self.epoch, self.batch_idx = epoch, batch_idx

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            raise Killed


def _fit(root, kind: str, val_check_interval: float, max_epochs: int, ckpt_path=None, callbacks=(), seed=7, **flags):
    torch.manual_seed(0 if ckpt_path is None else 5)
    task = WithScheduler(kind)
    trainer = Trainer(
        max_epochs=max_epochs,
        val_check_interval=val_check_interval,
        seed=seed,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpts", save_last=True), *callbacks],
        **flags,
    )
    # The validation loader draws from the global RNG each time it is iterated (its base seed).
    val = DataLoader(regression_data(12), batch_size=6, shuffle=True)
    trainer.fit(task, DataLoader(NoisyData(), batch_size=6, shuffle=True), val, ckpt_path=ckpt_path)
    return task, trainer


def _assert_same_run(resumed, resumed_trainer, reference, reference_trainer):
    assert resumed_trainer.global_step == reference_trainer.global_step
    assert resumed_trainer.optimizers[0].param_groups[0]["lr"] == reference_trainer.optimizers[0].param_groups[0]["lr"]
    for name, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


@pytest.mark.parametrize("kind", ["step", "epoch", "plateau"])
@pytest.mark.parametrize("val_check_interval", [1.0, 0.5], ids=["val-at-epoch-end", "val-within-epoch"])
def test_resume_from_an_epoch_end_checkpoint_is_bit_exact(tmp_path, kind, val_check_interval):
    """max_epochs=2, then max_epochs=3 with ckpt_path="last", equals max_epochs=3 (the README's recipe)."""
    reference, reference_trainer = _fit(tmp_path / "straight", kind, val_check_interval, 3)
    _fit(tmp_path / "split", kind, val_check_interval, 2)
    resumed, trainer = _fit(tmp_path / "split", kind, val_check_interval, 3, ckpt_path="last", seed=99)
    _assert_same_run(resumed, trainer, reference, reference_trainer)


@pytest.mark.parametrize("kind", ["step", "epoch", "plateau"])
def test_resume_from_a_mid_epoch_validation_checkpoint_is_bit_exact(tmp_path, kind):
    """Killed after the checkpoint of a validation within epoch 1; resumed from last.ckpt."""
    reference, reference_trainer = _fit(tmp_path / "straight", kind, 0.5, 3)
    with pytest.raises(Killed):
        _fit(tmp_path / "split", kind, 0.5, 3, callbacks=[KillAt(epoch=1, batch_idx=BATCHES // 2 + 1)])
    last = torch.load(tmp_path / "split" / "ckpts" / "last.ckpt", weights_only=True)
    assert (last["progress"]["current_epoch"], last["progress"]["batch_idx"]) == (1, BATCHES // 2)
    resumed, trainer = _fit(tmp_path / "split", kind, 0.5, 3, ckpt_path="last", seed=99)
    _assert_same_run(resumed, trainer, reference, reference_trainer)


class SaveInValidationEnd(Callback):
    """A user's callback saving from the final validation of epoch 0, before the epoch-end hooks ran."""

    def __init__(self, path) -> None:
        self.path = path

    def on_validation_end(self, trainer, task):
        if not trainer.sanity_checking and trainer.current_epoch == 0 and trainer.state.batch_idx == BATCHES:
            trainer.save_checkpoint(self.path)
            raise Killed


def test_checkpoint_saved_before_the_epoch_end_hooks_runs_them_on_resume(tmp_path):
    reference, reference_trainer = _fit(tmp_path / "straight", "plateau", 1.0, 2)
    path = tmp_path / "at-validation-end.ckpt"
    with pytest.raises(Killed):
        _fit(tmp_path / "split", "plateau", 1.0, 2, callbacks=[SaveInValidationEnd(path)])
    resumed, trainer = _fit(tmp_path / "split", "plateau", 1.0, 2, ckpt_path=path, seed=99)
    _assert_same_run(resumed, trainer, reference, reference_trainer)


@pytest.mark.parametrize("kind", ["step", "epoch"])
def test_resume_with_check_val_every_n_epoch_is_bit_exact(tmp_path, kind):
    """Validation in every second epoch (1 and 3): stopped after epoch 2, which does not validate, and killed
    inside epoch 3, which does; both resume to the uninterrupted run's weights, rate and step."""
    every = {"check_val_every_n_epoch": 2}
    reference, reference_trainer = _fit(tmp_path / "straight", kind, 1.0, 4, **every)
    _fit(tmp_path / "split", kind, 1.0, 3, **every)
    resumed, trainer = _fit(tmp_path / "split", kind, 1.0, 4, ckpt_path="last", seed=99, **every)
    _assert_same_run(resumed, trainer, reference, reference_trainer)
    with pytest.raises(Killed):
        _fit(tmp_path / "killed", kind, 1.0, 4, callbacks=[KillAt(epoch=3, batch_idx=4)], **every)
    resumed, trainer = _fit(tmp_path / "killed", kind, 1.0, 4, ckpt_path="last", seed=99, **every)
    _assert_same_run(resumed, trainer, reference, reference_trainer)
