"""`Task.configure_callbacks()`, as Lightning 2.x merges it: the task's callbacks join the Trainer's at the start of
every stage, each replacing the Trainer's callbacks of exactly its type, with ModelCheckpoints last."""

from __future__ import annotations

import pytest

from syncline.callbacks import Callback, EarlyStopping, ModelCheckpoint
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class Counting(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.batches += 1


class Other(Callback):
    pass


class Configured(Regressor):
    def __init__(self, returned) -> None:
        super().__init__()
        self.returned = returned

    def configure_callbacks(self):
        return self.returned


def _trainer(tmp_path, callbacks) -> Trainer:
    return Trainer(**quiet(max_epochs=1, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=tmp_path))


def test_the_tasks_callbacks_replace_the_trainers_of_the_same_type_and_checkpoints_run_last(tmp_path):
    trainer_stopping, trainer_counting, other = EarlyStopping(monitor="val_loss"), Counting(), Other()
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    task_stopping, task_counting = EarlyStopping(monitor="train_loss"), Counting()
    trainer = Trainer(
        **quiet(max_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path, enable_checkpointing=True),
        callbacks=[trainer_stopping, checkpoint, trainer_counting, other],
    )
    trainer.fit(Configured([task_counting, task_stopping]), loader(regression_data(32), 8))
    assert trainer.callbacks == [other, task_counting, task_stopping, checkpoint]
    # The task's callbacks receive the hooks; the replaced ones do not.
    assert task_counting.batches == 4 and trainer_counting.batches == 0


def test_one_callback_alone_is_added_and_a_subclass_replaces_nothing(tmp_path):
    """Replacement is by exact type: a task's `Counting` subclass joins beside the Trainer's `Counting`."""

    class Louder(Counting):
        pass

    counting, louder = Counting(), Louder()
    trainer = _trainer(tmp_path, [counting])
    trainer.fit(Configured(louder), loader(regression_data(32), 8))
    assert trainer.callbacks == [counting, louder]
    assert counting.batches == louder.batches == 4


def test_every_stage_asks_the_task_again(tmp_path):
    """Lightning attaches the task's callbacks in every stage (fit, validate, test, predict): a second stage's
    callback of the same type replaces the first one's."""
    returned = []

    class Fresh(Regressor):
        def configure_callbacks(self):
            returned.append(Counting())
            return returned[-1]

    trainer = _trainer(tmp_path, [])
    task = Fresh()
    trainer.fit(task, loader(regression_data(32), 8))
    trainer.validate(task, loader(regression_data(16), 8))
    assert len(returned) == 2 and trainer.callbacks == [returned[1]]


def test_something_that_is_not_a_callback_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"Configured.configure_callbacks\(\) must return Callback instances, got int"):
        _trainer(tmp_path, []).fit(Configured([1]), loader(regression_data(32), 8))
