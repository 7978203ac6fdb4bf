"""The spellings a Lightning port meets first: model=, accelerator=, hparams.x, load_from_checkpoint, ckpt_path."""

from __future__ import annotations

import pytest
import torch

from syncline.callbacks import Callback, ModelCheckpoint
from syncline.checkpoint_file import CheckpointError
from syncline.strategies import BucketedDDP, NativeDDP, SingleDevice
from syncline.strategies.registry import resolve_strategy
from syncline.trainer import Task, Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class HParamsRegressor(Regressor):
    """A Regressor that records its arguments and reads them back as attributes, as Lightning code does."""

    def __init__(self, features: int = 8, hidden_lr: float = 0.1) -> None:
        super().__init__(features=features, lr=hidden_lr)
        self.save_hyperparameters()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.hidden_lr)


def _fit(tmp_path, **trainer_kwargs) -> tuple[Trainer, HParamsRegressor]:
    torch.manual_seed(0)
    task = HParamsRegressor()
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True, dirpath=tmp_path / "ckpt")
    kwargs = quiet(max_epochs=3, callbacks=[checkpoint], default_root_dir=tmp_path, **trainer_kwargs)
    trainer = Trainer(**{**kwargs, "enable_checkpointing": True})
    trainer.fit(
        model=task,
        train_dataloaders=loader(regression_data(), shuffle=True),
        val_dataloaders=loader(regression_data(seed=1)),
    )
    return trainer, task


def test_fit_validate_test_predict_take_model_as_keyword(tmp_path):
    trainer, task = _fit(tmp_path)
    assert trainer.global_step == 24
    data = loader(regression_data(seed=1))
    assert trainer.validate(model=task, dataloaders=data)[0]["val_loss"] > 0
    assert trainer.test(model=task, dataloaders=data)[0]["test_loss"] > 0
    assert len(trainer.predict(model=task, dataloaders=data)) == 8
    with pytest.raises(TypeError, match="one task"):
        trainer.validate(task, model=task, dataloaders=data)
    with pytest.raises(TypeError, match="one task"):
        trainer.fit()


def test_hparams_read_as_attributes_and_keys():
    task = HParamsRegressor(hidden_lr=0.5)
    assert task.hparams.hidden_lr == task.hparams["hidden_lr"] == 0.5
    with pytest.raises(AttributeError, match="no hyperparameter 'lr'; saved: features, hidden_lr"):
        _ = task.hparams.lr


def test_task_sees_current_epoch_and_global_step(tmp_path):
    seen: list[tuple[int, int, int, int]] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            seen.append((task.current_epoch, task.global_step, trainer.current_epoch, trainer.global_step))

    task = Regressor()
    assert (task.current_epoch, task.global_step, task.device) == (0, 0, torch.device("cpu"))
    Trainer(**quiet(max_epochs=2, callbacks=[Record()], default_root_dir=tmp_path)).fit(task, loader(regression_data()))
    assert [s[:2] for s in seen] == [s[2:] for s in seen]
    assert seen[-1][:2] == (1, 16)


def test_accelerator_cpu_and_auto_train_and_wrong_ones_fail_clearly(tmp_path):
    trainer = Trainer(**quiet(max_epochs=1, accelerator="cpu", default_root_dir=tmp_path))
    assert trainer.strategy.root_device == torch.device("cpu")
    trainer.fit(Regressor(), loader(regression_data()))
    assert trainer.global_step == 8
    assert Trainer(accelerator="cpu", devices=2, logger=False).strategy.backend == "gloo"
    with pytest.raises(ValueError, match="Unknown accelerator 'tpu'. Valid values: auto, cpu, gpu, cuda"):
        Trainer(accelerator="tpu")
    with pytest.raises(ValueError, match="backend='gloo'"):
        Trainer(accelerator="cpu", devices=2, strategy=BucketedDDP(backend="nccl"), logger=False)
    with pytest.raises(ValueError, match="computes on cpu"):
        Trainer(accelerator="cuda", strategy=SingleDevice("cpu"), logger=False) if torch.cuda.is_available() else (
            SingleDevice("cpu").use_accelerator("cuda")
        )
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            Trainer(accelerator="gpu")


def test_auto_accelerator_with_fewer_gpus_than_devices_is_lightnings_clear_error(monkeypatch):
    """Lightning: "auto" picks the GPUs on a GPU machine, so devices=2 with one GPU is an error, not a crash on
    a missing cuda:1 (nor a silent switch to the CPU). One GPU is pretended: no collective is involved."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"devices=2 with accelerator='auto' needs 2 GPUs, and 1 is visible: pass "):
        Trainer(devices=2, logger=False)
    assert Trainer(accelerator="cpu", devices=2, logger=False).strategy.backend == "gloo"


def test_load_from_checkpoint_rebuilds_the_task_with_saved_hparams_and_overrides(tmp_path):
    trainer, task = _fit(tmp_path)
    best = trainer.checkpoint_callback.best_model_path
    loaded = HParamsRegressor.load_from_checkpoint(best, map_location="cpu")
    saved = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert loaded.hparams.hidden_lr == 0.1
    assert HParamsRegressor.load_from_checkpoint(best, hidden_lr=0.25).hparams.hidden_lr == 0.25
    # As in Lightning, an argument the constructor does not take is dropped.
    assert "unknown" not in HParamsRegressor.load_from_checkpoint(best, unknown=1).hparams
    with pytest.raises(CheckpointError, match="not found"):
        HParamsRegressor.load_from_checkpoint(tmp_path / "missing.ckpt")


def test_test_loads_best_last_a_path_or_the_current_weights(tmp_path):
    trainer, task = _fit(tmp_path)
    data = loader(regression_data(seed=1))
    best, last = trainer.checkpoint_callback.best_model_path, str(tmp_path / "ckpt" / "last.ckpt")
    assert best != last
    current = trainer.test(task, data)[0]["test_loss"]

    def loss_of(path: str) -> float:
        reference = HParamsRegressor.load_from_checkpoint(path)
        x, y = regression_data(seed=1).tensors
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(reference(x), y))

    assert trainer.test(task, data, ckpt_path="best")[0]["test_loss"] == pytest.approx(loss_of(best), rel=1e-6)
    assert trainer.test(task, data, ckpt_path="last")[0]["test_loss"] == pytest.approx(loss_of(last), rel=1e-6)
    assert trainer.test(task, data, ckpt_path=best)[0]["test_loss"] == pytest.approx(loss_of(best), rel=1e-6)
    assert loss_of(last) == pytest.approx(current, rel=1e-6)
    with pytest.raises(CheckpointError, match="'best' .*'last' .*a path, or None"):
        trainer.test(task, data, ckpt_path="bset")


def test_best_without_a_checkpoint_callback_is_a_clear_error(tmp_path):
    trainer = Trainer(**quiet(max_epochs=1, enable_checkpointing=False, default_root_dir=tmp_path))
    task: Task = Regressor()
    trainer.fit(task, loader(regression_data()))
    with pytest.raises(ValueError, match="no ModelCheckpoint is configured"):
        trainer.test(task, loader(regression_data()), ckpt_path="best")


@pytest.mark.parametrize(
    ("name", "unused"),
    [
        ("ddp", False),
        ("DDP", False),
        ("ddp_spawn", False),
        ("ddp_notebook", False),
        ("Ddp_Fork", False),
        ("ddp_spawn_find_unused_parameters_true", True),
        ("ddp_find_unused_parameters_false", False),
    ],
)
def test_lightnings_ddp_names_are_native_ddp_launched_as_syncline_launches(name, unused):
    """Lightning's DDP variants differ in how processes start; here they are torch's DDP, started by syncline."""
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, NativeDDP) and trainer.devices == 2
    assert bool(trainer.strategy.ddp_kwargs.get("find_unused_parameters")) is unused


def test_a_misspelled_strategy_in_python_suggests_the_name_as_the_command_line_does():
    with pytest.raises(ValueError, match=r"Unknown strategy 'bucketd_ddp'\. Did you mean 'bucketed_ddp'\?"):
        Trainer(strategy="bucketd_ddp", devices=2, logger=False)
    with pytest.raises(ValueError, match=r"Did you mean 'ddp_spawn'\?"):
        resolve_strategy("ddp_spwan", devices=2)
    with pytest.raises(ValueError, match=r"Unknown strategy 'xyz'\. Valid strategies: .*native_ddp.*ddp_spawn"):
        resolve_strategy("xyz")
    assert isinstance(resolve_strategy("Single_Device"), SingleDevice)
