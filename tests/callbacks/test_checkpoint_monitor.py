"""Step checkpoints on a validation metric: skipped (with one warning) until validation has run, then saved."""

from __future__ import annotations

import warnings

import pytest

from syncline.callbacks import ModelCheckpoint
from tests.callbacks._tasks import Scripted, make_loader, make_trainer
from tests.trainer.test_cli import SMALL, _cli

BATCHES = 4


def _fit(tmp_path, checkpoint, epochs=2, val=True):
    trainer = make_trainer(tmp_path, max_epochs=epochs, callbacks=[checkpoint])
    val_loader = make_loader(2, seed=1) if val else None
    trainer.fit(Scripted(val_values=[3.0, 2.0, 1.0]), make_loader(BATCHES), val_loader)
    return trainer


def test_step_checkpoint_waits_for_the_first_validation(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "c", monitor="val_metric", every_n_train_steps=2, save_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, checkpoint, epochs=3)
    skipped = [w for w in caught if "skips its top-k save" in str(w.message)]
    assert len(skipped) == 1 and "step 2" in str(skipped[0].message)
    # Steps 2 and 4 come before epoch 0's validation; step 6 is the first with val_metric (3.0), and
    # epoch 1's validation (2.0) is first seen at step 10.
    assert checkpoint.best_model_path.endswith("epoch=2-step=10.ckpt")
    assert checkpoint.best_model_score == 2.0
    assert (tmp_path / "c" / "last.ckpt").is_file()  # written at every step save, skipped or not


def test_metric_still_missing_after_validation_is_the_clear_error(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "c", monitor="val_metrc", every_n_train_steps=2)
    expected = "monitor='val_metrc'.*found no metric of that name.*val_metric"
    with pytest.warns(UserWarning, match="skips its top-k save"), pytest.raises(KeyError, match=expected):
        _fit(tmp_path, checkpoint)


def test_epoch_checkpoint_without_validation_still_fails_at_once(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "c", monitor="val_metric")
    with pytest.raises(KeyError, match="found no metric of that name"):
        _fit(tmp_path, checkpoint, val=False)


def test_cli_step_checkpoints_on_val_loss_with_validation_at_epoch_end(tmp_path):
    out = tmp_path / "run"
    overrides = [*SMALL, "trainer.val_check_interval=1.0", "trainer.limit_train_batches=6", "trainer.max_epochs=2"]
    # The packaged checkpoint monitors nothing (Lightning's default); this one keeps the best by val_loss.
    monitored = ["callbacks.checkpoint.every_n_train_steps=2", "callbacks.checkpoint.monitor=val_loss"]
    result = _cli(f"hydra.run.dir={out}", *overrides, *monitored, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("skips its top-k save") == 1
    files = sorted(p.name for p in (out / "lightning_logs" / "version_0" / "checkpoints").iterdir())
    assert files == ["epoch=1-step=8.ckpt", "last.ckpt"]  # the first step save after epoch 0's validation

    result = _cli(
        f"hydra.run.dir={tmp_path / 'typo'}",
        *overrides,
        "callbacks.checkpoint.every_n_train_steps=2",
        "callbacks.checkpoint.monitor=val_los",
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "ModelCheckpoint(monitor='val_los') found no metric of that name" in result.stderr
