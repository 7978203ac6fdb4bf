"""ModelCheckpoint's options as Lightning 2.x's callbacks/model_checkpoint.py defines them."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import yaml

from syncline import MisconfigurationException
from syncline.callbacks import Callback, EarlyStopping, ModelCheckpoint
from syncline.checkpoint_file import load_checkpoint
from tests.callbacks._tasks import Scripted, make_loader, make_trainer


def _files(directory):
    return sorted(os.listdir(directory))


def test_state_key_is_lightnings():
    checkpoint = ModelCheckpoint(monitor="val_loss", every_n_train_steps=3)
    assert checkpoint.state_key == (
        "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 3, 'every_n_epochs': 0, "
        "'train_time_interval': None}"
    )


def test_save_top_k_above_one_needs_a_monitor():
    with pytest.raises(MisconfigurationException, match=r"save_top_k=2, monitor=None\) is not a valid"):
        ModelCheckpoint(save_top_k=2)
    ModelCheckpoint(save_top_k=-1)


class Explodes(Callback):
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            raise RuntimeError("boom")


def test_save_on_exception_writes_the_state_at_the_error(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True)
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[Explodes(), checkpoint])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Scripted(), make_loader(4))
    assert _files(tmp_path) == ["epoch=0-step=3.ckpt"]
    assert load_checkpoint(tmp_path / "epoch=0-step=3.ckpt")["progress"]["global_step"] == 3
    # Off by default, as in Lightning.
    other = tmp_path / "off"
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[Explodes(), ModelCheckpoint(dirpath=other)])
    with pytest.raises(RuntimeError):
        trainer.fit(Scripted(), make_loader(4))
    assert not other.exists() or _files(other) == []


def test_version_counter_or_overwrite(tmp_path):
    for counter, expected in ((True, ["run-v1.ckpt", "run.ckpt"]), (False, ["run.ckpt"])):
        directory = tmp_path / str(counter)
        directory.mkdir()
        (directory / "run.ckpt").write_bytes(b"another run's file")
        checkpoint = ModelCheckpoint(dirpath=directory, filename="run", enable_version_counter=counter)
        make_trainer(tmp_path, callbacks=[checkpoint]).fit(Scripted(), make_loader(4))
        assert _files(directory) == expected
        assert load_checkpoint(directory / expected[0])["progress"]["global_step"] == 4


def test_a_zero_time_interval_saves_after_every_step(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(0), save_top_k=-1)
    assert checkpoint.every_n_epochs == 0  # a time trigger replaces the epoch one, as in Lightning
    make_trainer(tmp_path, callbacks=[checkpoint]).fit(Scripted(), make_loader(4))
    assert _files(tmp_path) == [f"epoch=0-step={step}.ckpt" for step in (1, 2, 3, 4)]
    with pytest.raises(MisconfigurationException, match="train_time_interval"):
        ModelCheckpoint(train_time_interval=timedelta(seconds=-1))


def test_to_yaml_writes_best_k_models(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_metric", save_top_k=2)
    make_trainer(tmp_path, max_epochs=3, callbacks=[checkpoint]).fit(
        Scripted(val_values=[3.0, 1.0, 2.0]), make_loader(2), make_loader(1)
    )
    checkpoint.to_yaml()
    assert yaml.safe_load((tmp_path / "best_k_models.yaml").read_text()) == checkpoint.best_k_models
    assert sorted(checkpoint.best_k_models.values()) == [1.0, 2.0]
    checkpoint.to_yaml(tmp_path / "other.yaml")
    assert (tmp_path / "other.yaml").exists()


class NpyCheckpoint(ModelCheckpoint):
    FILE_EXTENSION = ".pt"
    CHECKPOINT_NAME_LAST = "final"


def test_file_extension_and_last_name_can_be_overridden(tmp_path):
    checkpoint = NpyCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(tmp_path, callbacks=[checkpoint]).fit(Scripted(), make_loader(2))
    assert _files(tmp_path) == ["epoch=0-step=2.pt", "final.pt"]


def test_early_stopping_with_patience_zero_stops_at_the_first_check_without_improvement(tmp_path):
    stopper = EarlyStopping("val_metric", patience=0)
    trainer = make_trainer(tmp_path, max_epochs=5, callbacks=[stopper])
    trainer.fit(Scripted(val_values=[3.0, 2.0, 2.5, 1.0, 0.5]), make_loader(2), make_loader(1))
    assert trainer.current_epoch == 3  # epochs 0, 1 improve; epoch 2 does not: stop after it


def _fit_to(root, max_steps, ckpt_path=None):
    checkpoint = ModelCheckpoint(
        dirpath=root, filename="{epoch}-{step}-{val_metric:.1f}", monitor="val_metric", save_top_k=2, save_last=True
    )
    trainer = make_trainer(root, max_epochs=3, max_steps=max_steps, val_check_interval=2, callbacks=[checkpoint])
    trainer.fit(Scripted(val_values=[3.0, 1.0, 2.0]), make_loader(4), make_loader(1), ckpt_path=ckpt_path)
    return checkpoint


def test_resume_after_a_max_steps_stop_mid_epoch_keeps_the_best_model_bookkeeping(tmp_path):
    straight = _fit_to(tmp_path / "straight", 10)
    _fit_to(tmp_path / "cut", 3)  # stops after batch 3 of epoch 0, between two validations
    resumed = _fit_to(tmp_path / "cut", 10, ckpt_path=str(tmp_path / "cut" / "last.ckpt"))

    def names(checkpoint):
        return {os.path.basename(path): score for path, score in checkpoint.best_k_models.items()}

    assert names(resumed) == names(straight)
    assert os.path.basename(resumed.best_model_path) == os.path.basename(straight.best_model_path)
    assert resumed.best_model_score == straight.best_model_score == 1.0
    assert sorted(os.listdir(tmp_path / "cut")) == sorted(os.listdir(tmp_path / "straight"))
