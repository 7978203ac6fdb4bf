"""ckpt_path on several ranks: one file, chosen by rank 0; every rank loads it, or every rank fails at once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from syncline.callbacks import Callback
from syncline.testing import run_ranks
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class StartStep(Callback):
    """Record the global step training starts from: 0 when fresh, the checkpoint's when resumed."""

    def on_train_start(self, trainer, task):
        self.step = trainer.global_step


def _fit(max_steps: int, ckpt_path=None, ckpt_read: str = "every_rank") -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        max_steps=max_steps,
        strategy="bucketed_ddp",
        default_root_dir="run",
        callbacks=[StartStep()],
        ckpt_read=ckpt_read,
        **quiet(),
    )
    trainer.fit(Regressor(), loader(regression_data(32), 4), ckpt_path=ckpt_path)
    return trainer


def _resume_in_own_folder(rank, world_size, tmp, ranks_with_checkpoint, ckpt_read="every_rank"):
    """Each rank works in its own folder, as ranks on nodes without a shared file system do."""
    home = Path(tmp) / f"node{rank}"
    home.mkdir()
    os.chdir(home)
    first = _fit(2)
    first.save_checkpoint("run/last.ckpt")  # every rank writes nothing but rank 0: copy it around
    if rank == 0:
        for other in ranks_with_checkpoint:
            if other != 0:
                (Path(tmp) / f"node{other}" / "run").mkdir(parents=True, exist_ok=True)
                shutil.copy("run/last.ckpt", Path(tmp) / f"node{other}" / "run" / "last.ckpt")
        if 0 not in ranks_with_checkpoint:
            os.remove("run/last.ckpt")
    first.strategy.barrier()
    resumed = _fit(4, ckpt_path="last", ckpt_read=ckpt_read)
    return resumed.callbacks[0].step, resumed.global_step


def test_rank_that_cannot_read_the_checkpoint_fails_every_rank_with_one_message(tmp_path):
    outcomes = run_ranks(_resume_in_own_folder, world_size=2, args=(str(tmp_path), [0]), timeout=90)
    for outcome in outcomes:
        assert outcome.error is not None, outcome
        assert "CheckpointError: Checkpoint run/last.ckpt cannot be read on rank(s) 1 of 2" in outcome.error
        assert "Checkpoint file not found" in outcome.error


def test_every_rank_loads_the_file_rank_zero_chose(tmp_path):
    outcomes = run_ranks(_resume_in_own_folder, world_size=2, args=(str(tmp_path), [0, 1]), timeout=90)
    assert [(o.error, o.value) for o in outcomes] == [(None, (2, 4)), (None, (2, 4))]


def test_no_checkpoint_on_rank_zero_starts_every_rank_fresh(tmp_path):
    """Rank 1 alone has a file: rank 0's answer (none) holds for every rank, so nobody waits for the others."""
    outcomes = run_ranks(_resume_in_own_folder, world_size=2, args=(str(tmp_path), [1]), timeout=90)
    assert [(o.error, o.value) for o in outcomes] == [(None, (0, 4)), (None, (0, 4))]


def test_rank_zero_reads_and_sends_the_checkpoint_when_asked(tmp_path):
    """ckpt_read="rank_zero": the file on rank 0's disk alone is enough, and every rank resumes from it."""
    args = (str(tmp_path), [0], "rank_zero")
    outcomes = run_ranks(_resume_in_own_folder, world_size=2, args=args, timeout=90)
    assert [(o.error, o.value) for o in outcomes] == [(None, (2, 4)), (None, (2, 4))]


class SaveAt(Callback):
    """Save a checkpoint after training batch `batch_idx` of epoch 0, and keep training."""

    def __init__(self, path: str, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


def _fit_accumulating(rank, world_size, path, save: bool):
    torch.manual_seed(0)
    task = Regressor(dropout=0.2)
    callbacks = [SaveAt(path, batch_idx=2)] if save else []
    trainer = Trainer(
        max_epochs=2, strategy="bucketed_ddp", accumulate_grad_batches=2, seed=1, callbacks=callbacks, **quiet()
    )
    trainer.fit(task, loader(regression_data(32), 2, shuffle=True), ckpt_path=None if save else path)
    return {name: value.clone() for name, value in task.state_dict().items()}


def test_mid_window_checkpoint_keeps_every_ranks_accumulated_gradients(tmp_path):
    """Saved after the first micro-batch of a window, whose gradients differ per rank (not yet averaged)."""
    from syncline.testing import run_distributed

    path = str(tmp_path / "mid-window.ckpt")
    reference = run_distributed(_fit_accumulating, world_size=2, args=(path, True), timeout=120)
    assert torch.load(path, weights_only=True)["progress"]["batch_idx"] == 3  # window [2, 3] is open
    resumed = run_distributed(_fit_accumulating, world_size=2, args=(path, False), timeout=120)
    for rank in range(2):
        for name, value in reference[rank].items():
            assert torch.equal(resumed[rank][name], value), (rank, name)
