"""The hooks the loop fires: all declared on `Callback`, in Lightning's order."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import syncline.trainer as trainer_package
from syncline.callbacks import Callback
from syncline.trainer import Task, Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

HOOKS = [
    name
    for name, _ in inspect.getmembers(Callback, inspect.isfunction)
    if name.startswith(("on_", "setup", "teardown"))
]


def _recorder() -> tuple[Callback, list[str]]:
    """Return a callback overriding every hook, and the list it appends hook names to."""
    calls: list[str] = []

    def make(name: str):
        def hook(self, trainer, task, *args, **kwargs):
            calls.append(name)

        return hook

    cls = type("Recorder", (Callback,), {name: make(name) for name in HOOKS})
    return cls(), calls


def test_every_hook_the_trainer_fires_is_declared_on_callback():
    """Scan the trainer package for `Callback.<hook>` references: each must exist on the base class."""
    package_dir = Path(trainer_package.__file__).parent
    fired = set()
    for path in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Callback":
                fired.add(node.attr)
    assert {"on_train_batch_end", "on_validation_end", "on_fit_start"} <= fired  # the scan found the loop
    missing = sorted(name for name in fired if not hasattr(Callback, name))
    assert not missing, f"hooks fired but not declared on Callback: {missing}"
    # Every hook a task can override under the same name is a Callback hook too.
    task_hooks = {n for n, _ in inspect.getmembers(Task, inspect.isfunction) if n.startswith("on_")}
    assert task_hooks <= set(HOOKS), sorted(task_hooks - set(HOOKS))


def test_fit_fires_hooks_in_lightning_order():
    recorder, calls = _recorder()
    data = regression_data(16)
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=2, num_sanity_val_steps=1, callbacks=[recorder], **quiet())
    trainer.fit(Regressor(), loader(data, 8), loader(data, 8))
    train_batch = ["on_train_batch_start", "on_before_backward", "on_after_backward"]
    step = ["on_before_optimizer_step", "on_before_zero_grad"]
    val_batch = ["on_validation_batch_start", "on_validation_batch_end"]
    val_run = ["on_validation_start", "on_validation_epoch_start", *val_batch, *val_batch]
    val_run += ["on_validation_epoch_end", "on_validation_end"]
    expected = [
        "setup",
        "on_fit_start",
        "on_sanity_check_start",
        "on_validation_start",
        "on_validation_epoch_start",
        *val_batch,
        "on_validation_epoch_end",
        "on_validation_end",
        "on_sanity_check_end",
        "on_train_start",
        "on_train_epoch_start",
        *train_batch,
        "on_train_batch_end",  # first micro-batch of the window: no step
        *train_batch,
        *step,
        "on_train_batch_end",
        *val_run,
        "on_train_epoch_end",
        "on_train_end",
        "on_fit_end",
        "teardown",
    ]
    assert calls == expected


def test_task_hooks_run_before_callbacks_and_exception_hook_fires():
    order: list[str] = []

    class HookedTask(Regressor):
        def on_train_epoch_start(self):
            order.append("task")

        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    class Watcher(Callback):
        def on_train_epoch_start(self, trainer, task):
            order.append("callback")

        def on_exception(self, trainer, task, exception):
            order.append(f"exception:{exception}")

        def teardown(self, trainer, task, stage):
            order.append("teardown")

    trainer = Trainer(max_epochs=1, callbacks=[Watcher()], **quiet())
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(HookedTask(), loader(regression_data(16)))
    assert order == ["task", "callback", "exception:boom", "teardown"]


def test_validate_test_and_predict_fire_their_hooks():
    recorder, calls = _recorder()
    data = regression_data(16)
    trainer = Trainer(callbacks=[recorder], **quiet())
    task = Regressor()
    metrics = trainer.test(task, loader(data, 8))
    assert set(metrics[0]) == {"test_loss"}
    assert calls[:3] == ["setup", "on_test_start", "on_test_epoch_start"]
    assert calls[-3:] == ["on_test_epoch_end", "on_test_end", "teardown"]
    calls.clear()
    predictions = trainer.predict(task, loader(data, 8))
    assert len(predictions) == 2 and predictions[0].shape == (8, 1)
    assert calls.count("on_predict_batch_end") == 2
    expected = task(data.tensors[0][:8])
    torch.testing.assert_close(predictions[0], expected)


def test_max_steps_right_after_a_validation_within_the_epoch_does_not_validate_twice():
    class CountValidations(Callback):
        def __init__(self) -> None:
            self.after_steps: list[int] = []

        def on_validation_end(self, trainer, task) -> None:
            self.after_steps.append(trainer.global_step)

    counter = CountValidations()
    # 8 batches per epoch, validation every 3: after steps 3 and 6; max_steps=6 ends the epoch there.
    trainer = Trainer(max_steps=6, val_check_interval=3, num_sanity_val_steps=0, callbacks=[counter], **quiet())
    data = loader(regression_data(64), 8)
    trainer.fit(Regressor(), data, data)
    assert counter.after_steps == [3, 6]
