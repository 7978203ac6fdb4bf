"""A checkpoint from 2 processes resumed on 3: exact at an epoch boundary; mid-epoch after the samples seen."""

from __future__ import annotations

import contextlib
import io
import warnings

import torch

from syncline.callbacks import Callback
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

# 48 samples in batches of 4: 6 batches per process and epoch on 2 processes, 4 on 3.
SAMPLES, BATCH = 48, 4


class CountBatches(Callback):
    """Record the batch indices trained in this run, per epoch."""

    def __init__(self) -> None:
        self.trained: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.trained.setdefault(trainer.current_epoch, []).append(batch_idx)


def _fit(path, save: bool, **limits) -> tuple[Trainer, CountBatches, list[str]]:
    torch.manual_seed(0)
    counter = CountBatches()
    trainer = Trainer(strategy="bucketed_ddp", callbacks=[counter], **quiet(**limits))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(), loader(regression_data(SAMPLES), BATCH), ckpt_path=None if save else path)
    if save:
        trainer.save_checkpoint(path)
    return trainer, counter, [str(w.message) for w in caught]


def _save_on_two(rank, world_size, path, limits):
    trainer, _, _ = _fit(path, save=True, **limits)
    return trainer.global_step


def _resume_on_three(rank, world_size, path):
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        trainer, counter, caught = _fit(path, save=False, max_epochs=2)
    return trainer.global_step, counter.trained, caught, printed.getvalue()


def test_epoch_boundary_checkpoint_continues_on_more_processes(tmp_path):
    path = str(tmp_path / "two.ckpt")
    assert run_distributed(_save_on_two, world_size=2, args=(path, {"max_epochs": 1}), timeout=120) == [6, 6]
    results = run_distributed(_resume_on_three, world_size=3, args=(path,), timeout=120)
    for rank, (steps, trained, caught, printed) in enumerate(results):
        assert steps == 6 + 4  # epoch 1 is split 3 ways: 4 batches per process
        assert trained == {1: [0, 1, 2, 3]}
        assert caught == []
        said = "saved on 2 process(es) on 3: it was taken at an epoch boundary" in printed
        assert said == (rank == 0)  # rank 0 alone prints


def test_mid_epoch_checkpoint_continues_after_the_samples_seen_with_a_warning(tmp_path):
    path = str(tmp_path / "two.ckpt")
    # 3 steps on 2 processes: 6 batches of samples seen in epoch 0, which is 2 batches on each of 3.
    assert run_distributed(_save_on_two, world_size=2, args=(path, {"max_steps": 3}), timeout=120) == [3, 3]
    results = run_distributed(_resume_on_three, world_size=3, args=(path,), timeout=120)
    for rank, (steps, trained, caught, _) in enumerate(results):
        assert trained == {0: [2, 3], 1: [0, 1, 2, 3]}
        assert steps == 3 + 2 + 4
        expected = "continues after 2 batches per process (6 batches of samples; the checkpoint had seen 6)"
        assert [m for m in caught if "in the middle of epoch 0 on 3" in m and expected in m] == (
            [] if rank else [caught[0]]
        )
        if rank == 0:
            assert "order of the rest of the epoch differs" in caught[0]
