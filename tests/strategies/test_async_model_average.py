"""AsyncModelAverage: the averaging thread averages, pauses for checkpoints, and always stops."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch
from _averaging import fit, flat_params

from syncline.options import OptionError
from syncline.strategies import AsyncModelAverage
from syncline.testing import run_distributed
from tests.trainer._tasks import Regressor

THREAD = "syncline-async-average"


class Slow(Regressor):
    """A forward of a few milliseconds, so the thread gets rounds in; raises at `fail_at` when set."""

    fail_at: int | None = None

    def training_step(self, batch, batch_idx):
        time.sleep(0.003)
        if self.fail_at is not None and self.trainer.global_step == self.fail_at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


class Failing(Slow):
    fail_at = 6


def _alive() -> bool:
    return any(t.name == THREAD and t.is_alive() for t in threading.enumerate())


def _checkpoint_resume_and_failure(rank, world_size, tmp):
    first, task = fit(AsyncModelAverage(interval_ms=1, warmup_steps=2), Slow, max_steps=8, default_root_dir=tmp)
    first.save_checkpoint(f"{tmp}/mid.ckpt")  # stops every rank's thread: a consistent state
    saved = torch.load(f"{tmp}/mid.ckpt", weights_only=True)["replicas_by_rank"][rank]["state_dict"]
    consistent = all(torch.equal(saved[name], value) for name, value in task.state_dict().items())
    rounds_first = first.strategy.rounds
    resumed, _ = fit(AsyncModelAverage(interval_ms=1, warmup_steps=2), Slow, max_steps=16, ckpt_path=f"{tmp}/mid.ckpt")
    after_fits = _alive()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        fit(AsyncModelAverage(interval_ms=1), Failing, max_steps=16)
    return {
        "consistent": consistent,
        "rounds": (rounds_first, resumed.strategy.rounds),
        "steps": resumed.strategy.steps,
        "alive": (after_fits, _alive()),
        "failure_s": time.monotonic() - started,
        "weights": flat_params(resumed.task),
    }


def test_checkpoints_pause_the_thread_resume_restarts_it_and_a_failure_stops_it(tmp_path):
    ranks = run_distributed(_checkpoint_resume_and_failure, 2, args=(str(tmp_path),), timeout=120)
    for result in ranks:
        # The checkpoint holds exactly the parameters the rank had once its thread stopped.
        assert result["consistent"]
        first, resumed = result["rounds"]
        # The thread averaged, and after the resume (its counter restored) it averaged again.
        assert 0 < first < resumed
        assert result["steps"] == 16
        # No averaging thread outlives fit, even one that ended with an exception.
        assert result["alive"] == (False, False)
        assert result["failure_s"] < 30
    assert ranks[0]["rounds"] == ranks[1]["rounds"]


def test_bad_options_fail_at_construction():
    with pytest.raises(OptionError, match=r"AsyncModelAverage\(interval_ms=-1\)"):
        AsyncModelAverage(interval_ms=-1)
    with pytest.raises(OptionError, match=r"AsyncModelAverage\(warmup_steps=1.5\)"):
        AsyncModelAverage(warmup_steps=1.5)


def test_pickles_for_the_launcher_without_its_thread_primitives():
    """`Trainer(devices=N)` pickles the strategy to its workers; locks and events cannot be pickled."""
    copy = pickle.loads(pickle.dumps(AsyncModelAverage(interval_ms=7, warmup_steps=3)))
    assert (copy.interval_ms, copy.warmup_steps) == (7, 3)
    with copy._lock:
        assert not copy._stop.is_set() and copy._thread is None
