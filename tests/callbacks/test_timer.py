"""`Timer`: Lightning 2.x's callbacks/timer.py behaviour (durations, per-stage times, stopping, resume)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

from syncline import MisconfigurationException
from syncline.callbacks import Timer
from syncline.callbacks import timer as timer_module
from syncline.checkpoint_file import load_checkpoint
from tests.callbacks._tasks import Scripted, make_loader, make_trainer


@pytest.mark.parametrize(
    ("duration", "seconds"),
    [
        ("00:00:00:22", 22),
        ("01:02:03:04", 93784),
        (timedelta(weeks=1), 604800),
        ({"weeks": 4, "days": 2}, 2592000),
        (None, None),
    ],
)
def test_durations_in_every_form(duration, seconds):
    assert Timer(duration=duration)._duration == seconds


@pytest.mark.parametrize(("options", "match"), [({"duration": "1:2"}, "DD:HH:MM:SS"), ({"interval": "day"}, "step")])
def test_bad_duration_or_interval(options, match):
    with pytest.raises(MisconfigurationException, match=match):
        Timer(**options)


CLOCK = [0.0]


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    """A clock that only the training steps move (20 ms each), so the stops do not depend on the machine."""
    CLOCK[0] = 0.0
    monkeypatch.setattr(timer_module, "time", SimpleNamespace(monotonic=lambda: CLOCK[0]))


class Slow(Scripted):
    def training_step(self, batch, batch_idx):
        CLOCK[0] += 0.02
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        CLOCK[0] += 0.001
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        CLOCK[0] += 0.001
        return super().test_step(batch, batch_idx)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_timer_stops_training_and_times_each_stage(tmp_path, interval, capsys):
    timer = Timer(duration={"seconds": 0.05}, interval=interval)
    trainer = make_trainer(tmp_path, max_epochs=100, callbacks=[timer])
    trainer.fit(Slow(), make_loader(4), make_loader(2))
    # "step": within the first epoch (3 batches of 20 ms pass 50 ms); "epoch": after the first epoch's end.
    assert trainer.global_step == (3 if interval == "step" else 4)
    assert "Time limit reached." in capsys.readouterr().err
    elapsed = timer.time_elapsed("train")
    assert elapsed >= 0.05 and timer.time_remaining("train") <= 0
    assert timer.time_elapsed("train") == elapsed  # the training clock stopped at its end
    assert timer.time_elapsed("validate") > 0 and timer.start_time("test") is None
    trainer.test(Slow(), make_loader(2))
    assert timer.time_elapsed("test") > 0


def test_trainer_max_time_adds_a_step_timer(tmp_path):
    trainer = make_trainer(tmp_path, max_time={"seconds": 0.05}, max_epochs=None)
    timers = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert len(timers) == 1 and timers[0]._interval == "step" and trainer.max_epochs == -1
    trainer.fit(Slow(), make_loader(4))
    assert trainer.global_step == 3
    with pytest.raises(MisconfigurationException, match="adds a Timer"):
        make_trainer(tmp_path, max_time="00:00:01:00", callbacks=[Timer()])


def test_time_spent_before_a_checkpoint_counts_after_resuming(tmp_path):
    from syncline.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[Timer(), checkpoint])
    trainer.fit(Slow(), make_loader(4))
    spent = load_checkpoint(checkpoint.last_model_path)["callbacks"]["Timer"]["time_elapsed"]["train"]
    assert spent == pytest.approx(0.08)
    resumed = Timer(duration=timedelta(seconds=spent))  # already spent: stops before any batch
    trainer = make_trainer(tmp_path, max_epochs=3, callbacks=[resumed])
    trainer.fit(Slow(), make_loader(4), ckpt_path=checkpoint.last_model_path)
    assert trainer.global_step == 4 and resumed.time_elapsed("train") >= spent


class RankClock(Timer):
    """Rank 0's clock runs out after 2 steps, rank 1's never: rank 0 decides for both."""

    def __init__(self, rank: int) -> None:
        super().__init__(duration=timedelta(seconds=1))
        self.rank, self.steps = rank, 0

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.steps += 1
        super().on_train_batch_end(trainer, task, outputs, batch, batch_idx)

    def time_elapsed(self, stage="train"):
        return 10.0 if self.rank == 0 and self.steps >= 2 else 0.0


def _fit_two_ranks(rank, world_size, tmp):
    trainer = make_trainer(tmp, max_epochs=5, strategy="bucketed_ddp", callbacks=[RankClock(rank)])
    trainer.fit(Scripted(), make_loader(8))
    return trainer.global_step


def test_rank_zeros_clock_stops_every_rank_at_the_same_step(tmp_path):
    from syncline.testing import run_distributed

    assert run_distributed(_fit_two_ranks, world_size=2, args=(str(tmp_path),), timeout=120) == [2, 2]
