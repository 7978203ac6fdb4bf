"""ModelCheckpoint as Lightning's (its `callbacks/model_checkpoint.py` and `test_model_checkpoint.py`):
monitored `epoch`/`step`, versioned last files, name templates, and Lightning's keys in every file."""

from __future__ import annotations

import pytest
import torch

from syncline.callbacks import CSVLogger, ModelCheckpoint
from syncline.trainer.checkpoint import load_checkpoint
from tests.callbacks._tasks import Scripted, make_loader, make_trainer


def _fit(root, checkpoint: ModelCheckpoint, epochs: int = 2, **kwargs):
    trainer = make_trainer(root, max_epochs=epochs, callbacks=[checkpoint], **kwargs)
    trainer.fit(Scripted(), make_loader(4))
    return trainer


@pytest.mark.parametrize(("monitor", "best"), [("epoch", "epoch=2-step=12.ckpt"), ("step", "epoch=2-step=12.ckpt")])
def test_epoch_and_step_can_be_monitored(tmp_path, monitor, best):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor=monitor, mode="max", save_top_k=2)
    _fit(tmp_path, checkpoint, epochs=3)
    assert checkpoint.best_model_path.endswith(best)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]


def test_a_second_run_in_the_same_folder_writes_last_v1(tmp_path):
    """Lightning versions the last file: a new run never overwrites another run's last.ckpt."""
    first = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    _fit(tmp_path, first, epochs=1)
    first_bytes = (tmp_path / "last.ckpt").read_bytes()
    second = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    _fit(tmp_path, second, epochs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-v1.ckpt", "last.ckpt"]
    assert (tmp_path / "last.ckpt").read_bytes() == first_bytes
    assert second.last_model_path == str(tmp_path / "last-v1.ckpt")


def test_checkpoint_name_last_is_a_template(tmp_path):
    """Lightning formats `CHECKPOINT_NAME_LAST` like `filename`; the previous last file of the run goes."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    checkpoint.CHECKPOINT_NAME_LAST = "{epoch}-last"
    _fit(tmp_path, checkpoint, epochs=2)
    assert [p.name for p in tmp_path.iterdir()] == ["epoch=1-last.ckpt"]


def test_a_field_naming_an_unlogged_metric_formats_as_zero(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{never_logged:.2f}")
    _fit(tmp_path, checkpoint, epochs=1)
    assert [p.name for p in tmp_path.iterdir()] == ["epoch=0-never_logged=0.00.ckpt"]


def test_a_logger_version_that_is_a_string_names_the_directory(tmp_path):
    logger = CSVLogger(tmp_path, name="runs", version="baseline")
    _fit(tmp_path, ModelCheckpoint(), epochs=1, logger=logger)
    assert (tmp_path / "runs" / "baseline" / "checkpoints" / "epoch=0-step=4.ckpt").is_file()


def test_files_hold_lightnings_top_level_keys(tmp_path):
    """Scripts that read a Lightning checkpoint read a syncline one: the same keys, with the same meaning."""

    class WithHparams(Scripted):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[checkpoint])
    task = WithHparams()
    trainer.fit(task, make_loader(4))
    saved = load_checkpoint(checkpoint.best_model_path)
    assert saved["epoch"] == 0 and saved["global_step"] == 4
    assert saved["hyper_parameters"] == {"lr": 0.05}
    assert set(saved["state_dict"]) == set(task.state_dict())
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == trainer.optimizers[0].param_groups[0]["lr"]
    assert saved["lr_schedulers"][0]["last_epoch"] == 1
    assert checkpoint.state_key in saved["callbacks"]
