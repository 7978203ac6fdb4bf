"""Lightning's debugging flags: fast_dev_run (n batches of every stage, nothing written) and overfit_batches."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from syncline.callbacks import EarlyStopping, ModelCheckpoint
from syncline.checkpoint_file import CheckpointError
from syncline.options import OptionError
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, regression_data


class Counting(Regressor):
    """Counts the batches of every stage and records the first sample of each training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = {"train": 0, "val": 0, "test": 0, "predict": 0}
        self.first_samples: list[float] = []

    def training_step(self, batch, batch_idx):
        self.batches["train"] += 1
        self.first_samples.append(float(batch[0][0, 0]))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.batches["val"] += 1
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.batches["test"] += 1
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        self.batches["predict"] += 1
        return super().predict_step(batch, batch_idx)


def test_fast_dev_run_runs_n_batches_of_every_stage_and_writes_nothing(tmp_path, capsys):
    data = loader(regression_data(64), 8)  # 8 batches
    # Everything that would write: the default TensorBoardLogger and ModelCheckpoint, and a monitored one.
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=5,
        limit_train_batches=6,
        num_sanity_val_steps=2,
        val_check_interval=3,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True)],
        fast_dev_run=2,
    )
    assert "Running in `fast_dev_run` mode: will run the requested loop using 2 batch(es)" in capsys.readouterr().err
    task = Counting()
    trainer.fit(task, data, data)
    # Lightning: 2 training batches (max_steps=2, one epoch), validation once at the epoch's end, no sanity check.
    assert task.batches == {"train": 2, "val": 2, "test": 0, "predict": 0}
    assert (trainer.global_step, trainer.current_epoch, trainer.fast_dev_run) == (2, 1, 2)
    assert "test_loss" in trainer.test(task, data)[0]  # metrics are computed, only not written
    assert len(trainer.predict(task, data)) == 2
    assert task.batches == {"train": 2, "val": 2, "test": 2, "predict": 2}
    assert list(tmp_path.iterdir()) == []  # no log, no checkpoint


def test_fast_dev_run_true_is_one_batch_and_one_is_true():
    for flag in (True, 1):
        trainer = Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, fast_dev_run=flag)
        task = Counting()
        trainer.fit(task, loader(regression_data(32), 8), loader(regression_data(32), 8))
        assert trainer.fast_dev_run is True
        assert task.batches["train"] == task.batches["val"] == 1


def test_fast_dev_run_never_stops_early_and_test_best_names_the_flag(tmp_path):
    stopper = EarlyStopping("val_loss", stopping_threshold=1e9)  # would stop at the first check
    trainer = Trainer(default_root_dir=tmp_path, enable_progress_bar=False, callbacks=[stopper], fast_dev_run=True)
    data = loader(regression_data(32), 8)
    trainer.fit(Counting(), data, data)
    assert not trainer.should_stop and stopper.stopped_epoch == 0
    # Lightning: without a task, test() would load the best checkpoint, and a debugging run saved none.
    with pytest.raises(CheckpointError, match=r'cannot execute `.test\(ckpt_path="best"\)` with `fast_dev_run=True`'):
        trainer.test(dataloaders=data)


def test_overfit_batches_trains_and_validates_on_the_same_first_batches_unshuffled():
    train = DataLoader(regression_data(64), batch_size=8, shuffle=True)
    val = loader(regression_data(64, seed=1), 8)
    trainer = Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, max_epochs=3, overfit_batches=2
    )
    task = Counting()
    with pytest.warns(UserWarning, match="requested to overfit but enabled train dataloader shuffling"):
        trainer.fit(task, train, val)
    assert isinstance(trainer.train_dataloader.sampler, SequentialSampler)
    ordered = regression_data(64).tensors[0]
    # The first two batches of the data set, in order, in every epoch (Lightning turns shuffling off).
    assert task.first_samples == [float(ordered[0, 0]), float(ordered[8, 0])] * 3
    # Validation: 2 batches of the validation set per epoch, after the 2-batch sanity check.
    assert (task.batches["train"], task.batches["val"]) == (6, 2 + 3 * 2)


def test_overfit_batches_fraction_and_precedence_over_fast_dev_run():
    task = Counting()
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = Trainer(**quiet, max_epochs=1, overfit_batches=0.25, num_sanity_val_steps=0)
    trainer.fit(task, loader(regression_data(64), 8), loader(regression_data(64), 8))
    assert (task.batches["train"], task.batches["val"]) == (2, 2)  # a quarter of 8 batches
    # Lightning: overfit_batches sets the training and validation limits even under fast_dev_run.
    trainer = Trainer(**quiet, overfit_batches=3, fast_dev_run=1)
    assert (trainer.limit_train_batches, trainer.limit_val_batches, trainer.limit_test_batches) == (3, 3, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fast_dev_run": -1}, r"fast_dev_run=-1\): fast_dev_run must be a bool or an int >= 0"),
        ({"fast_dev_run": "yes"}, r"fast_dev_run='yes'\)"),
        ({"overfit_batches": 1.5}, r"overfit_batches=1.5\): overfit_batches must be an int >= 0"),
        ({"overfit_batches": -2}, r"overfit_batches=-2\)"),
    ],
)
def test_bad_debugging_flags_are_named(kwargs, match):
    with pytest.raises(OptionError, match=match):
        Trainer(logger=False, **kwargs)


def _fast_dev_run_rank(rank, world_size, root):
    torch.manual_seed(0)
    task = Counting()
    trainer = Trainer(default_root_dir=root, accelerator="cpu", devices=2, enable_progress_bar=False, fast_dev_run=2)
    data = loader(TensorDataset(*regression_data(64).tensors), 8)  # 4 batches per rank
    trainer.fit(task, data, data)
    trainer.test(task, data)
    return task.batches, trainer.global_step


def test_fast_dev_run_on_two_processes_runs_n_batches_on_each_rank(tmp_path):
    results = run_distributed(_fast_dev_run_rank, world_size=2, args=(str(tmp_path),), timeout=120)
    assert results == [({"train": 2, "val": 2, "test": 2, "predict": 0}, 2)] * 2
    assert list(tmp_path.iterdir()) == []


TASK = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from syncline import Task


    class Tiny(Task):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.val_batches = 0

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.val_batches += 1
            self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def on_fit_end(self):
            print(f"rank {self.global_rank}: {self.trainer.global_step} steps, {self.val_batches} val batches")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def _data(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), 8)

        def train_dataloader(self):
            return self._data()

        def val_dataloader(self):
            return self._data()
    """
)


def test_fast_dev_run_from_the_command_line(tmp_path):
    """`trainer.fast_dev_run=2`: the default callbacks (checkpoint, lr_monitor) write nothing."""
    (tmp_path / "tinytask.py").write_text(TASK)
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "syncline", "task._target_=tinytask.Tiny", f"hydra.run.dir={out}"]
        + ["trainer.fast_dev_run=2", "trainer.max_epochs=3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("Running in `fast_dev_run` mode: will run the requested loop using 2 batch(es)") == 1
    assert "rank 0: 2 steps, 2 val batches" in result.stdout
    assert not (out / "lightning_logs").exists()
    assert not list(out.rglob("*.ckpt"))
