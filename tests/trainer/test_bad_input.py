"""Bad input gets one clear error that names the thing and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.checkpoint_file import CheckpointError
from syncline.trainer import Task, Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


def _fit(task, **kwargs):
    Trainer(max_steps=2, **quiet(**kwargs)).fit(task, loader(regression_data(16)))


def test_training_step_returning_something_else():
    class ReturnsText(Regressor):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return "loss"

    with pytest.raises(TypeError, match=r"ReturnsText.training_step returned str; return the loss"):
        _fit(ReturnsText())


def test_training_step_returning_a_non_scalar():
    class PerSample(Regressor):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y, reduction="none")

    with pytest.raises(ValueError, match=r"loss of shape \(8, 1\).*must be a scalar"):
        _fit(PerSample())


def test_dict_without_loss():
    class NoLoss(Regressor):
        def training_step(self, batch, batch_idx):
            return {"value": super().training_step(batch, batch_idx)}

    with pytest.raises(TypeError, match="a dict with a 'loss' tensor"):
        _fit(NoLoss())


def test_missing_configure_optimizers():
    class NoOptimizer(Task):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).mean()

    with pytest.raises(NotImplementedError, match=r"NoOptimizer must override `configure_optimizers\(\)`"):
        _fit(NoOptimizer())


def test_configure_optimizers_returning_junk():
    class Junk(Regressor):
        def configure_optimizers(self):
            return "sgd"

    with pytest.raises(TypeError, match=r"Junk.configure_optimizers\(\) returned str"):
        _fit(Junk())


def test_no_training_data():
    with pytest.raises(NotImplementedError, match="pass `train_dataloaders` to Trainer.fit"):
        Trainer(max_steps=1, **quiet()).fit(Regressor())


def test_logging_a_vector():
    class LogsVector(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("vector", torch.ones(3))
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"self.log\('vector', ...\) got a tensor of shape \(3,\)"):
        _fit(LogsVector())


def test_missing_checkpoint_is_named(tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointError, match=f"Checkpoint file not found: {missing}"):
        Trainer(max_steps=1, **quiet()).fit(Regressor(), loader(regression_data(16)), ckpt_path=missing)


def test_corrupt_checkpoint_is_named(tmp_path):
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match=f"Cannot read checkpoint {corrupt}.*corrupt"):
        Trainer(max_steps=1, **quiet()).fit(Regressor(), loader(regression_data(16)), ckpt_path=corrupt)


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    path = tmp_path / "small.ckpt"
    trainer = Trainer(max_steps=1, **quiet())
    trainer.fit(Regressor(), loader(regression_data(16)))
    trainer.save_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not fit Regressor: parameter"):
        Trainer(max_steps=2, **quiet()).fit(Regressor(features=4), loader(regression_data(16, 4)), ckpt_path=path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accumulate_grad_batches": 0}, "accumulate_grad_batches must be an int >= 1"),
        ({"max_steps": -5}, r"Trainer\(max_steps=-5\): max_steps must be an int >= -1 \(-1 for no limit\)"),
        ({"max_epochs": -2}, "max_epochs must be None or an int >= -1"),
        ({"val_check_interval": 1.5}, "val_check_interval=1.5.*fraction of the epoch in \\(0, 1\\]"),
        ({"gradient_clip_val": 0}, "gradient_clip_val must be None or a finite number > 0"),
        ({"strategy": "warp_drive"}, "Unknown strategy 'warp_drive'. Valid strategies: .*single"),
        ({"limit_train_batches": 2.0}, "limit_train_batches=2.0.*a float is a fraction up to 1.0"),
        ({"devices": 2, "strategy": "single"}, "devices=2 needs a data-parallel strategy"),
    ],
)
def test_bad_trainer_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        trainer = Trainer(**quiet(**{"max_steps": 1, **kwargs}))
        trainer.fit(Regressor(), loader(regression_data(16)))
