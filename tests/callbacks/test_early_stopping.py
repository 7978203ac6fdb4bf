"""EarlyStopping: the epoch it stops at for scripted metrics, where it checks, errors, resume and ranks."""

from __future__ import annotations

import math

import pytest
import torch

from syncline.callbacks import EarlyStopping, ModelCheckpoint
from syncline.callbacks.early_stopping import EarlyStoppingReason, _Decision
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.callbacks._tasks import FakeRank, Scripted, make_loader, make_trainer


def _fit(tmp_path, stopper, values, max_epochs=10, validate=True, ckpt_path=None, callbacks=(), **kwargs):
    trainer = make_trainer(tmp_path, max_epochs=max_epochs, callbacks=[stopper, *callbacks], **kwargs)
    task = Scripted(val_values=values if validate else None, train_values=None if validate else values)
    trainer.fit(task, make_loader(2), make_loader(1) if validate else None, ckpt_path=ckpt_path)
    return trainer, task


@pytest.mark.parametrize(
    ("mode", "values", "stop_epoch"),
    [
        # best 4 at epoch 1; epochs 2 and 3 do not beat it (a tie is no improvement).
        ("min", [5, 4, 4, 4.5, 3, 2], 3),
        ("max", [1, 2, 1, 3, 2, 2, 9], 5),
    ],
)
def test_stops_after_patience_checks_without_improvement(tmp_path, mode, values, stop_epoch):
    stopper = EarlyStopping("val_metric", patience=2, mode=mode)
    trainer, task = _fit(tmp_path, stopper, values)
    assert task.epochs_started == list(range(stop_epoch + 1))
    # As in Lightning, the counter advances past the stopped epoch.
    assert trainer.current_epoch == stop_epoch + 1
    assert stopper.stopped_epoch == stop_epoch
    assert stopper.wait_count == 2


def test_min_delta_demands_a_large_enough_improvement(tmp_path):
    values = [5.0, 4.95, 4.92, 4.91, 4.0]
    trainer, _ = _fit(tmp_path, EarlyStopping("val_metric", patience=3, min_delta=0.1), values)
    assert trainer.current_epoch == 4  # stopped in epoch 3
    # Without min_delta every epoch improves.
    trainer, _ = _fit(tmp_path, EarlyStopping("val_metric", patience=3), values, max_epochs=5)
    assert trainer.current_epoch == 5 and not trainer.should_stop


def test_checks_at_train_epoch_end_without_validation(tmp_path):
    stopper = EarlyStopping("train_metric", patience=1)
    trainer, task = _fit(tmp_path, stopper, [3.0, 2.0, 2.5, 1.0], validate=False)
    assert task.epochs_started == [0, 1, 2]
    assert stopper.best_score == 2.0


def test_sanity_check_is_not_a_check(tmp_path):
    """With patience 1, counting the sanity validation (same value as epoch 0) would stop at epoch 0."""
    stopper = EarlyStopping("val_metric", patience=1)
    trainer, _ = _fit(tmp_path, stopper, [5.0, 6.0, 1.0], num_sanity_val_steps=1)
    assert stopper.stopped_epoch == 1 and trainer.current_epoch == 2


def test_non_finite_metric_stops_at_once(tmp_path):
    stopper = EarlyStopping("val_metric", patience=5)
    trainer, _ = _fit(tmp_path, stopper, [3.0, math.nan, 1.0])
    assert stopper.stopped_epoch == 1 and trainer.current_epoch == 2


def test_missing_metric_lists_the_logged_keys(tmp_path):
    with pytest.raises(KeyError, match="'val_acc'.*Logged metrics: train_loss, val_loss, val_metric"):
        _fit(tmp_path, EarlyStopping("val_acc"), [1.0])


def test_verbose_reports_the_stop(tmp_path, capsys):
    _fit(tmp_path, EarlyStopping("val_metric", patience=1, verbose=True), [1.0, 2.0])
    err = capsys.readouterr().err
    assert "val_metric improved to 1" in err
    assert "did not improve in the last 1 checks (best 1); stopping" in err


def test_resume_continues_the_wait_count(tmp_path):
    """Stopping three epochs after the best one happens at the same epoch across a resume."""
    values = [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    last = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, save_last=True)
    first = EarlyStopping("val_metric", patience=3)
    _fit(tmp_path, first, values, max_epochs=2, callbacks=[last])
    assert first.wait_count == 1

    resumed = EarlyStopping("val_metric", patience=3)
    last = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, save_last=True)
    trainer, task = _fit(tmp_path, resumed, values, callbacks=[last], ckpt_path=tmp_path / "last.ckpt")
    assert task.epochs_started == [2, 3]
    assert resumed.stopped_epoch == 3 and resumed.best_score == 1.0


def test_non_zero_rank_stops_when_rank_zero_says_so(tmp_path):
    """Rank 1's own metric improves, but rank 0's broadcast decision stops it."""
    decision = _Decision(wait_count=3, best_score=0.5, reason=EarlyStoppingReason.PATIENCE_EXHAUSTED)
    strategy = FakeRank(rank=1, broadcasts=[decision])
    stopper = EarlyStopping("val_metric")
    trainer, task = _fit(tmp_path, stopper, [1.0, 0.1, 0.01], strategy=strategy)
    assert strategy.sent == [None]
    assert task.epochs_started == [0]
    assert (stopper.wait_count, stopper.best_score) == (3, 0.5)


def _fit_two_ranks(rank, world_size):
    torch.manual_seed(0)

    class PerRank(Scripted):
        def validation_step(self, batch, batch_idx):
            # Not synced: rank 0 never improves after epoch 0, rank 1 always does.
            epoch = self.trainer.current_epoch
            self.log("score", 1.0 if self.global_rank == 0 else -float(epoch))

    stopper = EarlyStopping("score", patience=2)
    trainer = Trainer(
        max_epochs=10,
        strategy="bucketed_ddp",
        callbacks=[stopper],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    task = PerRank()
    trainer.fit(task, make_loader(4), make_loader(2))
    return task.epochs_started, stopper.wait_count


def test_two_ranks_stop_together_on_rank_zero_decision():
    results = run_distributed(_fit_two_ranks, world_size=2, timeout=120)
    assert results == [([0, 1, 2], 2)] * 2


@pytest.mark.parametrize(
    ("mode", "values", "threshold", "stop_epoch", "message"),
    [
        # Lightning: stop at once when the metric is strictly better than the threshold (a tie is not).
        ("min", [5.0, 1.0, 0.9, 0.5], 1.0, 2, "Stopping threshold reached: val_metric = 0.9 < 1.0."),
        ("max", [0.5, 0.9, 0.95, 0.99], 0.9, 2, "Stopping threshold reached: val_metric = 0.95 > 0.9."),
    ],
)
def test_stopping_threshold_stops_at_once(tmp_path, mode, values, threshold, stop_epoch, message):
    stopper = EarlyStopping("val_metric", patience=100, mode=mode, stopping_threshold=threshold)
    trainer, task = _fit(tmp_path, stopper, values)
    assert task.epochs_started == list(range(stop_epoch + 1))
    assert stopper.stopping_reason is EarlyStoppingReason.STOPPING_THRESHOLD
    assert stopper.stopping_reason_message == message


@pytest.mark.parametrize(("mode", "values"), [("min", [1.0, 0.5, 10.0, 11.0]), ("max", [1.0, 2.0, -10.0, -11.0])])
def test_divergence_threshold_stops_once_the_metric_is_worse_than_it(tmp_path, mode, values):
    threshold = 10.0 if mode == "min" else -10.0  # the third value ties it, the fourth is beyond it
    stopper = EarlyStopping("val_metric", patience=100, mode=mode, divergence_threshold=threshold)
    trainer, task = _fit(tmp_path, stopper, values)
    assert stopper.stopped_epoch == 3 and trainer.current_epoch == 4
    assert stopper.stopping_reason is EarlyStoppingReason.DIVERGENCE_THRESHOLD
    worse = "val_metric = 11 > 10.0" if mode == "min" else "val_metric = -11 < -10.0"
    assert stopper.stopping_reason_message == f"Divergence threshold reached: {worse}."


def test_stopping_reason_for_patience_non_finite_and_no_stop(tmp_path):
    patient = EarlyStopping("val_metric", patience=1)
    _fit(tmp_path, patient, [1.0, 2.0])
    assert patient.stopping_reason is EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert "did not improve in the last 1 checks" in patient.stopping_reason_message
    finite = EarlyStopping("val_metric", patience=5)
    _fit(tmp_path, finite, [1.0, math.inf])
    assert finite.stopping_reason is EarlyStoppingReason.NON_FINITE_METRIC
    running = EarlyStopping("val_metric", patience=5)
    _fit(tmp_path, running, [3.0, 2.0, 1.0], max_epochs=3)
    assert running.stopping_reason is EarlyStoppingReason.NOT_STOPPED and running.stopping_reason_message is None


def test_by_default_checks_at_train_epoch_end_when_validation_runs_once_there(tmp_path):
    """Lightning checks at the training epoch's end then, so an epoch aggregate of training can be monitored."""
    stopper = EarlyStopping("train_metric", patience=1)
    trainer = make_trainer(tmp_path, max_epochs=5, callbacks=[stopper])
    task = Scripted(val_values=[1.0] * 5, train_values=[3.0, 2.0, 2.5, 1.0, 0.5])
    trainer.fit(task, make_loader(2), make_loader(1))
    assert task.epochs_started == [0, 1, 2] and stopper.best_score == 2.0


@pytest.mark.parametrize(("on_epoch_end", "stop_epoch"), [(None, 1), (False, 1), (True, 3)])
def test_check_on_train_epoch_end_with_two_validations_per_epoch(tmp_path, on_epoch_end, stop_epoch):
    """A metric that never improves, validated twice per epoch: after each validation (Lightning's default
    then) the second check of epoch 1 exhausts patience 3; once per epoch end, epoch 3's does."""
    stopper = EarlyStopping("val_metric", patience=3, check_on_train_epoch_end=on_epoch_end)
    trainer, _ = _fit(tmp_path, stopper, [5.0] * 6, val_check_interval=0.5)
    assert stopper.stopped_epoch == stop_epoch


def test_stopping_reason_is_part_of_the_state_that_launched_runs_send_back(tmp_path):
    """After a launched fit, the launching process loads rank 0's callback state: the reason must be in it, in
    a form a weights-only checkpoint load accepts."""
    stopper = EarlyStopping("val_metric", patience=1)
    _fit(tmp_path, stopper, [1.0, 2.0])
    torch.save(stopper.state_dict(), tmp_path / "state.pt")
    copy = EarlyStopping("val_metric", patience=1)
    copy.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert copy.stopping_reason is EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert copy.stopping_reason_message == stopper.stopping_reason_message
