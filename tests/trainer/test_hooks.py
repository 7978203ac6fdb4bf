"""The hooks the loop fires: all declared on `Callback`, in Lightning's order."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import syncline.trainer as trainer_package
from syncline.callbacks import Callback, EarlyStopping, ModelCheckpoint
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
    # Every hook a task can override under the same name is a Callback hook too, except the batch-transfer
    # hooks, which return the batch (Lightning's DataHooks: a task's or a DataModule's, never a callback's).
    transfer = {"on_before_batch_transfer", "on_after_batch_transfer"}
    task_hooks = {n for n, _ in inspect.getmembers(Task, inspect.isfunction) if n.startswith("on_")} - transfer
    assert task_hooks <= set(HOOKS), sorted(task_hooks - set(HOOKS))


#: The task's hooks that are not callbacks' (Lightning's ModelHooks and the batch-transfer DataHooks).
TASK_HOOKS = [
    "configure_model",
    "optimizer_zero_grad",
    "backward",
    "optimizer_step",
    "configure_gradient_clipping",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
]
TRANSFER = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"]


def _hooked_task(calls: list[str], base: type[Task] = Regressor) -> Task:
    """Return a task recording every hook it receives (and its steps) as "name", before running it."""
    recorded = [*HOOKS, "configure_optimizers", "training_step", "validation_step", *TASK_HOOKS]
    recorded = [name for name in recorded if hasattr(base, name)]
    cls = type("HookedTask", (base,), {})

    def make(name: str):
        def hook(self, *args, **kwargs):
            calls.append(name)
            return getattr(super(cls, self), name)(*args, **kwargs)

        return hook

    for name in recorded:
        setattr(cls, name, make(name))
    return cls()


def _recorder_named(calls: list[str], prefix: str = "Callback.") -> Callback:
    """Return a callback recording every hook as "Callback.<hook>" into `calls`."""

    def make(name: str):
        def hook(self, trainer, task, *args, **kwargs):
            calls.append(prefix + name)

        return hook

    return type("Recorder", (Callback,), {name: make(name) for name in HOOKS})()


def _both(*names: str) -> list[str]:
    """Lightning's order for most hooks: the callbacks', then the task's."""
    return [entry for name in names for entry in (f"Callback.{name}", name)]


def _eval_run(noun: str, batches: int, step: str) -> list[str]:
    batch = [*TRANSFER, *_both(f"on_{noun}_batch_start"), step, *_both(f"on_{noun}_batch_end")]
    return [
        *_both(f"on_{noun}_start", f"on_{noun}_epoch_start"),
        *(batch * batches),
        *_both(f"on_{noun}_epoch_end", f"on_{noun}_end"),
    ]


def _train_batch(step: bool, zero_grad: bool) -> list[str]:
    """Lightning's order, except that `optimizer_step` is entered after the backward (Lightning enters it first
    and runs training_step, zero_grad and backward in its closure; docs/from_lightning.md)."""
    calls = [*TRANSFER, *_both("on_train_batch_start"), "training_step"]
    if zero_grad:
        calls += [*_both("on_before_zero_grad"), "optimizer_zero_grad"]
    calls += [*_both("on_before_backward"), "backward", *_both("on_after_backward")]
    if step:
        calls += ["optimizer_step", *_both("on_before_optimizer_step"), "configure_gradient_clipping"]
    return [*calls, *_both("on_train_batch_end")]


def test_fit_fires_every_hook_in_lightning_order(tmp_path):
    """Lightning's `test_trainer_model_hook_system_fit`, with syncline's hooks: callbacks before the task, the
    gradients reset before the window's first backward, ModelCheckpoint (a monitoring callback) after the
    task's `on_train_epoch_end`, the callbacks' `on_save_checkpoint` before the task's."""
    calls: list[str] = []
    task = _hooked_task(calls)
    data = regression_data(32)
    kwargs = quiet(max_epochs=1, accumulate_grad_batches=2, limit_train_batches=4, limit_val_batches=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    trainer = Trainer(**{**kwargs, "enable_checkpointing": True}, callbacks=[_recorder_named(calls), checkpoint])
    trainer.fit(task, loader(data, 8), loader(data, 8))
    validation = _eval_run("validation", 2, "validation_step")
    expected = [
        *_both("setup"),
        "configure_model",
        "configure_optimizers",
        *_both("on_fit_start"),
        "Callback.on_sanity_check_start",
        *validation,
        "Callback.on_sanity_check_end",
        *_both("on_train_start", "on_train_epoch_start"),
        *_train_batch(step=False, zero_grad=True),
        *_train_batch(step=True, zero_grad=False),
        *_train_batch(step=False, zero_grad=True),
        *_train_batch(step=True, zero_grad=False),
        *validation,
        *_both("on_train_epoch_end"),
        *_both("on_save_checkpoint"),  # ModelCheckpoint saves here, after the task's epoch end
        *_both("on_train_end", "on_fit_end", "teardown"),
    ]
    assert calls == expected


def test_a_task_alone_receives_its_step_hooks():
    """With no callback listening, the task's own step hooks still fire every batch (the loop decides once
    per fit which hooks to skip, after the task is bound)."""
    calls: list[str] = []
    task = _hooked_task(calls)
    Trainer(**quiet(max_epochs=1, limit_train_batches=2, limit_val_batches=0)).fit(task, loader(regression_data(16), 8))
    step_hooks = ["on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step"]
    assert [name for name in calls if name in [*step_hooks, "on_train_batch_end"]] == [
        *step_hooks,
        "on_train_batch_end",
    ] * 2


def test_step_hooks_are_decided_per_fit_with_the_callbacks_the_stage_has():
    """A callback put on `trainer.callbacks` before `fit` (as live recovery adds its step boundary) gets every
    batch's ``on_train_batch_end``; a step hook that neither a callback nor the task overrides is not fired."""
    ends: list[int] = []

    class BatchEnds(Callback):
        reads_parameters = False  # nor does any other listener here: no step in flight to land per batch

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            ends.append(batch_idx)

    trainer = Trainer(**quiet(max_epochs=1, limit_train_batches=3, limit_val_batches=0))
    trainer.callbacks = [*trainer.callbacks, BatchEnds()]
    trainer.fit(Regressor(), loader(regression_data(24), 8))
    assert ends == [0, 1, 2]
    loop = trainer.fit_loop
    assert loop.fire_batch_end is not None and not loop.batch_end_reads_parameters
    assert loop.fire_batch_start is loop.fire_before_backward is loop.fire_before_optimizer_step is None


def test_resume_restores_the_task_and_callbacks_before_configure_optimizers(tmp_path):
    """Lightning's resume order: setup, the task's on_load_checkpoint, the callbacks', configure_optimizers."""
    data = loader(regression_data(32), 8)
    first = Trainer(**{**quiet(max_epochs=1, default_root_dir=tmp_path), "enable_checkpointing": True})
    first.fit(Regressor(), data)
    calls: list[str] = []
    trainer = Trainer(**quiet(max_epochs=2), callbacks=[_recorder_named(calls)])
    trainer.fit(_hooked_task(calls), data, ckpt_path=first.checkpoint_callback.best_model_path)
    assert calls[:8] == [
        *_both("setup"),
        "configure_model",
        "on_load_checkpoint",
        "Callback.on_load_checkpoint",
        "configure_optimizers",
        *_both("on_fit_start"),
    ]
    assert trainer.current_epoch == 2 and trainer.global_step == 8


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluation_without_batches_fires_no_evaluation_hook(stage):
    """Lightning's `test_trainer_model_hook_system_eval` with 0 batches: only setup, configure_model, teardown."""
    calls: list[str] = []
    trainer = Trainer(**quiet(limit_val_batches=0), callbacks=[_recorder_named(calls)])
    empty = loader(regression_data(8), 8) if stage == "validate" else loader(regression_data(0), 8)
    assert getattr(trainer, stage)(_hooked_task(calls), empty) == []
    assert calls == [*_both("setup"), "configure_model", *_both("teardown")]


def test_monitoring_callbacks_see_what_the_task_logs_at_the_epoch_end(tmp_path):
    """As in Lightning, other callbacks run before the task's `on_train_epoch_end`, the monitoring ones
    (ModelCheckpoint, EarlyStopping) after it, so they can monitor a key the task logs there."""
    order: list[str] = []

    class Logs(Regressor):
        def on_train_epoch_end(self):
            order.append("task")
            self.log("epoch_metric", float(self.current_epoch))

    class Other(Callback):
        def on_train_epoch_end(self, trainer, task):
            order.append("other")

    class Stopper(EarlyStopping):
        def on_train_epoch_end(self, trainer, task):
            order.append("early_stopping")
            super().on_train_epoch_end(trainer, task)

    stopper = Stopper(monitor="epoch_metric", mode="min", patience=1, check_on_train_epoch_end=True)
    trainer = Trainer(**quiet(max_epochs=5), callbacks=[stopper, Other()])
    trainer.fit(Logs(), loader(regression_data(16), 8))
    assert order[:3] == ["other", "task", "early_stopping"]
    # epoch_metric rises from 0: no improvement at epoch 1, so EarlyStopping stops there; the counter then
    # advances past the stopped epoch, as Lightning's does.
    assert stopper.stopped_epoch == 1 and trainer.current_epoch == 2


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
