"""What validate/test return and what the loggers receive, as Lightning 2.x's logger connector does it
(trainer/connectors/logger_connector/logger_connector.py; tests/tests_pytorch/trainer/logging_/)."""

from __future__ import annotations

import torch

from syncline import Trainer
from tests.callbacks._tasks import RecordingLogger
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class TwoLoaders(Regressor):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))
        self.log("shared", 1.0, add_dataloader_idx=False)

    def on_validation_epoch_end(self):
        self.log("after", 2.0)


def test_several_loaders_return_one_dict_each_with_dataloader_idx_suffixes():
    logger = RecordingLogger()
    trainer = Trainer(**quiet(logger=logger))
    first, second = regression_data(16, seed=1), regression_data(8, seed=2)
    results = trainer.validate(TwoLoaders(), [loader(first), loader(second)])
    assert [sorted(r) for r in results] == [
        ["after", "shared", "val_loss/dataloader_idx_0"],
        ["after", "shared", "val_loss/dataloader_idx_1"],
    ]
    # The epoch values reach the loggers once, under their suffixed names, with the epoch.
    (epoch_call,) = [metrics for _, metrics in logger.calls if "after" in metrics]
    assert set(epoch_call) == {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1", "shared", "after", "epoch"}
    assert "epoch" not in trainer.logged_metrics  # added for the loggers only, as in Lightning


class LogsEpoch(Regressor):
    def training_step(self, batch, batch_idx):
        self.log("epoch", -float(batch_idx))
        return super().training_step(batch, batch_idx)


class LogsStep(Regressor):
    def training_step(self, batch, batch_idx):
        self.log("step", 100.0 + batch_idx)
        return super().training_step(batch, batch_idx)


def test_a_logged_epoch_is_not_overridden_and_a_logged_step_is_the_loggers_step():
    logger = RecordingLogger()
    trainer = Trainer(**quiet(max_epochs=1, logger=logger, log_every_n_steps=1))
    trainer.fit(LogsEpoch(), loader(regression_data(16)))
    assert float(trainer.logged_metrics["epoch"]) == -1.0
    assert logger.values("epoch") == [(0, -0.0), (1, -1.0)]
    logger.calls.clear()
    trainer = Trainer(**quiet(max_epochs=1, logger=logger, log_every_n_steps=1))
    trainer.fit(LogsStep(), loader(regression_data(16)))
    assert [step for step, _ in logger.values("train_loss")] == [100, 101]
    assert logger.values("epoch") == []  # the epoch is added only where the Trainer chose the step
