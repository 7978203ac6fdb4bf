"""LearningRateMonitor: logged values equal the scheduler's learning rates, at the right steps and names."""

from __future__ import annotations

import pytest
import torch

from syncline.callbacks import LearningRateMonitor
from tests.callbacks._tasks import RecordingLogger, Scripted, make_loader, make_trainer


class Scheduled(Scripted):
    """Scripted task with a scheduler; records the scheduler's LR at every batch start."""

    def __init__(self, interval="step", groups=1):
        super().__init__(lr=0.1)
        self.interval = interval
        self.groups = groups
        self.scheduler_lrs: list[tuple[int, list[float]]] = []

    def configure_optimizers(self):
        if self.groups == 1:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        else:
            optimizer = torch.optim.Adam(
                [{"params": [self.layer.weight], "lr": 0.1}, {"params": [self.layer.bias], "lr": 0.01}]
            )
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": self.interval}}

    def on_train_batch_start(self, batch, batch_idx):
        self.scheduler_lrs.append((self.trainer.global_step, list(self.scheduler.get_last_lr())))


def _fit(tmp_path, monitor, task, epochs=2, batches=4, **kwargs):
    logger = RecordingLogger(str(tmp_path))
    trainer = make_trainer(tmp_path, max_epochs=epochs, callbacks=[monitor], logger=logger, **kwargs)
    trainer.fit(task, make_loader(batches))
    return logger


def test_step_values_equal_the_schedulers_lrs(tmp_path):
    task = Scheduled("step")
    logger = _fit(tmp_path, LearningRateMonitor(), task, log_every_n_steps=1)
    logged = logger.values("lr-SGD")
    assert logged == [(step, lrs[0]) for step, lrs in task.scheduler_lrs]
    assert [value for _, value in logged] == pytest.approx([0.1 * 0.5 ** (step // 2) for step in range(8)])


def test_step_logging_follows_log_every_n_steps_and_accumulation(tmp_path):
    """Accumulation 2 over 8 micro-batches is 4 steps per epoch: one value per logging step, not per micro-batch.
    As in Lightning, a step is a logging step when the steps taken after it divide by log_every_n_steps, and its
    rate is logged under the step before it."""
    logger = _fit(
        tmp_path, LearningRateMonitor(), Scheduled("step"), batches=8, accumulate_grad_batches=2, log_every_n_steps=2
    )
    assert [step for step, _ in logger.values("lr-SGD")] == [1, 3, 5, 7]


def test_epoch_interval_logs_every_param_group_once_per_epoch(tmp_path):
    task = Scheduled("epoch", groups=2)
    logger = _fit(tmp_path, LearningRateMonitor(), task, epochs=3)
    # Lightning's names: parameter groups counted from 1 after a slash.
    assert logger.values("lr-Adam/pg1") == [(0, 0.1), (4, 0.1), (8, 0.05)]
    assert logger.values("lr-Adam/pg2") == [(0, 0.01), (4, 0.01), (8, 0.005)]
    assert "lr-Adam" not in {key for _, metrics in logger.calls for key in metrics}


def test_explicit_interval_overrides_the_schedulers(tmp_path):
    logger = _fit(tmp_path, LearningRateMonitor(logging_interval="epoch"), Scheduled("step"), log_every_n_steps=1)
    assert logger.values("lr-SGD") == [(0, 0.1), (4, 0.025)]


def test_without_scheduler_logs_the_constant_lr_per_step(tmp_path):
    logger = _fit(tmp_path, LearningRateMonitor(), Scripted(lr=0.3), epochs=1, log_every_n_steps=2)
    assert logger.values("lr-SGD") == [(1, 0.3), (3, 0.3)]


def test_needs_a_logger(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[LearningRateMonitor()])
    with pytest.raises(ValueError, match="needs a logger"):
        trainer.fit(Scripted(), make_loader())


def test_rejects_unknown_interval():
    with pytest.raises(ValueError, match="logging_interval"):
        LearningRateMonitor(logging_interval="batch")


def test_scheduler_name_names_the_curve(tmp_path):
    class Named(Scheduled):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            config["lr_scheduler"]["name"] = "warmup"
            return config

    logger = _fit(tmp_path, LearningRateMonitor(), Named("step"), log_every_n_steps=1)
    # As in Lightning, the scheduler's name is used as given.
    assert [value for _, value in logger.values("warmup")][:3] == pytest.approx([0.1, 0.1, 0.05])
    assert logger.values("lr-SGD") == []


def test_named_param_groups_and_the_rate_in_callback_metrics(tmp_path):
    """Lightning names a group by its "name" entry, and puts the rates in callback_metrics (monitorable)."""

    class NamedGroups(Scripted):
        def configure_optimizers(self):
            return torch.optim.Adam(
                [
                    {"params": [self.layer.weight], "lr": 0.1, "name": "weights"},
                    {"params": [self.layer.bias], "lr": 0.01},
                ]
            )

    logger = RecordingLogger(str(tmp_path))
    trainer = make_trainer(tmp_path, callbacks=[LearningRateMonitor()], logger=logger, log_every_n_steps=1)
    trainer.fit(NamedGroups(), make_loader(2))
    assert {key for _, metrics in logger.calls for key in metrics if key.startswith("lr")} == {
        "lr-Adam/weights",
        "lr-Adam/pg2",
    }
    assert float(trainer.callback_metrics["lr-Adam/weights"]) == pytest.approx(0.1)


def test_several_optimizers_of_one_class_get_lightnings_numbered_names(tmp_path):
    """A manual GAN's two Adams log as ``lr-Adam`` and ``lr-Adam-1``; a scheduler's name names its own optimizer."""
    from tests.trainer._manual import ToyGAN, gan_loader

    class TwoAdams(ToyGAN):
        def configure_optimizers(self):
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.05)
            opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=0.1)
            opt_e = torch.optim.Adam(self.discriminator.parameters(), lr=0.2)
            named = {"scheduler": torch.optim.lr_scheduler.StepLR(opt_e, 1), "name": "extra"}
            return [{"optimizer": opt_g}, {"optimizer": opt_d}, {"optimizer": opt_e, "lr_scheduler": named}]

        def training_step(self, batch, batch_idx):
            opt_g, opt_d, _ = self.optimizers()
            self.gan_step(batch, opt_g, opt_d, self.manual_backward)

    logger = RecordingLogger(str(tmp_path))
    trainer = make_trainer(tmp_path, callbacks=[LearningRateMonitor()], logger=logger, log_every_n_steps=1)
    trainer.fit(TwoAdams(toggle=False), gan_loader())
    assert {key: float(trainer.callback_metrics[key]) for key in ("lr-Adam", "lr-Adam-1", "extra")} == pytest.approx(
        {"lr-Adam": 0.05, "lr-Adam-1": 0.1, "extra": 0.2}
    )


class Optimized(Scripted):
    """Scripted task with the optimizer given (a factory of the parameters)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        return self.make(self.parameters())


@pytest.mark.parametrize(
    ("make", "name", "momentum", "decay"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01), "lr-SGD", 0.9, 0.01),
        # Lightning logs Adam's betas[0] as its momentum.
        (lambda p: torch.optim.Adam(p, lr=0.1, betas=(0.8, 0.99), weight_decay=0.02), "lr-Adam", 0.8, 0.02),
    ],
)
def test_log_momentum_and_weight_decay_beside_the_rate(tmp_path, make, name, momentum, decay):
    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    logger = _fit(tmp_path, monitor, Optimized(make), epochs=1, log_every_n_steps=1)
    assert logger.values(f"{name}-momentum") == [(step, pytest.approx(momentum)) for step in range(4)]
    assert logger.values(f"{name}-weight_decay") == [(step, pytest.approx(decay)) for step in range(4)]
    # Off by default, as in Lightning.
    logger = _fit(tmp_path, LearningRateMonitor(), Optimized(make), epochs=1, log_every_n_steps=1)
    assert not logger.values(f"{name}-momentum") and not logger.values(f"{name}-weight_decay")


def test_log_momentum_without_momentum_logs_zero_with_lightnings_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match="log_momentum=True, but some optimizers do not have momentum"):
        logger = _fit(
            tmp_path, LearningRateMonitor(log_momentum=True), Optimized(torch.optim.Adagrad), log_every_n_steps=1
        )
    assert {value for _, value in logger.values("lr-Adagrad-momentum")} == {0.0}
