"""TensorBoardLogger: events read back with TensorBoard's own reader, hparams, versions, resume, ranks."""

from __future__ import annotations

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from syncline.callbacks import LearningRateMonitor, ModelCheckpoint, TensorBoardLogger
from tests.callbacks._tasks import Scripted, make_loader, make_trainer


def _events(log_dir) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator


def _scalars(accumulator, tag) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def _session_hparams(accumulator) -> dict:
    content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    return {name: getattr(value, value.WhichOneof("kind")) for name, value in hparams.items()}


class WithHparams(Scripted):
    def __init__(self, lr=0.05, optimizer=None):
        super().__init__(lr=lr)
        self.save_hyperparameters()


def test_fit_writes_scalars_at_their_steps_and_hparams(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(tmp_path, max_epochs=2, logger=logger, log_every_n_steps=1)
    task = WithHparams(lr=0.05, optimizer={"name": "sgd", "momentum": 0.9})
    trainer.fit(task, make_loader(3), make_loader(1))

    assert logger.log_dir == str(tmp_path / "lightning_logs" / "version_0")
    events = _events(logger.log_dir)
    train = _scalars(events, "train_loss")
    # Lightning's steps: each step's values under the step before it, validation with the epoch's last batch.
    assert [step for step, _ in train] == list(range(6))
    assert [value for _, value in train] == pytest.approx(task.losses, rel=1e-6)
    assert [step for step, _ in _scalars(events, "val_loss")] == [2, 5]
    assert _session_hparams(events) == {"lr": 0.05, "optimizer/name": "sgd", "optimizer/momentum": 0.9}
    saved = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert saved == {"lr": 0.05, "optimizer": {"name": "sgd", "momentum": 0.9}}


@pytest.mark.parametrize("validate", [True, False])
def test_epoch_tag_has_one_event_per_logged_step_with_the_epoch_of_that_step(tmp_path, validate):
    """Steps 1-5 are epoch 0 and 6-10 epoch 1, logged as Lightning does under the step before (0-4, 5-9): every
    second step, and with validation the epoch's end too (at the step of its last batch)."""
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(tmp_path, max_epochs=2, logger=logger, log_every_n_steps=2)
    trainer.fit(Scripted(), make_loader(5), make_loader(1) if validate else None)
    epoch = _scalars(_events(logger.log_dir), "epoch")
    ends = [(4, 0), (9, 1)] if validate else []
    assert epoch == sorted({(1, 0), (3, 0), (5, 1), (7, 1), (9, 1), *ends})


def test_default_hp_metric_adds_a_placeholder(tmp_path):
    logger = TensorBoardLogger(tmp_path, default_hp_metric=True)
    logger.log_hyperparams({"lr": 0.1})
    logger.finalize("success")
    assert _scalars(_events(logger.log_dir), "hp_metric") == [(0, -1.0)]


def test_versions_increment_and_an_explicit_one_is_kept(tmp_path):
    first = TensorBoardLogger(tmp_path, name="exp")
    first.log_metrics({"a": 1.0}, 0)
    first.finalize("success")
    second = TensorBoardLogger(tmp_path, name="exp")
    assert second.version == 1
    assert TensorBoardLogger(tmp_path, name="exp", version=7).log_dir == str(tmp_path / "exp" / "version_7")
    assert second.state_dict() == {"version": 1, "last_step": -1}


def test_resumed_logger_continues_its_version_and_purges_what_followed_the_checkpoint(tmp_path):
    crashed = TensorBoardLogger(tmp_path)
    for step in range(1, 11):
        crashed.log_metrics({"loss": float(step)}, step)
    crashed.finalize("failed")

    resumed = TensorBoardLogger(tmp_path)
    resumed.load_state_dict({"version": 0})  # as the Trainer does with the checkpoint's logger state
    assert resumed.log_dir == crashed.log_dir
    for step in (6, 7, 8):
        resumed.log_metrics({"loss": -float(step)}, step)
    resumed.finalize("success")

    expected = [(s, float(s)) for s in range(1, 6)] + [(s, -float(s)) for s in (6, 7, 8)]
    assert _scalars(_events(crashed.log_dir), "loss") == expected


def test_state_is_ignored_once_writing_began(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    logger.log_metrics({"a": 1.0}, 0)
    logger.load_state_dict({"version": 0})
    assert logger.version == 1 and not logger.resuming


def test_trainer_resume_keeps_one_version_directory(tmp_path):
    """Resuming with ckpt_path="last" continues lightning_logs/version_0 and its checkpoints."""

    def fit(epochs, ckpt_path=None):
        trainer = make_trainer(
            tmp_path,
            max_epochs=epochs,
            logger=True,
            log_every_n_steps=1,
            callbacks=[ModelCheckpoint(save_last=True)],
        )
        trainer.fit(Scripted(), make_loader(2), ckpt_path=ckpt_path)
        return trainer

    fit(2)
    trainer = fit(3, ckpt_path="last")
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    assert trainer.checkpoint_callback.dirpath == str(tmp_path / "lightning_logs" / "version_0" / "checkpoints")
    steps = [step for step, _ in _scalars(_events(tmp_path / "lightning_logs" / "version_0"), "train_loss")]
    # Sorted: the reader orders event files by name, whose timestamp has a resolution of one second.
    assert sorted(steps) == [0, 1, 2, 3, 4, 5]


def test_nothing_is_written_on_a_non_zero_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"a": 1.0}, 0)
    logger.finalize("success")
    assert not any(tmp_path.iterdir())


def test_a_run_cut_and_resumed_logs_the_same_points_as_an_uninterrupted_one(tmp_path):
    """Nothing at the cut's step is purged, and comm/total_bytes continues its count."""

    def fit(root, max_steps, ckpt_path=None):
        torch.manual_seed(0)
        trainer = make_trainer(
            root,
            max_epochs=3,
            max_steps=max_steps,
            logger=True,
            log_every_n_steps=2,
            val_check_interval=2,
            strategy="bucketed_ddp",  # a world of one: it counts the bytes it all-reduces
            # The monitor logs at the start of an epoch: after a cut at an epoch's end, at the cut's step.
            callbacks=[ModelCheckpoint(save_last=True), LearningRateMonitor()],
        )
        trainer.fit(Scripted(), make_loader(4), make_loader(1), ckpt_path=ckpt_path)

    fit(tmp_path / "straight", 10)
    fit(tmp_path / "cut", 8)
    fit(tmp_path / "cut", 10, ckpt_path="last")
    straight = _events(tmp_path / "straight" / "lightning_logs" / "version_0")
    resumed = _events(tmp_path / "cut" / "lightning_logs" / "version_0")
    tags = straight.Tags()["scalars"]
    assert {"train_loss", "val_loss", "comm/total_bytes", "epoch"} <= set(tags)
    assert sorted(resumed.Tags()["scalars"]) == sorted(tags)
    for tag in tags:
        # Sorted: the reader orders event files by name, whose timestamp has a resolution of one second.
        expected, got = sorted(_scalars(straight, tag)), sorted(_scalars(resumed, tag))
        if tag.endswith("_ms"):  # timings: the same steps, not the same values
            expected, got = [step for step, _ in expected], [step for step, _ in got]
        assert got == expected, tag
    # The cut's last validation (after step 8) is logged, as Lightning logs it, at step 7.
    assert 7 in [step for step, _ in _scalars(resumed, "val_loss")]
