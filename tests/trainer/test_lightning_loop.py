"""The loop as Lightning 2.x runs it: epoch counter, scheduler steps, module modes, flags and stages after fit.

Each test states a behaviour of Lightning's (its fit loop, training epoch loop, evaluation loop and
checkpoint connector), written from its source and documentation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.callbacks import Callback, ModelCheckpoint
from syncline.checkpoint_file import load_checkpoint
from syncline.options import OptionError
from syncline.strategies import NativeDDP
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class EpochScheduled(Regressor):
    """A Regressor whose SGD rate halves every epoch (StepLR, interval "epoch")."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class Seen(Callback):
    """Record the epoch counter and the learning rate where Lightning users look at them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, float]] = []

    def _record(self, event: str, trainer: Trainer) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
        self.events.append((event, trainer.current_epoch, lr))

    def on_train_epoch_start(self, trainer, task):
        self._record("epoch_start", trainer)

    def on_validation_end(self, trainer, task):
        if not trainer.sanity_checking:
            self._record("validation_end", trainer)

    def on_train_epoch_end(self, trainer, task):
        self._record("epoch_end", trainer)


# ---------------------------------------------------------------- item 1: the epoch counter
def test_current_epoch_counts_finished_epochs_as_in_lightning():
    """Lightning's `current_epoch` is the index of the epoch in progress, advanced once it has ended."""
    seen = Seen()
    trainer = Trainer(**quiet(max_epochs=3), callbacks=[seen])
    trainer.fit(Regressor(), loader(regression_data(16), 8))
    assert [epoch for event, epoch, _ in seen.events if event == "epoch_end"] == [0, 1, 2]
    assert trainer.current_epoch == 3 and trainer.global_step == 6


def test_max_epochs_minus_one_means_no_epoch_limit():
    trainer = Trainer(**quiet(max_epochs=-1, max_steps=7))
    trainer.fit(Regressor(), loader(regression_data(16), 8))
    assert trainer.global_step == 7 and trainer.current_epoch == 3
    with pytest.raises(OptionError, match="max_epochs must be None or an int >= -1"):
        Trainer(max_epochs=-2)


def test_a_checkpoint_at_the_epoch_end_records_lightnings_epoch_and_step(tmp_path):
    """Saved in `on_train_epoch_end` of epoch 0, a checkpoint says epoch 0 (the counter has not advanced)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    trainer = Trainer(**{**quiet(max_epochs=2), "enable_checkpointing": True}, callbacks=[checkpoint])
    trainer.fit(Regressor(), loader(regression_data(16), 8))
    saved = sorted(load_checkpoint(path)["epoch"] for path in checkpoint.best_k_models)
    assert saved == [0, 1]
    assert {p.name for p in tmp_path.iterdir()} == {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"}


# ---------------------------------------------------------------- item 11: epoch-interval schedulers
def test_epoch_schedulers_step_with_the_epochs_last_step():
    """Lightning steps non-plateau epoch schedulers right after the epoch's last optimizer step, so the epoch-end
    validation, the epoch-end hooks (and a checkpoint saved there) see the new rate."""
    seen = Seen()
    trainer = Trainer(**quiet(max_epochs=2, num_sanity_val_steps=0), callbacks=[seen])
    data = loader(regression_data(16), 8)
    trainer.fit(EpochScheduled(), data, data)
    assert seen.events == [
        ("epoch_start", 0, 0.1),
        ("validation_end", 0, 0.05),
        ("epoch_end", 0, 0.05),
        ("epoch_start", 1, 0.05),
        ("validation_end", 1, 0.025),
        ("epoch_end", 1, 0.025),
    ]


def test_a_checkpoint_saved_at_the_epoch_end_holds_the_stepped_scheduler(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    trainer = Trainer(**{**quiet(max_epochs=1), "enable_checkpointing": True}, callbacks=[checkpoint])
    trainer.fit(EpochScheduled(), loader(regression_data(16), 8))
    saved = load_checkpoint(checkpoint.best_model_path)
    assert saved["lr_schedulers"][0]["last_epoch"] == 1
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.05)


def test_plateau_schedulers_step_after_the_epoch_end_hooks_with_the_epochs_metric():
    """ReduceLROnPlateau (interval "epoch") steps after `on_train_epoch_end`, reading the metric logged there."""

    class Plateau(Regressor):
        def on_train_epoch_end(self):
            self.log("constant", 1.0)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "constant"}}

    seen = Seen()
    trainer = Trainer(**quiet(max_epochs=3), callbacks=[seen])
    trainer.fit(Plateau(), loader(regression_data(16), 8))
    # Epoch 0 sets the best; no improvement after epochs 1 and 2 halves the rate after each, at its end.
    assert [lr for event, _, lr in seen.events if event == "epoch_end"] == [0.1, 0.1, 0.05]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)


# ---------------------------------------------------------------- item 8: module modes
class Frozen(Regressor):
    """A Regressor with an encoder the user froze in eval mode, asserting the modes Lightning keeps."""

    def __init__(self) -> None:
        super().__init__(dropout=0.5)
        self.encoder = nn.Sequential(nn.Dropout(0.5))
        self.encoder.eval()
        self.modes: list[tuple[str, bool, bool]] = []

    def training_step(self, batch, batch_idx):
        self.modes.append(("train", self.net.training, self.encoder.training))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.modes.append(("validate", self.net.training, self.encoder.training))
        return super().validation_step(batch, batch_idx)


def test_a_frozen_submodule_stays_in_eval_mode_and_modes_are_restored_after_evaluation():
    """Lightning's `test_train_eval_mode_restored`: training leaves the user's modes alone, evaluation puts
    every submodule in eval mode and restores each one's mode afterwards."""
    task = Frozen()
    data = loader(regression_data(16), 8)
    trainer = Trainer(**quiet(max_epochs=1, num_sanity_val_steps=1))
    trainer.fit(task, data, data)
    assert set(task.modes) == {("train", True, False), ("validate", False, False)}
    trainer.validate(task, data)
    trainer.test(task, data)
    assert task.net.training and not task.encoder.training and task.training


# ---------------------------------------------------------------- item 9: flags
def test_num_sanity_val_steps_minus_one_honours_limit_val_batches():
    class Count(Callback):
        batches = 0

        def on_validation_batch_end(self, trainer, task, outputs, batch, batch_idx, dataloader_idx=0):
            if trainer.sanity_checking:
                Count.batches += 1

    trainer = Trainer(**quiet(max_epochs=1, num_sanity_val_steps=-1, limit_val_batches=3), callbacks=[Count()])
    trainer.fit(Regressor(), loader(regression_data(16), 8), loader(regression_data(64), 8))
    assert Count.batches == 3


def test_limit_train_batches_zero_skips_training(tmp_path):
    """Lightning skips the fit loop: no training hooks, no epoch, no checkpoint of step 0."""
    calls: list[str] = []

    class Record(Callback):
        def on_train_start(self, trainer, task):
            calls.append("train_start")

        def on_train_epoch_start(self, trainer, task):
            calls.append("epoch_start")

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    kwargs = {**quiet(max_epochs=2, limit_train_batches=0), "enable_checkpointing": True}
    trainer = Trainer(**kwargs, callbacks=[Record(), checkpoint])
    trainer.fit(Regressor(), loader(regression_data(16), 8))
    assert calls == [] and trainer.global_step == 0 and trainer.current_epoch == 0
    assert list(tmp_path.iterdir()) == []


def test_several_predict_loaders_get_their_index_and_one_list_each():
    indices: list[int] = []

    class Predictor(Regressor):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            indices.append(dataloader_idx)
            return self(batch[0])

    task = Predictor()
    trainer = Trainer(**quiet())
    predictions = trainer.predict(task, [loader(regression_data(16), 8), loader(regression_data(8), 8)])
    assert [len(p) for p in predictions] == [2, 1] and indices == [0, 0, 1]
    torch.testing.assert_close(predictions[1][0], task(regression_data(8).tensors[0]))
    assert len(trainer.predict(task, loader(regression_data(16), 8))) == 2  # one loader: a flat list


# ---------------------------------------------------------------- item 10: Lightning's values and defaults
def test_lightnings_devices_precision_and_strategy_spellings():
    assert Trainer(devices="auto", logger=False).devices == 1  # the CPU: one process
    assert Trainer(devices="2", accelerator="cpu", logger=False).devices == 2
    with pytest.raises(OptionError, match=r"devices=-1\) means every GPU"):
        Trainer(devices=-1, accelerator="cpu", logger=False)
    assert Trainer(precision="16", logger=False).precision_name == "16"
    trainer = Trainer(**quiet(max_steps=1, precision="bf16"))
    trainer.fit(Regressor(), loader(regression_data(16), 8))
    assert trainer.precision.name == "bf16-mixed"
    assert isinstance(Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False).strategy, NativeDDP)
    found_unused = Trainer(
        strategy="ddp_find_unused_parameters_true", accelerator="cpu", devices=2, logger=False
    ).strategy
    assert found_unused.ddp_kwargs["find_unused_parameters"] is True


def test_a_training_step_returning_none_skips_the_batch():
    """Lightning: returning None skips the batch (no backward), with a warning."""

    class Skips(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 0 else loss

    torch.manual_seed(0)
    skipping = Skips()
    torch.manual_seed(0)
    reference = Regressor()
    data = regression_data(16)
    trainer = Trainer(**quiet(max_epochs=1))
    with pytest.warns(UserWarning, match="training_step returned None"):
        trainer.fit(skipping, loader(data, 8))
    assert trainer.global_step == 2  # Lightning counts the skipped batch's (empty) optimizer step
    Trainer(**quiet(max_epochs=1)).fit(reference, loader(torch.utils.data.Subset(data, range(8, 16)), 8))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(skipping.state_dict()[name], value, rtol=0, atol=0)


# ---------------------------------------------------------------- item 3: stages after fit
def test_stages_without_a_task_use_the_fitted_one_with_its_best_checkpoint(tmp_path):
    """Lightning: `trainer.validate()` after `fit` uses the fitted task and, by default, the best checkpoint."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    trainer = Trainer(**{**quiet(max_epochs=3), "enable_checkpointing": True}, callbacks=[checkpoint])
    task, data = Regressor(lr=0.5), loader(regression_data(32), 8)
    trainer.fit(task, data, data)
    with pytest.warns(UserWarning, match="best checkpoint"):
        metrics = trainer.validate(dataloaders=data)
    assert metrics[0]["val_loss"] == pytest.approx(float(checkpoint.best_model_score), rel=1e-6)
    assert len(trainer.predict(dataloaders=data, ckpt_path="best")) == 4
    with pytest.raises(TypeError, match="needs a task"):
        Trainer(**quiet()).test()


def test_ckpt_path_last_without_a_last_checkpoint_warns_and_loads_nothing(tmp_path):
    """Lightning warns and loads nothing; it never takes a top-k file for the last one."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path)  # top-k only, no last.ckpt
    trainer = Trainer(**{**quiet(max_epochs=1), "enable_checkpointing": True}, callbacks=[checkpoint])
    task, data = Regressor(), loader(regression_data(16), 8)
    trainer.fit(task, data)
    with torch.no_grad():
        for parameter in task.parameters():
            parameter.add_(1.0)
    current = trainer.validate(task, data)[0]["val_loss"]
    with pytest.warns(UserWarning, match="no last"):
        assert trainer.validate(task, data, ckpt_path="last")[0]["val_loss"] == current


def test_a_resume_from_the_validation_that_stopped_training_finishes_that_epoch(tmp_path):
    """A checkpoint written when a callback stopped training in the epoch's final validation resumes into that
    epoch's end: its `on_train_epoch_end` runs (once) and the counter advances, as in the uninterrupted run."""

    class StopAndSave(Callback):
        def __init__(self, save: bool) -> None:
            self.save, self.epoch_ends = save, 0

        def on_validation_end(self, trainer, task):
            if not trainer.sanity_checking and trainer.current_epoch == 1:
                trainer.should_stop = True
                if self.save:
                    trainer.save_checkpoint(tmp_path / "stopped.ckpt")

        def on_train_epoch_end(self, trainer, task):
            self.epoch_ends += 1

    data = loader(regression_data(16), 8)
    straight = Trainer(**quiet(max_epochs=5), callbacks=[StopAndSave(save=True)])
    straight.fit(EpochScheduled(), data, data)
    assert straight.current_epoch == 2
    watcher = StopAndSave(save=False)
    resumed = Trainer(**quiet(max_epochs=5), callbacks=[watcher])
    resumed.fit(EpochScheduled(), data, data, ckpt_path=tmp_path / "stopped.ckpt")
    assert resumed.current_epoch == 2 and resumed.global_step == 4 and watcher.epoch_ends == 1
    assert resumed.optimizers[0].param_groups[0]["lr"] == straight.optimizers[0].param_groups[0]["lr"]
