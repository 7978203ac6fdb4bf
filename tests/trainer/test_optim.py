"""`configure_optimizers`: every form Lightning 2.x accepts, `Task.optimizers()` and `Task.lr_schedulers()`."""

from __future__ import annotations

import pytest
import torch

from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


def _sgd(task):
    return torch.optim.SGD(task.parameters(), lr=0.1)


def _halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


#: Each form returns SGD(lr=0.1) with a StepLR that halves the rate every epoch.
FORMS = {
    "tuple of lists": lambda t, o, s: ([o], [s]),
    "list and a scheduler": lambda t, o, s: ([o], s),
    "dict with a scheduler": lambda t, o, s: {"optimizer": o, "lr_scheduler": s},
    "dict with a scheduler dict": lambda t, o, s: {
        "optimizer": o,
        "lr_scheduler": {"scheduler": s, "interval": "epoch", "frequency": 1, "name": "halving", "strict": True},
    },
    "list of dicts": lambda t, o, s: [{"optimizer": o, "lr_scheduler": s}],
}


class Formed(Regressor):
    def __init__(self, form=None, schedulers: int = 1) -> None:
        super().__init__()
        self.form, self.schedulers = form, schedulers
        self.seen: dict[str, object] = {}

    def configure_optimizers(self):
        optimizer = _sgd(self)
        if self.form is None:
            return optimizer
        return self.form(self, optimizer, _halving(optimizer))

    def training_step(self, batch, batch_idx):
        self.seen = {"optimizers": self.optimizers(), "lr_schedulers": self.lr_schedulers()}
        return super().training_step(batch, batch_idx)


def _fit(task, epochs: int = 3, **kwargs):
    torch.manual_seed(0)
    Trainer(**quiet(max_epochs=epochs, num_sanity_val_steps=0, **kwargs)).fit(task, loader(regression_data(32), 8))
    return task


def _weights(form) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return _fit(Formed(form)).state_dict()


@pytest.mark.parametrize("name", list(FORMS))
def test_every_scheduler_form_trains_as_the_dict_form_and_halves_the_rate_each_epoch(name):
    task = _fit(Formed(FORMS[name]))
    optimizer = task.seen["optimizers"]
    assert isinstance(optimizer, torch.optim.SGD)  # Lightning's shape: the one optimizer, not a list
    assert isinstance(task.seen["lr_schedulers"], torch.optim.lr_scheduler.StepLR)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3, rel=0, abs=1e-12)
    reference = _weights(FORMS["dict with a scheduler"])
    for key, value in _weights(FORMS[name]).items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0)


@pytest.mark.parametrize("form", [None, lambda t, o, s: [o], lambda t, o, s: {"optimizer": o}])
def test_an_optimizer_alone_in_any_form_keeps_its_rate_and_lr_schedulers_is_none(form):
    task = _fit(Formed(form))
    assert task.seen["lr_schedulers"] is None
    assert task.seen["optimizers"].param_groups[0]["lr"] == 0.1


def test_lr_schedulers_is_a_list_with_several_and_both_step():
    def two(task, optimizer, scheduler):
        return [optimizer], [scheduler, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)]

    task = _fit(Formed(two), epochs=2)
    schedulers = task.seen["lr_schedulers"]
    assert isinstance(schedulers, list) and len(schedulers) == 2
    assert task.seen["optimizers"].param_groups[0]["lr"] == pytest.approx(0.1 * (0.5 * 0.1) ** 2, rel=1e-12)


def test_step_interval_with_a_frequency_steps_every_that_many_optimizer_steps():
    def every_two_steps(task, optimizer, scheduler):
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}

    task = _fit(Formed(every_two_steps), epochs=2)  # 8 steps: 4 halvings
    assert task.seen["optimizers"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4, rel=0, abs=1e-12)


class Plateau(Regressor):
    def __init__(self, monitor_at_top: bool, monitor: str = "train_loss", strict: bool = True) -> None:
        super().__init__()
        self.monitor_at_top, self.monitor, self.strict = monitor_at_top, monitor, strict

    def configure_optimizers(self):
        optimizer = _sgd(self)
        # threshold=10 (relative): a value improves only below best * (1 - 10), which no loss is, so with
        # patience=0 every step (one per epoch, with the monitored value) halves the rate.
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=10)
        if self.monitor_at_top:
            return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": self.monitor}
        scheduler = {"scheduler": plateau, "monitor": self.monitor, "strict": self.strict}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


@pytest.mark.parametrize("monitor_at_top", [True, False])
def test_reduce_on_plateau_reads_the_monitor_beside_the_optimizer_or_in_its_dict(monitor_at_top):
    task = _fit(Plateau(monitor_at_top), epochs=3)
    assert task.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3, rel=0, abs=1e-12)


def test_a_missing_monitor_is_an_error_when_strict_and_a_skipped_step_otherwise():
    with pytest.raises(KeyError, match=r"monitors 'nope', which was not logged.*'strict': False"):
        _fit(Plateau(False, "nope"), epochs=1)
    with pytest.warns(UserWarning, match=r"monitors 'nope', which was not logged, and strict is False"):
        task = _fit(Plateau(False, "nope", strict=False), epochs=2)
    assert task.trainer.optimizers[0].param_groups[0]["lr"] == 0.1


def _returning(value):
    class Returning(Regressor):
        def configure_optimizers(self):
            return value(self)

    return Returning()


@pytest.mark.parametrize(
    "value",
    [
        lambda t: [_sgd(t), _sgd(t)],
        lambda t: ([_sgd(t), _sgd(t)], []),
        lambda t: [{"optimizer": _sgd(t)}, {"optimizer": _sgd(t)}],
    ],
    ids=["list", "tuple of lists", "list of dicts"],
)
def test_several_optimizers_are_refused_as_lightning_refuses_them_without_manual_optimization(value):
    with pytest.raises(RuntimeError, match=r"returned 2 optimizers.*only supported with manual optimization.*= False"):
        _fit(_returning(value), epochs=1)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (lambda t: None, TypeError, r"returned NoneType; return one of: an optimizer; a list of optimizers"),
        (lambda t: [torch.nn.Linear(1, 1)], TypeError, r"returned Linear where a torch.optim.Optimizer belongs"),
        (lambda t: {"optimizer": _sgd(t), "scheduler": 1}, ValueError, r"needs 'optimizer' and may have"),
        (
            lambda t: {"optimizer": _sgd(t), "lr_scheduler": {"scheduler": _halving(_sgd(t)), "every": 2}},
            ValueError,
            r"An lr_scheduler dict needs 'scheduler' and may have 'interval', 'frequency', 'monitor', 'strict'",
        ),
        (
            lambda t: {"optimizer": _sgd(t), "lr_scheduler": {"scheduler": _halving(_sgd(t)), "frequency": 0}},
            ValueError,
            r"frequency must be an int >= 1, got 0",
        ),
        (
            lambda t: {"optimizer": _sgd(t), "lr_scheduler": _halving(_sgd(t))},
            ValueError,
            r"a StepLR is attached to an optimizer that was not returned",
        ),
        (
            lambda t: {"optimizer": (o := _sgd(t)), "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o)},
            ValueError,
            r"ReduceLROnPlateau needs a metric",
        ),
    ],
)
def test_bad_configure_optimizers_output_names_the_problem_and_the_forms(value, error, match):
    with pytest.raises(error, match=match):
        _fit(_returning(value), epochs=1)


def test_optimizers_outside_a_trainer_names_the_problem():
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        Regressor().optimizers()


class Recorded(Plateau):
    """Records every `lr_scheduler_step` call: (the scheduler's class, the metric it was given)."""

    def __init__(self) -> None:
        super().__init__(monitor_at_top=False)
        self.calls: list[tuple[str, object]] = []

    def configure_optimizers(self):
        config = super().configure_optimizers()
        steps = torch.optim.lr_scheduler.StepLR(config["optimizer"], step_size=1, gamma=0.9)
        return [config["optimizer"]], [config["lr_scheduler"], {"scheduler": steps, "interval": "step"}]

    def lr_scheduler_step(self, scheduler, metric):
        self.calls.append((type(scheduler).__name__, metric))
        super().lr_scheduler_step(scheduler, metric)


def test_lr_scheduler_step_receives_every_due_scheduler_with_the_monitored_value_or_none():
    """Lightning's hook: called for each scheduler when it is due, with the monitored metric (the logged tensor,
    as `callback_metrics` holds it) for ReduceLROnPlateau and None for the others; the default steps them as
    before (the rate halves each epoch, and StepLR's 0.9 applies every step)."""
    task = _fit(Recorded(), epochs=2)
    steps = [metric for name, metric in task.calls if name == "StepLR"]
    plateau = [metric for name, metric in task.calls if name == "ReduceLROnPlateau"]
    assert steps == [None] * 8  # 4 batches, 2 epochs
    assert len(plateau) == 2 and all(isinstance(m, torch.Tensor) and m.dim() == 0 for m in plateau)
    assert task.optimizers().param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**8 * 0.5**2, rel=1e-12)


class Countdown:
    """A scheduler outside torch's API: `tick()` instead of `step()`, with a state."""

    def __init__(self, optimizer) -> None:
        self.optimizer, self.ticks = optimizer, 0

    def tick(self) -> None:
        self.ticks += 1
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5

    def state_dict(self):
        return {"ticks": self.ticks}

    def load_state_dict(self, state) -> None:
        self.ticks = state["ticks"]


def test_a_scheduler_of_another_api_needs_lr_scheduler_step_overridden():
    """As Lightning: a scheduler that is not torch's is refused unless the task overrides `lr_scheduler_step`
    (then that hook steps it), and one without state_dict/load_state_dict is refused always."""

    class Custom(Regressor):
        def configure_optimizers(self):
            optimizer = _sgd(self)
            return {"optimizer": optimizer, "lr_scheduler": Countdown(optimizer)}

    class Stepped(Custom):
        def lr_scheduler_step(self, scheduler, metric):
            scheduler.tick()

    with pytest.raises(TypeError, match=r"Countdown .* is not one of torch's .*override Custom.lr_scheduler_step"):
        _fit(Custom(), epochs=1)
    task = _fit(Stepped(), epochs=2)
    assert task.lr_schedulers().ticks == 2 and task.optimizers().param_groups[0]["lr"] == 0.1 * 0.5**2

    class Stateless(Stepped):
        def configure_optimizers(self):
            return {"optimizer": _sgd(self), "lr_scheduler": object()}

    with pytest.raises(TypeError, match=r"the lr scheduler object, which checkpoints cannot keep"):
        _fit(Stateless(), epochs=1)
