"""AsyncModelAverage: the averaging thread averages, pauses for checkpoints, and always stops.

After a failure the thread starts no collective: on a cut link even the stop agreement would wait out a
whole collective timeout, and the rank's exit with it.
"""

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
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

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


class SilentPeer(Slow):
    """At step 5 rank 0 fails while rank 1 stops answering for 3 s (its thread, too, between two rounds)."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 5:
            strategy = self.trainer.strategy
            if self.global_rank == 1:
                time.sleep(3.0)  # in no collective: a peer cut off, as far as rank 0 can tell
                raise RuntimeError("rank 1 stops too")
            thread, started = strategy._thread, time.monotonic()
            strategy.on_failure()
            strategy.stop_averaging()
            self.stopped = (thread is not None, thread.is_alive(), time.monotonic() - started)
            raise RuntimeError("rank 0 failed")
        return super().training_step(batch, batch_idx)


def _failure_with_a_silent_peer(rank, world_size):
    task = SilentPeer(lr=0.05)
    # Rounds 10 s apart: none is in flight at step 5 (one in flight at a failure ends within its own timeout).
    strategy = AsyncModelAverage(interval_ms=10_000, timeout=20)
    with pytest.raises(RuntimeError, match="failed|stops too"):
        Trainer(strategy=strategy, **quiet(), max_steps=16).fit(task, loader(regression_data(64), 4))
    return getattr(task, "stopped", None)


def test_after_a_failure_the_thread_ends_without_waiting_for_a_silent_peer():
    stopped = run_distributed(_failure_with_a_silent_peer, 2, timeout=120)[0]
    # It used to start the stop agreement, an all-reduce that waits for the silent peer until the timeout
    # (20 s here): the thread was still alive when stop_averaging gave up on it (after 2 s).
    had_thread, alive, seconds = stopped
    assert had_thread and not alive, stopped
    assert seconds < 1.5, stopped


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
