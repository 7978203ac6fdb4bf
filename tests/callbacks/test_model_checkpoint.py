"""ModelCheckpoint: top-k and last files on disk, step and epoch triggers, atomic saves, resume, ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from syncline.callbacks import ModelCheckpoint
from syncline.callbacks.model_checkpoint import _Plan
from syncline.checkpoint_file import load_checkpoint
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.callbacks._tasks import FakeRank, Scripted, make_loader, make_trainer

# Batches of 2 samples, 4 batches per epoch: epoch e ends at global step 4 * (e + 1).
BATCHES = 4


def _fit(tmp_path, checkpoint, epochs, values=None, ckpt_path=None, **trainer_kwargs):
    trainer = make_trainer(tmp_path, max_epochs=epochs, callbacks=[checkpoint], **trainer_kwargs)
    task = Scripted(val_values=values)
    trainer.fit(task, make_loader(BATCHES), make_loader(2, seed=1), ckpt_path=ckpt_path)
    return trainer, task


def _files(directory) -> set[str]:
    return {p.name for p in Path(directory).iterdir()}


@pytest.mark.parametrize(
    ("mode", "kept_epochs", "best_epoch"),
    [("min", {1, 3}, 3), ("max", {0, 4}, 4)],
)
def test_top_k_keeps_the_best_files_and_last(tmp_path, mode, kept_epochs, best_epoch):
    values = [5.0, 3.0, 4.0, 1.0, 6.0]
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        filename="{epoch}-{val_metric:.1f}",
        monitor="val_metric",
        mode=mode,
        save_top_k=2,
        save_last=True,
    )
    _fit(tmp_path, checkpoint, epochs=5, values=values)

    expected = {f"epoch={e}-val_metric={values[e]:.1f}.ckpt" for e in kept_epochs} | {"last.ckpt"}
    assert _files(tmp_path / "ckpt") == expected
    directory = os.path.realpath(tmp_path / "ckpt")
    best = os.path.join(directory, f"epoch={best_epoch}-val_metric={values[best_epoch]:.1f}.ckpt")
    assert checkpoint.best_model_path == best
    assert checkpoint.best_model_score == values[best_epoch]
    assert checkpoint.best_k_models == {
        os.path.join(directory, f"epoch={e}-val_metric={values[e]:.1f}.ckpt"): values[e] for e in kept_epochs
    }
    assert checkpoint.last_model_path == os.path.join(directory, "last.ckpt")
    # Each file holds the state of the moment it names.
    assert load_checkpoint(best)["progress"]["global_step"] == BATCHES * (best_epoch + 1)
    last = load_checkpoint(checkpoint.last_model_path)
    assert last["progress"]["global_step"] == BATCHES * 5
    # A checkpoint carries the bookkeeping that includes itself, so a resume can prune correctly.
    saved = last["callbacks"][checkpoint.state_key]
    assert saved["best_k_models"] == checkpoint.best_k_models
    assert saved["last_model_path"] == checkpoint.last_model_path


def test_without_monitor_the_latest_checkpoint_is_kept_under_the_log_dir(tmp_path):
    trainer, _ = _fit(tmp_path, ModelCheckpoint(), epochs=3, logger=True)
    directory = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert trainer.checkpoint_callback.dirpath == os.path.realpath(directory)
    assert _files(directory) == {"epoch=2-step=12.ckpt"}
    assert trainer.checkpoint_callback.best_model_path.endswith("epoch=2-step=12.ckpt")
    assert trainer.checkpoint_callback.best_model_score is None


def test_default_dir_without_logger_is_default_root_dir(tmp_path):
    _fit(tmp_path, ModelCheckpoint(save_top_k=-1), epochs=2)
    assert _files(tmp_path / "checkpoints") == {"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"}


def test_save_top_k_zero_writes_only_last(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_metric", save_top_k=0, save_last=True)
    _fit(tmp_path, checkpoint, epochs=2, values=[1.0, 2.0])
    assert {p.name for p in tmp_path.glob("*.ckpt")} == {"last.ckpt"}
    assert checkpoint.best_model_path == "" and checkpoint.best_k_models == {}


def test_every_n_train_steps_saves_once_per_optimizer_step_with_accumulation(tmp_path, monkeypatch):
    """8 micro-batches and accumulation 2 give 4 steps per epoch; steps 3 and 6 are saved, each once."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[checkpoint], accumulate_grad_batches=2)
    saves = []
    original = trainer.save_checkpoint

    def spy(path, weights_only=False):
        saves.append((os.path.basename(path), trainer.global_step, trainer.state.batch_idx))
        original(path, weights_only)

    monkeypatch.setattr(trainer, "save_checkpoint", spy)
    trainer.fit(Scripted(), make_loader(8))

    # Saved after the micro-batch that closed the window (batch_idx counts completed micro-batches).
    assert saves == [("epoch=0-step=3.ckpt", 3, 6), ("epoch=1-step=6.ckpt", 6, 4)]
    assert {p.name for p in tmp_path.glob("*.ckpt")} == {"epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"}
    assert load_checkpoint(tmp_path / "epoch=0-step=3.ckpt")["accumulated_grads_by_rank"] == [None]


def test_mid_epoch_validation_saves_after_each_validation(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=-1, filename="{step}")
    _fit(tmp_path, checkpoint, epochs=2, val_check_interval=0.5)
    assert {p.name for p in tmp_path.glob("*.ckpt")} == {f"step={s}.ckpt" for s in (2, 4, 6, 8)}


def test_save_last_writes_the_final_state_when_max_steps_stops_between_saves(tmp_path):
    """Validation every 3 of 4 batches and max_steps=5: the last save is at step 3, last.ckpt must be at 5."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=True, filename="{step}")
    trainer, _ = _fit(tmp_path, checkpoint, epochs=3, val_check_interval=3, max_steps=5)
    assert trainer.global_step == 5
    assert load_checkpoint(tmp_path / "last.ckpt")["progress"]["global_step"] == 5
    assert checkpoint.last_model_path == str(tmp_path / "last.ckpt")


def test_monitor_never_logged_lists_the_logged_keys(tmp_path):
    with pytest.raises(KeyError, match="'val_los'.*Logged metrics: train_loss, val_loss, val_metric"):
        _fit(tmp_path, ModelCheckpoint(dirpath=tmp_path, monitor="val_los"), epochs=1, values=[1.0])
    assert not list(tmp_path.glob("*.ckpt"))


def test_format_checkpoint_name_follows_lightning(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch:02d}-{val_loss:.3f}")
    name = checkpoint.format_checkpoint_name({"epoch": 3, "step": 7, "val_loss": torch.tensor(0.12345)})
    assert os.path.basename(name) == "epoch=03-val_loss=0.123.ckpt"
    plain = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}_{step}", auto_insert_metric_name=False)
    assert os.path.basename(plain.format_checkpoint_name({"epoch": 3, "step": 7})) == "3_7.ckpt"


def test_existing_file_of_another_run_gets_a_version_suffix(tmp_path):
    _fit(tmp_path, ModelCheckpoint(dirpath=tmp_path), epochs=1)
    before = (tmp_path / "epoch=0-step=4.ckpt").read_bytes()
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    # One warning, as Lightning gives: the other run's files are kept and not mixed into this run's top-k.
    with pytest.warns(UserWarning, match=r"already holds 1 checkpoint\(s\) of another run \(epoch=0-step=4.ckpt\)"):
        _fit(tmp_path, checkpoint, epochs=1)
    assert {p.name for p in tmp_path.glob("*.ckpt")} == {"epoch=0-step=4.ckpt", "epoch=0-step=4-v1.ckpt"}
    assert list(checkpoint.best_k_models) == [str(tmp_path / "epoch=0-step=4-v1.ckpt")]
    assert (tmp_path / "epoch=0-step=4.ckpt").read_bytes() == before
    assert checkpoint.best_model_path.endswith("epoch=0-step=4-v1.ckpt")


@pytest.mark.parametrize("failing_save", ["top_k", "last"])
def test_crash_during_save_keeps_the_previous_checkpoint_intact(tmp_path, monkeypatch, failing_save):
    """A save that dies mid-write leaves the earlier files whole, loadable and untouched, and no temp file."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=1, save_last=True)
    real_save = torch.save
    calls = []
    # Epoch 0 writes its top-k file then last.ckpt (calls 1, 2); epoch 1 writes its top-k file (3), then last (4).
    fail_at = 3 if failing_save == "top_k" else 4

    def flaky_save(obj, file, *args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            file.write(b"half a checkpoint")
            raise OSError("disk full")
        real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", flaky_save)
    with pytest.raises(OSError, match="disk full"):
        _fit(tmp_path, checkpoint, epochs=2)

    last = load_checkpoint(tmp_path / "last.ckpt")
    assert last["progress"]["global_step"] == 4  # still epoch 0's
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]
    if failing_save == "top_k":
        assert _files(tmp_path) == {"epoch=0-step=4.ckpt", "last.ckpt"}
        assert load_checkpoint(tmp_path / "epoch=0-step=4.ckpt")["progress"]["global_step"] == 4
        # The failed save is not recorded as kept.
        assert checkpoint.best_k_models == {str(tmp_path / "epoch=0-step=4.ckpt"): 4.0}
        assert checkpoint.best_model_path == str(tmp_path / "epoch=0-step=4.ckpt")
    else:
        # The new top-k file was complete before the old one was deleted.
        assert _files(tmp_path) == {"epoch=1-step=8.ckpt", "last.ckpt"}
        assert load_checkpoint(tmp_path / "epoch=1-step=8.ckpt")["progress"]["global_step"] == 8
        assert checkpoint.last_model_path == str(tmp_path / "last.ckpt")


def test_resumed_run_keeps_pruning_the_same_top_k(tmp_path):
    """Two epochs, then a resume to five, leave the same files as five epochs straight."""
    values = [5.0, 3.0, 4.0, 1.0, 6.0]

    def checkpoint(directory):
        return ModelCheckpoint(dirpath=directory, monitor="val_metric", save_top_k=2, save_last=True)

    straight = tmp_path / "straight"
    _fit(straight, checkpoint(straight), epochs=5, values=values)

    resumed = tmp_path / "resumed"
    _fit(resumed, checkpoint(resumed), epochs=2, values=values)
    second = checkpoint(resumed)
    _fit(resumed, second, epochs=5, values=values, ckpt_path=resumed / "last.ckpt")

    assert _files(resumed) == _files(straight) == {"epoch=1-step=8.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"}
    assert second.best_model_score == 1.0
    assert sorted(second.best_k_models.values()) == [1.0, 3.0]


def test_changed_directory_restores_only_the_best_path(tmp_path):
    first = ModelCheckpoint(dirpath=tmp_path / "a", monitor="val_metric", save_top_k=1, save_last=True)
    _fit(tmp_path, first, epochs=1, values=[1.0, 0.5])
    second = ModelCheckpoint(dirpath=tmp_path / "b", monitor="val_metric", save_top_k=1)
    with pytest.warns(UserWarning, match="directory changed"):
        _fit(tmp_path, second, epochs=2, values=[1.0, 0.5], ckpt_path=tmp_path / "a" / "last.ckpt")
    # The old directory's file is not this run's to prune.
    assert _files(tmp_path / "a") == {"epoch=0-step=4.ckpt", "last.ckpt"}
    assert _files(tmp_path / "b") == {"epoch=1-step=8.ckpt"}


def test_non_zero_rank_follows_rank_zero_and_deletes_nothing(tmp_path, monkeypatch):
    """On rank 1 the files come from rank 0's broadcast decision, whatever rank 1's metrics say."""
    kept = tmp_path / "from_rank_0.ckpt"
    dropped = tmp_path / "dropped.ckpt"
    dropped.write_bytes(b"rank 0 deletes this, never rank 1")
    plan = _Plan(
        save_path=str(kept),
        drop_path=str(dropped),
        best_k_models={str(kept): 0.5},
        best_model_path=str(kept),
        best_model_score=0.5,
    )
    # Rank 0's answers: the directory, the files found there at fit start (none), the save plan.
    strategy = FakeRank(rank=1, broadcasts=[str(tmp_path), ({}, "", None), plan])
    checkpoint = ModelCheckpoint(monitor="val_metric")
    trainer = make_trainer(tmp_path, strategy=strategy, callbacks=[checkpoint])
    saved = []
    monkeypatch.setattr(trainer, "save_checkpoint", lambda path, weights_only=False: saved.append(path))
    trainer.fit(Scripted(val_values=[9.0]), make_loader(BATCHES), make_loader(2))

    assert strategy.sent == [None, None, None]  # rank 1 contributes nothing to any decision
    assert saved == [str(kept)]
    assert checkpoint.best_k_models == {str(kept): 0.5} and checkpoint.best_model_score == 0.5
    assert dropped.exists()


def _fit_two_ranks(rank, world_size, tmp):
    torch.manual_seed(0)

    class PerRank(Scripted):
        def validation_step(self, batch, batch_idx):
            # Not synced: rank 0 improves every epoch, rank 1 gets worse, so their rankings disagree.
            epoch = self.trainer.current_epoch
            self.log("score", float(10 - epoch if self.global_rank == 0 else epoch))

    checkpoint = ModelCheckpoint(dirpath=tmp, monitor="score", save_top_k=1, save_last=True)
    trainer = Trainer(
        max_epochs=3,
        strategy="bucketed_ddp",
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp,
    )
    trainer.fit(PerRank(), make_loader(8), make_loader(2))
    return checkpoint.best_model_path, checkpoint.best_k_models


def test_two_ranks_save_the_files_rank_zero_chose(tmp_path):
    results = run_distributed(_fit_two_ranks, world_size=2, args=(str(tmp_path),), timeout=120)
    best = str(tmp_path / "epoch=2-step=12.ckpt")
    assert results == [(best, {best: 8.0})] * 2
    assert _files(tmp_path) == {"epoch=2-step=12.ckpt", "last.ckpt"}
