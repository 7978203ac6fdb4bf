"""Bit-exact resume: a run stopped and resumed from a checkpoint ends with the uninterrupted run's weights."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from syncline.callbacks import Callback, CSVLogger, ModelCheckpoint
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class NoisyData(Dataset):
    """Regression data whose inputs get fresh noise on every read: augmentation that draws random numbers."""

    def __init__(self, n: int = 60) -> None:
        self.base = regression_data(n)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        return x + 0.01 * torch.randn_like(x), y


class Crash(Exception):
    """Stands for the process dying right after a checkpoint was written."""


class SaveThenCrash(Callback):
    """Write a checkpoint at one point of training, then stop the run the hard way."""

    def __init__(self, path, epoch: int, batch_idx: int | None) -> None:
        self.path, self.epoch, self.batch_idx = path, epoch, batch_idx

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if self.batch_idx == batch_idx and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            raise Crash

    def on_train_epoch_end(self, trainer, task):
        if self.batch_idx is None and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            raise Crash


class Scheduled(Regressor):
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("seen", batch[1].sum(), on_step=False, on_epoch=True, reduce_fx="sum")
        return loss


def _run(tmp_path, num_workers: int, callbacks=(), ckpt_path=None, init_seed: int = 0):
    torch.manual_seed(init_seed)
    task = Scheduled(dropout=0.3)
    data = NoisyData()
    train = DataLoader(data, batch_size=6, shuffle=True, num_workers=num_workers)
    val = DataLoader(regression_data(12), batch_size=6)
    trainer = Trainer(
        max_epochs=3,
        accumulate_grad_batches=3,
        val_check_interval=0.5,
        seed=7 if ckpt_path is None else 1234,  # a resumed run must not depend on the seed it is given
        callbacks=list(callbacks),
        default_root_dir=tmp_path,
        **quiet(),
    )
    trainer.fit(task, train, val, ckpt_path=ckpt_path)
    return task, trainer


@pytest.mark.parametrize(
    ("epoch", "batch_idx", "num_workers"),
    [(1, 4, 0), (1, None, 0), (0, 6, 2)],
    ids=["mid-epoch-mid-window", "epoch-end", "mid-epoch-workers"],
)
def test_resume_is_bit_exact(tmp_path, epoch, batch_idx, num_workers):
    reference, reference_trainer = _run(tmp_path, num_workers)
    path = tmp_path / "interrupted.ckpt"
    with pytest.raises(Crash):
        _run(tmp_path, num_workers, callbacks=[SaveThenCrash(path, epoch, batch_idx)])
    resumed, trainer = _run(tmp_path, num_workers, ckpt_path=path, init_seed=99)
    assert trainer.global_step == reference_trainer.global_step
    for name, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    # Epoch aggregates survive a mid-epoch resume too.
    assert torch.equal(trainer.callback_metrics["seen"], reference_trainer.callback_metrics["seen"])


def test_resume_without_replay_would_differ(tmp_path):
    """Guard: resuming only the weights (no RNG, data order or optimizer state) gives other weights."""
    reference, _ = _run(tmp_path, 0)
    path = tmp_path / "interrupted.ckpt"
    with pytest.raises(Crash):
        _run(tmp_path, 0, callbacks=[SaveThenCrash(path, 1, 4)])
    weights_only = Scheduled(dropout=0.3)
    weights_only.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    trainer = Trainer(max_epochs=2, accumulate_grad_batches=3, **quiet())
    trainer.fit(weights_only, DataLoader(NoisyData(), batch_size=6, shuffle=True))
    assert not torch.equal(weights_only.net[0].weight, reference.net[0].weight)


def test_ckpt_path_last_finds_the_newest_last_checkpoint(tmp_path):
    """Without a ModelCheckpoint, the last checkpoint is where a preemption writes it: `default_root_dir`."""
    path = tmp_path / "last.ckpt"
    with pytest.raises(Crash):
        _run(tmp_path, 0, callbacks=[SaveThenCrash(path, 0, 3)])
    _, trainer = _run(tmp_path, 0, ckpt_path="last")
    reference, reference_trainer = _run(tmp_path / "fresh", 0)
    assert trainer.global_step == reference_trainer.global_step


def test_ckpt_path_last_without_checkpoint_warns_and_starts_fresh(tmp_path):
    with pytest.warns(UserWarning, match="no last checkpoint"):
        _, trainer = _run(tmp_path, 0, ckpt_path="last")
    assert trainer.global_step == 3 * 4  # 10 batches / 3 per window = 4 steps per epoch


def test_resume_after_max_steps_continues_the_cut_epoch(tmp_path):
    """A run stopped by max_steps mid-epoch and resumed with a larger max_steps equals one uninterrupted run."""
    data = NoisyData()

    def fit(max_steps: int, ckpt_path=None, init_seed: int = 0):
        torch.manual_seed(init_seed)
        task = Scheduled(dropout=0.3)
        trainer = Trainer(max_steps=max_steps, seed=7, default_root_dir=tmp_path, **quiet())
        trainer.fit(task, DataLoader(data, batch_size=6, shuffle=True), ckpt_path=ckpt_path)
        return task, trainer

    reference, _ = fit(16)  # 10 batches per epoch: ends mid-epoch 1
    _, first = fit(13)
    first.save_checkpoint(tmp_path / "at13.ckpt")
    assert not first.state.batches_done and first.current_epoch == 1
    resumed, trainer = fit(16, ckpt_path=tmp_path / "at13.ckpt", init_seed=3)
    assert trainer.global_step == 16
    for name, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_ckpt_path_last_and_best_never_reach_another_experiment(tmp_path):
    """Two experiments side by side under one working directory: B's "last" and "best" look only in B's own
    checkpoint folders. Finding none, "last" warns and B trains from scratch (as Lightning); "best" is an error."""
    data, val = loader(regression_data(32), 8), loader(regression_data(16, seed=1), 8)

    def fit(name: str, ckpt_path=None, **kwargs):
        torch.manual_seed({"A": 0, "B": 1}[name[0]])
        task = Regressor()
        checkpoint = ModelCheckpoint(save_last=True, monitor="val_loss", **kwargs)
        trainer = Trainer(
            max_steps=8, default_root_dir=tmp_path, callbacks=[checkpoint], **quiet(enable_checkpointing=True)
        )
        trainer.fit(task, data, val, ckpt_path=ckpt_path)
        return task, trainer

    fit("A", dirpath=tmp_path / "experiments" / "A")
    fresh, _ = fit("B-fresh", dirpath=tmp_path / "fresh")
    with pytest.warns(UserWarning, match="no last checkpoint"):
        task, trainer = fit("B", ckpt_path="last", dirpath=tmp_path / "experiments" / "B")
    assert trainer.ckpt_path is None and trainer.global_step == 8
    for name, value in fresh.state_dict().items():
        assert torch.equal(task.state_dict()[name], value), name
    # B's own last checkpoint is found: the resume continues from step 8.
    _, resumed = fit("B", ckpt_path="last", dirpath=tmp_path / "experiments" / "B")
    assert resumed.ckpt_path == str(tmp_path / "experiments" / "B" / "last.ckpt") and resumed.global_step == 8
    # "best" is this trainer's ModelCheckpoint's best: a new trainer for C has none, though A's and B's exist.
    trainer = Trainer(
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "experiments" / "C")], **quiet(enable_checkpointing=True)
    )
    with pytest.raises(ValueError, match="best"):
        trainer.validate(Regressor(), val, ckpt_path="best")


def test_ckpt_path_last_with_default_folders_stays_in_its_logger_name(tmp_path):
    """Two experiments told apart by the logger's name in one `default_root_dir`: B never resumes A."""
    data = loader(regression_data(32), 8)

    def fit(name: str, ckpt_path=None):
        torch.manual_seed(0)
        logger = CSVLogger(tmp_path, name=name)
        callbacks = [ModelCheckpoint(save_last=True)]
        trainer = Trainer(
            max_steps=4,
            default_root_dir=tmp_path,
            callbacks=callbacks,
            **quiet(logger=logger, enable_checkpointing=True),
        )
        trainer.fit(Regressor(), data, ckpt_path=ckpt_path)
        return trainer

    fit("A")
    assert (tmp_path / "A" / "version_0" / "checkpoints").is_dir()
    with pytest.warns(UserWarning, match="no last checkpoint"):
        assert fit("B", ckpt_path="last").ckpt_path is None
    resumed = fit("A", ckpt_path="last")
    assert resumed.ckpt_path is not None and resumed.ckpt_path.startswith(str(tmp_path / "A" / "version_0"))
