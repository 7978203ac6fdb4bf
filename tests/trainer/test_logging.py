"""What `self.log` means in each hook, and what reaches the loggers at which step, as in Lightning 2.x.

Written from Lightning's `_FxValidator` (per-hook defaults), its logger connector (logging steps) and its
`_ResultCollection` (keys, reductions, what `callback_metrics` holds).
"""

from __future__ import annotations

import pytest
import torch

from syncline.callbacks import Callback
from syncline.trainer import Trainer
from tests.callbacks._tasks import RecordingLogger
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


def _fit(task, logger: RecordingLogger, epochs: int = 2, batches: int = 4, val: bool = True, **kwargs) -> Trainer:
    options = {**quiet(max_epochs=epochs, num_sanity_val_steps=0), "logger": logger, **kwargs}
    trainer = Trainer(**options)
    data = loader(regression_data(8 * batches), 8)
    trainer.fit(task, data, data if val else None)
    return trainer


def test_epoch_end_hooks_log_epoch_values_under_the_plain_name(tmp_path):
    """Lightning's defaults in `on_train_epoch_end`/`on_validation_epoch_end`: on_step=False, on_epoch=True."""

    class EpochLogs(Regressor):
        def on_train_epoch_end(self):
            self.log("train_end", float(self.current_epoch))

        def on_validation_epoch_end(self):
            self.log("val_end", 10.0 + self.current_epoch)

    logger = RecordingLogger(str(tmp_path))
    trainer = _fit(EpochLogs(), logger)
    assert logger.values("train_end") == [(3, 0.0), (7, 1.0)]
    assert logger.values("val_end") == [(3, 10.0), (7, 11.0)]
    assert not any(key.endswith(("_step", "_epoch")) for key in ("train_end", "val_end") if key in logger.calls[-1][1])
    assert trainer.callback_metrics["train_end"] == 1.0

    class StepInEpochEnd(Regressor):
        def on_train_epoch_end(self):
            self.log("bad", 1.0, on_step=True)

    with pytest.raises(ValueError, match=r"on_step=True\) is not possible in on_train_epoch_end"):
        _fit(StepInEpochEnd(), RecordingLogger(str(tmp_path)), epochs=1)


def test_a_callback_logging_through_the_task_at_the_epoch_end_is_published_in_that_epoch(tmp_path):
    class LogsAtEpochEnd(Callback):
        def on_train_epoch_end(self, trainer, task):
            task.log("from_callback", float(trainer.current_epoch))

    logger = RecordingLogger(str(tmp_path))
    trainer = _fit(Regressor(), logger, epochs=3, callbacks=[LogsAtEpochEnd()])
    assert logger.values("from_callback") == [(3, 0.0), (7, 1.0), (11, 2.0)]  # the last epoch's too
    assert trainer.callback_metrics["from_callback"] == 2.0


def test_the_tasks_validation_epoch_end_sees_this_epochs_aggregates(tmp_path):
    seen: list[float] = []

    class Sees(Regressor):
        def on_validation_epoch_end(self):
            seen.append(float(self.trainer.callback_metrics["val_loss"]))

    class Mean(Callback):
        def __init__(self):
            self.losses: list[float] = []

        def on_validation_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
            with torch.no_grad():
                self.losses.append(float(torch.nn.functional.mse_loss(task(batch[0]), batch[1])))

    mean = Mean()
    _fit(Sees(), RecordingLogger(str(tmp_path)), epochs=2, callbacks=[mean])
    expected = [sum(mean.losses[:4]) / 4, sum(mean.losses[4:]) / 4]  # equal batches: the plain mean
    assert seen == pytest.approx(expected, rel=1e-6)


def test_logging_steps_count_as_lightnings(tmp_path):
    """Lightning logs a step's values when (steps taken) % log_every_n_steps == 0, at the step before it:
    the first row has step 0 with log_every_n_steps=1; with 2, the steps are 1, 3, 5 ..."""
    every_step = RecordingLogger(str(tmp_path))
    _fit(Regressor(), every_step, epochs=1, val=False, log_every_n_steps=1)
    assert [step for step, _ in every_step.values("train_loss")] == [0, 1, 2, 3]
    assert every_step.calls[0][0] == 0

    every_other = RecordingLogger(str(tmp_path))
    _fit(Regressor(), every_other, epochs=2, val=False, log_every_n_steps=2)
    assert [step for step, _ in every_other.values("train_loss")] == [1, 3, 5, 7]


def test_metrics_hold_tensors_and_validation_step_values_reach_the_loggers(tmp_path):
    class StepValues(Regressor):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_mse", torch.nn.functional.mse_loss(self(x), y), on_step=True, on_epoch=True)

    logger = RecordingLogger(str(tmp_path))
    trainer = _fit(StepValues(), logger, epochs=2, batches=2)
    assert all(isinstance(value, torch.Tensor) for value in trainer.logged_metrics.values())
    assert all(isinstance(value, torch.Tensor) for value in trainer.callback_metrics.values())
    # Lightning logs evaluation step values at the count of batches this fit has evaluated in that loader.
    assert [step for step, _ in logger.values("val_mse_step")] == [0, 1, 2, 3]
    assert [step for step, _ in logger.values("val_mse_epoch")] == [1, 3]
    assert "val_mse_step" not in trainer.callback_metrics  # evaluation step values are for the loggers


def test_reduce_fx_takes_callables_and_avg(tmp_path):
    class Reductions(Regressor):
        def training_step(self, batch, batch_idx):
            value = float(batch_idx)
            self.log("maximum", value, on_epoch=True, reduce_fx=torch.max)
            self.log("total", value, on_epoch=True, on_step=False, reduce_fx=sum)
            self.log("average", value, on_epoch=True, on_step=False, reduce_fx="avg")
            return super().training_step(batch, batch_idx)

    trainer = _fit(Reductions(), RecordingLogger(str(tmp_path)), epochs=1, val=False)
    assert float(trainer.callback_metrics["maximum_epoch"]) == 3.0
    assert float(trainer.callback_metrics["total"]) == 6.0
    assert float(trainer.callback_metrics["average"]) == 1.5

    class Custom(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("median", 1.0, reduce_fx=torch.median)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="reduce_fx=.*torchmetrics Metric"):
        _fit(Custom(), RecordingLogger(str(tmp_path)), epochs=1, val=False)


def test_each_stage_starts_with_no_metrics(tmp_path):
    """Lightning resets the metrics when a stage starts: `validate` after `fit` shows only its own values."""
    trainer = _fit(Regressor(), RecordingLogger(str(tmp_path)), epochs=1)
    assert "train_loss" in trainer.callback_metrics
    task = trainer.task
    trainer.validate(task, loader(regression_data(16), 8))
    assert set(trainer.callback_metrics) == {"val_loss"}
    assert set(trainer.logged_metrics) == {"val_loss"}


def test_several_evaluation_loaders_log_per_loader_names(tmp_path):
    """Lightning adds ``/dataloader_idx_<i>`` with several loaders and returns one dict per loader."""

    class TwoLoaders(Regressor):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            return super().validation_step(batch, batch_idx)

    trainer = Trainer(**quiet())
    data = [loader(regression_data(16), 8), loader(regression_data(16, seed=1), 8)]
    results = trainer.validate(TwoLoaders(), data)
    assert [list(result) for result in results] == [["val_loss/dataloader_idx_0"], ["val_loss/dataloader_idx_1"]]
    assert results[0]["val_loss/dataloader_idx_0"] != results[1]["val_loss/dataloader_idx_1"]


def test_logging_where_lightning_forbids_it_is_a_clear_error():
    class LogsInSetup(Regressor):
        def on_fit_start(self):
            self.log("x", 1.0)

    with pytest.raises(ValueError, match="cannot be called in on_fit_start"):
        Trainer(**quiet(max_epochs=1)).fit(LogsInSetup(), loader(regression_data(16), 8))
