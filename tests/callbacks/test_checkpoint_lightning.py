"""ModelCheckpoint as Lightning's (its `callbacks/model_checkpoint.py` and `test_model_checkpoint.py`):
monitored `epoch`/`step`, versioned last files, name templates, and Lightning's keys in every file."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

from syncline.callbacks import CSVLogger, ModelCheckpoint
from syncline.checkpoint_file import CheckpointError, load_checkpoint
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


def test_save_weights_only_writes_a_file_load_from_checkpoint_reads_and_resume_refuses(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True, save_last=True)
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[checkpoint])
    task = Scripted()
    trainer.fit(task, make_loader(4))
    saved = load_checkpoint(tmp_path / "last.ckpt")
    # Lightning's weights-only file: no optimizer, scheduler, callback, loop or RNG state.
    for key in ("optimizer", "optimizer_states", "lr_schedulers", "callbacks", "progress", "rng"):
        assert key not in saved, key
    assert {"state_dict", "hyper_parameters", "epoch", "global_step"} <= saved.keys()
    loaded = Scripted.load_from_checkpoint(tmp_path / "last.ckpt")
    for name, value in task.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    # Evaluation loads the weights; a resume has nothing to continue from, and says so.
    assert "test_loss" in trainer.test(Scripted(), make_loader(2), ckpt_path=tmp_path / "last.ckpt")[0]
    with pytest.raises(CheckpointError, match=r"holds the weights only \(ModelCheckpoint\(save_weights_only=True\)\)"):
        make_trainer(tmp_path, max_epochs=2).fit(Scripted(), make_loader(4), ckpt_path=tmp_path / "last.ckpt")


def test_train_time_interval_saves_after_the_first_step_past_each_interval(tmp_path, monkeypatch):
    """A clock that advances 10 s per reading and an interval of 25 s: steps 3 and 6 of 8 are saved (Lightning
    reads the clock at every step and at the start of training), and no epoch checkpoint."""
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr("syncline.callbacks.model_checkpoint.monotonic", lambda: float(next(clock)))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(seconds=25), save_top_k=-1)
    _fit(tmp_path, checkpoint, epochs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"train_time_interval": timedelta(minutes=1), "every_n_epochs": 1}, "are exclusive; pass one of them"),
        ({"train_time_interval": 60}, r"train_time_interval=60\): pass a datetime.timedelta >= 0"),
    ],
)
def test_train_time_interval_errors_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelCheckpoint(**kwargs)


@pytest.mark.parametrize(
    ("values", "kth", "kth_value", "current", "best"),
    [
        # Two kept: the worse of them is the k-th; a score that enters replaces it.
        ([5.0, 3.0, 4.0, 1.0], "epoch=1", 3.0, 1.0, "epoch=3"),
        # 6 does not enter the top 2: nothing is saved, and current_score stays the last saved score.
        ([5.0, 3.0, 6.0], "epoch=0", 5.0, 3.0, "epoch=1"),
        # Fewer than save_top_k kept: there is no k-th yet.
        ([5.0], "", math.inf, 5.0, "epoch=0"),
    ],
)
def test_kth_best_model_path_and_current_score_as_lightning(tmp_path, values, kth, kth_value, current, best):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val_metric", save_top_k=2)
    trainer = make_trainer(tmp_path, max_epochs=len(values), callbacks=[checkpoint])
    trainer.fit(Scripted(val_values=values), make_loader(2), make_loader(1))
    assert checkpoint.kth_best_model_path == (str(tmp_path / f"{kth}.ckpt") if kth else "")
    assert (checkpoint.kth_value, checkpoint.current_score) == (kth_value, current)
    assert checkpoint.best_model_path == str(tmp_path / f"{best}.ckpt")
    state = checkpoint.state_dict()
    assert (state["kth_best_model_path"], state["kth_value"], state["current_score"]) == (
        checkpoint.kth_best_model_path,
        kth_value,
        current,
    )


@pytest.mark.parametrize(("on_epoch_end", "epochs"), [(None, [1, 3]), (False, [1, 3]), (True, [0, 1, 2, 3])])
def test_save_on_train_epoch_end_with_check_val_every_n_epoch(tmp_path, on_epoch_end, epochs):
    """Validating every 2nd epoch, Lightning saves after each validation by default, not at every epoch's end."""
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=on_epoch_end
    )
    trainer = make_trainer(tmp_path, max_epochs=4, callbacks=[checkpoint], check_val_every_n_epoch=2)
    trainer.fit(Scripted(), make_loader(2), make_loader(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"epoch={e}.ckpt" for e in epochs]
