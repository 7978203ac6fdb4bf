"""After a crash nothing accumulates: stale temporary files go, and top-k re-finds files it no longer tracked."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from syncline.callbacks import ModelCheckpoint
from syncline.callbacks.checkpoint_leftovers import find_top_k_files, remove_stale_temporaries
from tests.callbacks._tasks import Scripted, make_loader, make_trainer

# Batches of 2 samples, 4 batches per epoch: epoch e ends at global step 4 * (e + 1).
BATCHES = 4
#: Every epoch is a new best, so each save pushes the oldest top-k file out.
VALUES = [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]


def _fit(directory: Path, epochs: int, ckpt_path=None):
    checkpoint = ModelCheckpoint(dirpath=directory, monitor="val_metric", save_top_k=2, save_last=True)
    trainer = make_trainer(directory.parent, max_epochs=epochs, callbacks=[checkpoint])
    trainer.fit(Scripted(val_values=VALUES), make_loader(BATCHES), make_loader(2, seed=1), ckpt_path=ckpt_path)
    return checkpoint


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_resume_from_an_older_checkpoint_keeps_the_top_k_bound(tmp_path):
    ckpts = tmp_path / "ckpts"
    _fit(ckpts, 2)
    older = tmp_path / "older.ckpt"
    shutil.copy(ckpts / "last.ckpt", older)  # after epoch 1: tracks epochs 0 and 1
    _fit(ckpts, 4, ckpt_path="last")  # writes epochs 2 and 3, deletes 0 and 1
    assert _names(ckpts) == {"epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"}
    # Killed in the middle of a save, and of another program's work.
    (ckpts / ".epoch=4-step=20.ckpt.ab12_x9Z.tmp").write_bytes(b"half a checkpoint")
    (ckpts / ".last.ckpt.0a1b2c3d.tmp").write_bytes(b"")
    (ckpts / ".notes.tmp").write_text("not syncline's")

    checkpoint = _fit(ckpts, 6, ckpt_path=older)  # resumed from before epochs 2 and 3 were saved

    # Only the best two of all the files this callback ever wrote remain, however the run was interrupted.
    assert _names(ckpts) == {"epoch=4-step=20.ckpt", "epoch=5-step=24.ckpt", "last.ckpt", ".notes.tmp"}
    assert checkpoint.best_k_models == {
        str(ckpts / "epoch=4-step=20.ckpt"): 2.0,
        str(ckpts / "epoch=5-step=24.ckpt"): 1.0,
    }
    assert checkpoint.best_model_path == str(ckpts / "epoch=5-step=24.ckpt")


def test_top_k_files_are_found_with_their_scores(tmp_path):
    ckpts = tmp_path / "ckpts"
    checkpoint = _fit(ckpts, 3)
    (ckpts / "other.ckpt").write_bytes(b"not a checkpoint")
    torch.save({"callbacks": {}}, ckpts / "foreign.ckpt")
    found = find_top_k_files(ckpts, checkpoint.state_key)
    assert found == {str(ckpts / "epoch=1-step=8.ckpt"): 5.0, str(ckpts / "epoch=2-step=12.ckpt"): 4.0}
    assert find_top_k_files(ckpts, "AnotherCallback{}") == {}


def test_only_syncline_temporaries_are_removed(tmp_path):
    names = [".a.ckpt.abcd1234.tmp", ".last.ckpt.k_9xYz01.tmp", ".a.ckpt.tmp", "a.ckpt.abcd1234.tmp", ".x.abcd1234.tmp"]
    for name in names:
        (tmp_path / name).touch()
    assert remove_stale_temporaries(tmp_path) == [".a.ckpt.abcd1234.tmp", ".last.ckpt.k_9xYz01.tmp"]
    assert _names(tmp_path) == {".a.ckpt.tmp", "a.ckpt.abcd1234.tmp", ".x.abcd1234.tmp"}


def _resume_two_ranks(rank, world_size, tmp):
    import torch.distributed as dist

    from syncline.trainer import Trainer

    ckpts = Path(tmp) / "ckpts"

    def fit(epochs, ckpt_path=None):
        checkpoint = ModelCheckpoint(dirpath=ckpts, monitor="val_metric", save_top_k=2, save_last=True)
        trainer = Trainer(
            max_epochs=epochs,
            strategy="bucketed_ddp",
            callbacks=[checkpoint],
            logger=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            default_root_dir=tmp,
        )
        trainer.fit(Scripted(val_values=VALUES), make_loader(2 * BATCHES), make_loader(4, seed=1), ckpt_path=ckpt_path)
        return checkpoint

    fit(2)
    if rank == 0:
        shutil.copy(ckpts / "last.ckpt", Path(tmp) / "older.ckpt")
    fit(4, ckpt_path="last")
    if rank == 0:
        (ckpts / ".epoch=4-step=20.ckpt.ab12_x9Z.tmp").write_bytes(b"half a checkpoint")
    dist.barrier()
    checkpoint = fit(6, ckpt_path=Path(tmp) / "older.ckpt")
    return checkpoint.best_k_models, sorted(_names(ckpts))


def test_two_ranks_agree_on_the_rebuilt_top_k(tmp_path):
    from syncline.testing import run_distributed

    results = run_distributed(_resume_two_ranks, world_size=2, args=(str(tmp_path),), timeout=120)
    ckpts = tmp_path / "ckpts"
    expected = {str(ckpts / "epoch=4-step=20.ckpt"): 2.0, str(ckpts / "epoch=5-step=24.ckpt"): 1.0}
    assert results[0] == results[1]
    assert results[0] == (expected, ["epoch=4-step=20.ckpt", "epoch=5-step=24.ckpt", "last.ckpt"])
