"""The Trainer's and the Task's public surface that a Lightning script reads, with Lightning 2.x's values.

Lightning's sources for each: trainer/trainer.py (properties), trainer/states.py (fn, stage, status),
trainer/call.py (the exception path), core/module.py (the task's properties, freeze/unfreeze).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from syncline import Trainer
from syncline.callbacks import Callback, EarlyStopping, ModelSummary, ProgressBar
from syncline.trainer import DataModule
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class Observer(Callback):
    """Record what the Trainer says about itself at each point of a run."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple] = {}

    def _note(self, trainer, where):
        state = trainer.state
        self.seen[where] = (
            state.fn,
            state.stage,
            state.status,
            trainer.training,
            trainer.validating,
            trainer.sanity_checking,
            trainer.testing,
            trainer.predicting,
            trainer.evaluating,
        )

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        self._note(trainer, "train_batch")

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.seen.setdefault("last_batch", []).append(trainer.is_last_batch)

    def on_validation_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self._note(trainer, "sanity_batch" if trainer.sanity_checking else "val_batch")

    def on_test_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self._note(trainer, "test_batch")

    def on_predict_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self._note(trainer, "predict_batch")


def test_state_fn_stage_and_status_through_every_stage():
    observer = Observer()
    trainer = Trainer(**quiet(max_epochs=1, num_sanity_val_steps=1, callbacks=[observer]))
    assert (trainer.state.fn, trainer.state.stage, trainer.state.status) == (None, None, "initializing")
    task = Regressor()
    trainer.fit(task, loader(regression_data(24)), loader(regression_data(8)))
    assert trainer.state.finished and trainer.state.stopped and not trainer.interrupted
    # After a stage Lightning keeps fn and clears the running stage.
    assert (trainer.state.fn, trainer.state.stage) == ("fit", None)
    trainer.test(task, loader(regression_data(8)))
    trainer.predict(task, loader(regression_data(8)))
    seen = observer.seen
    flags = ("training", "validating", "sanity_checking", "testing", "predicting", "evaluating")
    assert seen["train_batch"] == ("fit", "train", "running", *_only("training", flags))
    assert seen["sanity_batch"] == ("fit", "sanity_check", "running", *_only("sanity_checking", flags))
    assert seen["val_batch"] == ("fit", "validate", "running", *_only("validating", flags, "evaluating"))
    assert seen["test_batch"] == ("test", "test", "running", *_only("testing", flags, "evaluating"))
    assert seen["predict_batch"] == ("predict", "predict", "running", *_only("predicting", flags))
    assert seen["last_batch"] == [False, False, True]


def _only(name, flags, also=None):
    return tuple(flag in (name, also) for flag in flags)


def test_trainer_properties_a_lightning_script_reads(tmp_path, capsys):
    stopper = EarlyStopping("val_loss", patience=3)
    trainer = Trainer(
        max_epochs=2,
        accumulate_grad_batches=2,
        default_root_dir="~/runs-not-written",
        logger=False,
        enable_checkpointing=False,
        callbacks=[stopper],
    )
    assert trainer.default_root_dir == os.path.expanduser("~/runs-not-written")
    assert trainer.early_stopping_callback is stopper and trainer.early_stopping_callbacks == [stopper]
    assert isinstance(trainer.progress_bar_callback, ProgressBar)
    assert (trainer.local_rank, trainer.node_rank, trainer.num_nodes, trainer.num_devices) == (0, 0, 1, 1)
    assert trainer.model is None
    steps = []

    class Estimating(Regressor):
        def configure_optimizers(self):
            steps.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    task = Estimating()
    trainer.fit(task, loader(regression_data(40)), loader(regression_data(8)))  # 5 batches an epoch
    assert steps == [2 * math.ceil(5 / 2)]
    assert trainer.model is task and trainer.enable_validation
    trainer.print("from rank zero")
    assert "from rank zero" in capsys.readouterr().out
    trainer.test(task, loader(regression_data(8)))
    assert len(trainer.test_dataloaders) == 1
    assert Trainer(**quiet(max_steps=7)).estimated_stepping_batches == 7
    assert Trainer(**quiet(max_epochs=-1)).estimated_stepping_batches == float("inf")


class Interrupting(Callback):
    def __init__(self, error: BaseException) -> None:
        self.error, self.seen = error, None

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        raise self.error

    def on_exception(self, trainer, task, exception):
        self.seen = exception


class Data(DataModule):
    def __init__(self) -> None:
        super().__init__()
        self.exceptions = []

    def train_dataloader(self):
        return loader(regression_data(16))

    def on_exception(self, exception):
        self.exceptions.append(exception)


class TaskSeesExceptions(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.exceptions = []

    def on_exception(self, exception):
        self.exceptions.append(exception)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")])
def test_an_exception_reaches_on_exception_of_callbacks_task_and_datamodule_and_leaves_interrupted(error):
    callback, data, task = Interrupting(error), Data(), TaskSeesExceptions()
    trainer = Trainer(**quiet(max_epochs=1, callbacks=[callback]))
    with pytest.raises(type(error)):
        trainer.fit(task, datamodule=data)
    assert callback.seen is error and data.exceptions == [error] and task.exceptions == [error]
    # Lightning: any exception leaves the status "interrupted"; the next stage that ends resets it.
    assert trainer.interrupted and trainer.state.status == "interrupted" and not trainer.state.finished
    trainer.test(Regressor(), loader(regression_data(8)))
    assert not trainer.interrupted and trainer.state.finished


def test_model_summary_is_printed_at_fit_start_unless_switched_off(capsys):
    options = quiet(max_epochs=1)
    options.pop("enable_model_summary")
    Trainer(**options).fit(Regressor(), loader(regression_data(16)))
    printed = capsys.readouterr().err
    assert "| Name | Type       | Params | Mode" in printed
    assert "0 | net  | Sequential | 161    | train" in printed
    assert "161       Total params" in printed and "5         Modules in train mode" in printed
    Trainer(**options, enable_model_summary=False).fit(Regressor(), loader(regression_data(16)))
    assert "Total params" not in capsys.readouterr().err
    # A summary callback the user passed is kept, at its depth.
    Trainer(**options, enable_model_summary=False, callbacks=[ModelSummary(max_depth=-1)]).fit(
        Regressor(), loader(regression_data(16))
    )
    assert "3 | net.2 | Dropout    | 0      | train" in capsys.readouterr().err


def test_detect_anomaly_names_the_backward_that_made_a_nan():
    class MakesNaN(Regressor):
        def training_step(self, batch, batch_idx):
            # A finite loss whose backward divides 0 by 0: sqrt's gradient at 0, times 0.
            return super().training_step(batch, batch_idx) + 0 * torch.sqrt(self.net[0].weight.sum() * 0)

    with pytest.raises(RuntimeError, match="returned nan values"):
        Trainer(**quiet(max_epochs=1, detect_anomaly=True)).fit(MakesNaN(), loader(regression_data(8)))


def test_inference_mode_evaluates_under_inference_mode():
    modes = []

    class Probe(Regressor):
        def validation_step(self, batch, batch_idx):
            modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    for flag in (True, False):
        Trainer(**quiet(inference_mode=flag)).validate(Probe(), loader(regression_data(8)))
    assert modes == [(True, False), (False, False)]


def test_task_surface_outside_and_inside_a_trainer():
    task = Regressor()
    assert task.logger is None and task.loggers == [] and task.local_rank == 0
    with pytest.raises(RuntimeError, match="is not attached to a `Trainer`"):
        task.trainer  # noqa: B018
    trainer = Trainer(**quiet(max_epochs=1))
    outer = Regressor()
    outer.inner = Regressor()
    outer.trainer = trainer  # settable, and passed to nested tasks, as in Lightning
    assert outer.trainer is trainer and outer.inner.trainer is trainer
    outer.trainer = None
    assert outer.logger is None


def test_freeze_and_unfreeze():
    task = Regressor()
    task.freeze()
    assert not task.training and not any(p.requires_grad for p in task.parameters())
    task.unfreeze()
    assert task.training and all(p.requires_grad for p in task.parameters())


def test_default_predict_step_takes_lightnings_arguments():
    class Forward(Regressor):
        predict_step = Regressor.__base__.predict_step

        def forward(self, batch):
            return self.net(batch[0])

    task = Forward()
    batch = regression_data(4).tensors
    torch.testing.assert_close(task.predict_step(batch, 0, dataloader_idx=0), task.net(batch[0]))


def test_reload_dataloaders_every_n_epochs_asks_for_new_loaders():
    asked = []

    class Counting(Regressor):
        def train_dataloader(self):
            asked.append(("train", self.trainer.current_epoch))
            return loader(regression_data(16))

        def val_dataloader(self):
            asked.append(("val", self.trainer.current_epoch))
            return loader(regression_data(8))

    Trainer(**quiet(max_epochs=5, reload_dataloaders_every_n_epochs=2, num_sanity_val_steps=0)).fit(Counting())
    assert asked == [(kind, epoch) for epoch in (0, 2, 4) for kind in ("train", "val")]


def test_ignore_in_a_subclass_drops_what_the_parent_saved():
    class Parent(Regressor):
        def __init__(self, lr: float = 0.1, features: int = 8) -> None:
            super().__init__(lr=lr, features=features)
            self.save_hyperparameters()

    class Child(Parent):
        def __init__(self, lr: float = 0.2, features: int = 8, note: str = "x") -> None:
            super().__init__(lr=lr, features=features)
            self.save_hyperparameters(ignore=["lr"])

    assert dict(Child().hparams) == {"features": 8, "note": "x"}


def test_hparams_yaml_holds_namespaces_classes_and_complex_numbers_as_lightning_can(tmp_path):
    from argparse import Namespace

    import yaml

    from syncline.callbacks import CSVLogger

    class Odd(Regressor):
        def __init__(self, opts=Namespace(depth=2), kind=torch.optim.SGD, z=1 + 2j) -> None:  # noqa: B008
            super().__init__()
            self.save_hyperparameters()

    logger = CSVLogger(tmp_path)
    Trainer(**quiet(max_epochs=1, logger=logger)).fit(Odd(), loader(regression_data(8)))
    saved = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert saved == {"opts": {"depth": 2}, "kind": "<class 'torch.optim.sgd.SGD'>", "z": "(1+2j)"}


def test_a_mock_callback_sees_the_same_calls_as_a_real_one():
    from unittest.mock import Mock

    from syncline.callbacks import Callback

    trainer_mock, task_mock = Mock(spec=Callback), Mock(spec=Callback)

    class Configured(Regressor):
        def configure_callbacks(self):
            return [task_mock]

    trainer = Trainer(**quiet(fast_dev_run=True, callbacks=[trainer_mock]))
    trainer.fit(Configured(), loader(regression_data(8)), loader(regression_data(8)))
    assert trainer.callbacks[-1] is task_mock
    called = [call[0] for call in trainer_mock.method_calls]
    assert called[:2] == ["setup", "on_fit_start"] and "on_train_batch_end" in called and called[-1] == "teardown"
    assert [call[0] for call in task_mock.method_calls] == called


def test_check_val_every_n_epoch_none_counts_batches_across_epochs():
    from syncline import MisconfigurationException

    seen = []

    class Recording(Regressor):
        def on_validation_start(self):
            seen.append(self.trainer.global_step)

    # 3 batches an epoch, validation every 5 batches of the whole run: after steps 5 and 10, the second
    # inside epoch 3 (Lightning's total batch index), and never at an epoch's end otherwise.
    trainer = Trainer(**quiet(max_epochs=4, val_check_interval=5, check_val_every_n_epoch=None, num_sanity_val_steps=0))
    trainer.fit(Recording(), loader(regression_data(24)), loader(regression_data(8)))
    assert seen == [5, 10]
    with pytest.raises(MisconfigurationException, match="val_check_interval must be an int"):
        Trainer(**quiet(check_val_every_n_epoch=None, val_check_interval=0.5))
