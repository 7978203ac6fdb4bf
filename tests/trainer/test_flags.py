"""Lightning's Trainer flags: min_epochs, min_steps, check_val_every_n_epoch, limit_test/predict_batches,
gradient_clip_algorithm, trainer.ckpt_path and trainer.interrupted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from syncline.callbacks import Callback
from syncline.options import OptionError
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class StopAlways(Callback):
    """Asks to stop after every batch, as an early stopping that has lost patience."""

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        trainer.should_stop = True


def test_min_epochs_keeps_training_whole_epochs_after_a_stop_request():
    trainer = Trainer(**quiet(max_epochs=5, min_epochs=3, callbacks=[StopAlways()]))
    trainer.fit(Regressor(), loader(regression_data(32), 8))
    # Lightning: the request is honoured once 3 epochs are done; each epoch ran its 4 batches.
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)


def test_min_steps_keeps_training_until_that_step_then_stops_at_once():
    trainer = Trainer(**quiet(max_epochs=5, min_steps=6, callbacks=[StopAlways()]))
    trainer.fit(Regressor(), loader(regression_data(32), 8))
    assert (trainer.current_epoch, trainer.global_step) == (2, 6)


def test_without_minima_a_stop_request_ends_training_after_the_batch():
    trainer = Trainer(**quiet(max_epochs=5, callbacks=[StopAlways()]))
    trainer.fit(Regressor(), loader(regression_data(32), 8))
    assert (trainer.current_epoch, trainer.global_step) == (1, 1)


class CountValidations(Callback):
    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []

    def on_validation_epoch_end(self, trainer, task):
        self.at.append((trainer.current_epoch, trainer.global_step))


@pytest.mark.parametrize(
    ("interval", "expected"), [(1.0, [(1, 8), (3, 16)]), (0.5, [(1, 6), (1, 8), (3, 14), (3, 16)])]
)
def test_check_val_every_n_epoch_validates_only_in_those_epochs(interval, expected):
    counter = CountValidations()
    trainer = Trainer(
        **quiet(max_epochs=4, check_val_every_n_epoch=2, val_check_interval=interval, num_sanity_val_steps=0),
        callbacks=[counter],
    )
    data = loader(regression_data(32), 8)
    trainer.fit(Regressor(), data, data)
    assert counter.at == expected


class Counting(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.tested = 0

    def test_step(self, batch, batch_idx):
        self.tested += 1
        return super().test_step(batch, batch_idx)


def test_limit_test_and_predict_batches_take_that_many_or_that_fraction():
    task = Counting()
    Trainer(**quiet(limit_test_batches=2)).test(task, loader(regression_data(32), 8))
    assert task.tested == 2
    predictions = Trainer(**quiet(limit_predict_batches=0.5)).predict(task, loader(regression_data(32), 8))
    assert len(predictions) == 2
    # limit_val_batches does not limit test (Lightning: each stage has its own flag).
    task.tested = 0
    Trainer(**quiet(limit_val_batches=1)).test(task, loader(regression_data(32), 8))
    assert task.tested == 4


def _clipped_reference(task: Regressor, data, clip: float) -> dict[str, torch.Tensor]:
    """One SGD step (lr 1) on the whole batch with every gradient element clamped to [-clip, clip]."""
    model = copy.deepcopy(task)
    x, y = data.tensors
    nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), clip)
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return model.state_dict()


class PlainSGD(Regressor):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_gradient_clip_algorithm_value_clamps_every_gradient_element():
    torch.manual_seed(0)
    task, data = PlainSGD(), regression_data(16)
    expected = _clipped_reference(task, data, 0.01)
    trainer = Trainer(**quiet(max_steps=1, gradient_clip_val=0.01, gradient_clip_algorithm="value"))
    trainer.fit(task, loader(data, 16))
    for name, value in task.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)


def _clip_value_distributed(rank, world_size, strategy):
    torch.manual_seed(0)
    task, data = PlainSGD(), regression_data(16)
    trainer = Trainer(**quiet(max_steps=1, strategy=strategy, gradient_clip_val=0.01, gradient_clip_algorithm="value"))
    trainer.fit(task, loader(data, 8))  # 8 per rank: the global batch of 16
    return {name: value.clone() for name, value in task.state_dict().items()}


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "sharded_parameter_server"])
def test_gradient_clip_by_value_on_two_processes_equals_one_process_on_the_global_batch(strategy):
    torch.manual_seed(0)
    expected = _clipped_reference(PlainSGD(), regression_data(16), 0.01)
    for state in run_distributed(_clip_value_distributed, world_size=2, args=(strategy,), timeout=120):
        for name, value in state.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)


def test_trainer_ckpt_path_is_the_checkpoint_the_stage_loaded(tmp_path):
    trainer = Trainer(**quiet(max_epochs=1))
    task = Regressor()
    trainer.fit(task, loader(regression_data(16), 8))
    assert trainer.ckpt_path is None
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    trainer.test(task, loader(regression_data(16), 8), ckpt_path=tmp_path / "a.ckpt")
    assert trainer.ckpt_path == str(tmp_path / "a.ckpt")


class Interrupt(Callback):
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        raise KeyboardInterrupt


def test_trainer_interrupted_after_ctrl_c_and_reset_by_the_next_stage():
    trainer = Trainer(**quiet(max_epochs=1, callbacks=[Interrupt()]))
    task = Regressor()
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(task, loader(regression_data(16), 8))
    assert trainer.interrupted is True
    trainer.test(task, loader(regression_data(16), 8))
    assert trainer.interrupted is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gradient_clip_algorithm": "max"}, r"gradient_clip_algorithm must be one of norm, value"),
        ({"check_val_every_n_epoch": 0}, r"check_val_every_n_epoch"),
        ({"min_epochs": -1}, r"min_epochs"),
        ({"limit_test_batches": 1.5}, r"limit_test_batches=1.5"),
    ],
)
def test_bad_flag_values_are_named(kwargs, match):
    with pytest.raises(OptionError, match=match):
        Trainer(**quiet(**kwargs))
