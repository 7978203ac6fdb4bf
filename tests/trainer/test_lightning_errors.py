"""Where Lightning 2.x raises or warns, syncline does too; its MisconfigurationException is caught by that name.

Each case states Lightning's behaviour (its source: trainer/setup.py, loops/utilities.py, trainer/call.py,
callbacks/model_checkpoint.py, core/module.py, trainer/configuration_validator.py).
"""

from __future__ import annotations

import pytest
import torch

from syncline import MisconfigurationException, Trainer
from syncline.callbacks import Callback, ModelCheckpoint
from syncline.options import OptionError
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


def test_misconfiguration_exception_is_importable_and_catches_option_errors():
    # A Lightning program's `except MisconfigurationException` catches a bad Trainer option.
    assert issubclass(OptionError, MisconfigurationException)
    with pytest.raises(MisconfigurationException):
        Trainer(**quiet(check_val_every_n_epoch=0))


def test_max_epochs_unset_warns_and_means_1000_unless_steps_or_time_limit_training():
    with pytest.warns(UserWarning, match=r"`max_epochs` was not set. Setting it to 1000 epochs"):
        assert Trainer(**quiet()).max_epochs == 1000
    assert Trainer(**quiet(max_steps=5)).max_epochs == -1
    assert Trainer(**quiet(max_time="00:00:01:00")).max_epochs == -1
    assert Trainer(**quiet(max_epochs=3)).max_epochs == 3


@pytest.mark.parametrize(
    ("limit", "said"),
    [(1, "1 batch per epoch will be used"), (1.0, "100% of the batches per epoch will be used")],
)
def test_limit_of_one_says_what_it_means(capsys, limit, said):
    Trainer(**quiet(max_epochs=1, limit_train_batches=limit))
    assert f"`Trainer(limit_train_batches={limit})` was configured so {said}." in capsys.readouterr().err


def test_a_missing_checkpoint_is_a_file_not_found_error(tmp_path):
    trainer = Trainer(**quiet(max_epochs=1))
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        trainer.fit(Regressor(), loader(regression_data(16)), ckpt_path=str(tmp_path / "non_existing.ckpt"))
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: not existing"):
        trainer.fit(Regressor(), loader(regression_data(16)), ckpt_path="not existing")


class Counter(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}


def test_resume_without_a_callback_whose_state_the_checkpoint_holds_warns(tmp_path):
    trainer = Trainer(**quiet(max_epochs=1, callbacks=[Counter()]))
    trainer.fit(Regressor(), loader(regression_data(16)))
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    resumed = Trainer(**quiet(max_epochs=2))
    with pytest.warns(UserWarning, match=r"Please add the following callbacks: \['Counter'\]"):
        resumed.fit(Regressor(), loader(regression_data(16)), ckpt_path=tmp_path / "a.ckpt")


def test_a_changed_checkpoint_directory_warns_on_resume(tmp_path):
    first = ModelCheckpoint(dirpath=tmp_path / "a", save_last=True)
    Trainer(**quiet(max_epochs=1, enable_checkpointing=True, callbacks=[first])).fit(
        Regressor(), loader(regression_data(16))
    )
    moved = ModelCheckpoint(dirpath=tmp_path / "b")
    trainer = Trainer(**quiet(max_epochs=2, enable_checkpointing=True, callbacks=[moved]))
    with pytest.warns(UserWarning, match="directory changed from"):
        trainer.fit(Regressor(), loader(regression_data(16)), ckpt_path=first.last_model_path)


class LogsIn(Regressor):
    def __init__(self, hook: str, value=1.0, **options) -> None:
        super().__init__()
        self.hook, self.value, self.options = hook, value, options

    def on_fit_start(self):
        if self.hook == "on_fit_start":
            self.log("x", self.value, **self.options)

    def training_step(self, batch, batch_idx):
        if self.hook == "training_step":
            self.log("x", self.value, **self.options)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        if self.hook == "on_train_epoch_end":
            self.log("x", self.value, **self.options)


@pytest.mark.parametrize(
    ("hook", "value", "options", "error", "match"),
    [
        ("on_fit_start", 1.0, {}, MisconfigurationException, "cannot be called in on_fit_start"),
        ("on_train_epoch_end", 1.0, {"on_step": True}, MisconfigurationException, "on_step=True"),
        ("training_step", 1.0, {"on_step": False, "on_epoch": False}, MisconfigurationException, "logs nothing"),
        ("training_step", 1.0, {"reduce_fx": "median"}, MisconfigurationException, "reduce_fx='median'"),
        ("training_step", "text", {}, ValueError, "`str` values cannot be logged"),
        ("training_step", {"a": 1.0}, {}, ValueError, "nested dictionaries cannot be logged"),
        ("training_step", torch.ones(2), {}, ValueError, "log scalars only"),
    ],
)
def test_self_log_refuses_what_lightning_refuses(hook, value, options, error, match):
    with pytest.raises(error, match=match):
        Trainer(**quiet(max_epochs=1)).fit(LogsIn(hook, value, **options), loader(regression_data(16)))


def test_self_log_outside_a_trainer_warns_and_records_nothing():
    task = Regressor()
    with pytest.warns(UserWarning, match="outside a Trainer records nothing"):
        task.log("x", 1.0)


def test_val_check_interval_longer_than_the_epoch_is_refused():
    trainer = Trainer(**quiet(max_epochs=1, val_check_interval=5))
    with pytest.raises(ValueError, match=r"`val_check_interval` \(5\) must be less than or equal to the number"):
        trainer.fit(Regressor(), loader(regression_data(16)), loader(regression_data(8)))
    # Without validation data there is nothing to schedule, and Lightning lets it pass.
    Trainer(**quiet(max_epochs=1, val_check_interval=5)).fit(Regressor(), loader(regression_data(16)))


class NoEvalSteps(Regressor):
    validation_step = None
    test_step = None


def test_validation_step_none_switches_validation_off_and_refuses_validate_and_test():
    trainer = Trainer(**quiet(max_epochs=1))
    with pytest.warns(UserWarning, match="have no `validation_step`. Skipping val loop."):
        trainer.fit(NoEvalSteps(), loader(regression_data(16)), loader(regression_data(8)))
    assert trainer.num_val_batches == []
    with pytest.raises(MisconfigurationException, match=r"No `validation_step\(\)` method defined"):
        trainer.validate(NoEvalSteps(), loader(regression_data(8)))
    with pytest.raises(MisconfigurationException, match=r"No `test_step\(\)` method defined to run `Trainer.test`"):
        trainer.test(NoEvalSteps(), loader(regression_data(8)))
