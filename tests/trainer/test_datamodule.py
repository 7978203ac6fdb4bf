"""`DataModule`: Lightning's LightningDataModule hooks, order, checkpointed state and sharding."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import syncline
from syncline.callbacks import Callback
from syncline.testing import run_distributed
from syncline.trainer import DataModule, Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data
from tests.trainer.test_resume import Crash, SaveThenCrash


class Recorded(DataModule):
    """A DataModule that records which of its hooks ran, in order."""

    def __init__(self, calls: list[str], batch_size: int = 8) -> None:
        super().__init__()
        self.calls = calls
        self.save_hyperparameters(ignore=["calls"])

    def prepare_data(self) -> None:
        self.calls.append("dm.prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"dm.setup:{stage}")
        self.data = regression_data(32)

    def _loader(self, method: str) -> DataLoader:
        self.calls.append(f"dm.{method}")
        return loader(self.data, self.hparams.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train_dataloader")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val_dataloader")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test_dataloader")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict_dataloader")

    def teardown(self, stage: str) -> None:
        self.calls.append(f"dm.teardown:{stage}")


class RecordingCallback(Callback):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def setup(self, trainer, task, stage):
        self.calls.append(f"cb.setup:{stage}")

    def teardown(self, trainer, task, stage):
        self.calls.append(f"cb.teardown:{stage}")


class RecordingTask(Regressor):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def prepare_data(self) -> None:
        self.calls.append("task.prepare_data")

    def setup(self, stage):
        self.calls.append(f"task.setup:{stage}")

    def teardown(self, stage):
        self.calls.append(f"task.teardown:{stage}")


def test_fit_calls_the_datamodule_hooks_in_lightnings_order():
    calls: list[str] = []
    dm = Recorded(calls)
    trainer = Trainer(**quiet(max_epochs=1, num_sanity_val_steps=0, callbacks=[RecordingCallback(calls)]))
    trainer.fit(RecordingTask(calls), datamodule=dm)
    # Lightning: prepare_data (the DataModule's, then the module's), then setup (DataModule, callbacks,
    # module), the loaders, and at the end teardown (DataModule, callbacks, module).
    assert calls == [
        "dm.prepare_data",
        "task.prepare_data",
        "dm.setup:fit",
        "cb.setup:fit",
        "task.setup:fit",
        "dm.train_dataloader",
        "dm.val_dataloader",
        "dm.teardown:fit",
        "cb.teardown:fit",
        "task.teardown:fit",
    ]
    assert trainer.datamodule is dm and dm.trainer is trainer
    assert trainer.global_step == 4  # 32 samples in batches of 8


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_stages_take_the_datamodules_loader_and_equal_passing_it(stage):
    calls: list[str] = []
    task = Regressor()
    by_module = getattr(Trainer(**quiet()), stage)(task, datamodule=Recorded(calls))
    method = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}[stage]
    assert calls == ["dm.prepare_data", f"dm.setup:{stage}", f"dm.{method}", f"dm.teardown:{stage}"]
    by_loader = getattr(Trainer(**quiet()), stage)(task, loader(regression_data(32)))
    if stage == "predict":
        torch.testing.assert_close(torch.cat(by_module), torch.cat(by_loader), rtol=0, atol=0)
    else:
        assert by_module == by_loader


def test_a_datamodule_passed_as_the_loaders_is_used_as_one_and_bad_input_is_named():
    calls: list[str] = []
    Trainer(**quiet(max_epochs=1, num_sanity_val_steps=0)).fit(Regressor(), Recorded(calls))  # trainer.fit(model, dm)
    assert "dm.train_dataloader" in calls
    with pytest.raises(ValueError, match=r"both train_dataloaders=\.\.\. and datamodule=\.\.\."):
        Trainer(**quiet()).fit(Regressor(), loader(regression_data()), datamodule=Recorded([]))
    with pytest.raises(ValueError, match=r"both dataloaders=\.\.\. and datamodule="):
        Trainer(**quiet()).test(Regressor(), loader(regression_data()), datamodule=Recorded([]))
    with pytest.raises(TypeError, match=r"needs a syncline.DataModule, got DataLoader"):
        Trainer(**quiet()).fit(Regressor(), datamodule=loader(regression_data()))


def test_datamodule_is_exported_where_lightning_users_look():
    assert syncline.DataModule is DataModule is syncline.trainer.DataModule


def test_datamodule_hyperparameters_are_checkpointed_and_logged_with_the_tasks(tmp_path):
    from syncline.callbacks import CSVLogger

    dm = Recorded([], batch_size=16)
    assert dict(dm.hparams) == {"batch_size": 16}
    trainer = Trainer(
        max_epochs=1, logger=CSVLogger(str(tmp_path)), enable_checkpointing=False, enable_progress_bar=False
    )
    task = Regressor()
    task.save_hyperparameters({"lr": 0.1})
    trainer.fit(task, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    checkpoint = torch.load(tmp_path / "x.ckpt", weights_only=False)
    assert checkpoint["datamodule_hyper_parameters"] == {"batch_size": 16}
    logged = (Path(trainer.logger.log_dir) / "hparams.yaml").read_text()
    assert "batch_size: 16" in logged and "lr: 0.1" in logged


def test_a_hyperparameter_in_both_with_different_values_is_refused():
    class Clashing(Recorded):
        def __init__(self, calls, lr: float = 0.5) -> None:
            super().__init__(calls)
            self.save_hyperparameters(ignore=["calls"])

    task = Regressor()
    task.save_hyperparameters({"lr": 0.1})
    with pytest.raises(ValueError, match=r"\['lr'\] are in both Regressor's and Clashing's hparams"):
        Trainer(**quiet(max_epochs=1)).fit(task, datamodule=Clashing([]))


# ----------------------------------------------------------------- stateful
class CurriculumData(Dataset):
    """Regression targets scaled by the DataModule's current level, read at every access."""

    def __init__(self, module: Curriculum) -> None:
        self.module, self.base = module, regression_data(40)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        return x, y * (1.0 + 0.5 * self.module.level)


class Curriculum(DataModule):
    """A stateful DataModule: the task raises its level after every epoch; the level shapes the data."""

    def __init__(self, keep_state: bool = True) -> None:
        super().__init__()
        self.keep_state, self.level = keep_state, 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(CurriculumData(self), batch_size=8, shuffle=True)

    def state_dict(self):
        return {"level": self.level} if self.keep_state else {}

    def load_state_dict(self, state_dict):
        self.level = state_dict["level"]


class Advancing(Regressor):
    def on_train_epoch_end(self):
        self.trainer.datamodule.level += 1


def _fit_curriculum(keep_state: bool, callbacks=(), ckpt_path=None):
    torch.manual_seed(0)
    task = Advancing(dropout=0.1)
    trainer = Trainer(**quiet(max_epochs=4, seed=7, callbacks=list(callbacks)))
    trainer.fit(task, datamodule=Curriculum(keep_state), ckpt_path=ckpt_path)
    return task.state_dict()


@pytest.mark.parametrize("keep_state", [True, False])
def test_resume_with_a_stateful_datamodule_is_bit_exact(tmp_path, keep_state):
    whole = _fit_curriculum(keep_state)
    path = tmp_path / "mid.ckpt"
    with pytest.raises(Crash):
        _fit_curriculum(keep_state, [SaveThenCrash(path, epoch=2, batch_idx=2)])
    assert ("Curriculum" in torch.load(path, weights_only=False)) is keep_state
    resumed = _fit_curriculum(keep_state, ckpt_path=path)
    same = all(torch.equal(whole[name], resumed[name]) for name in whole)
    # Kept, the DataModule's state makes the resume bit-exact; dropped, the data (and weights) differ.
    assert same is keep_state


# ------------------------------------------------------------- distributed
class Sharded(DataModule):
    """Prepares a file on rank 0 slowly; every rank's setup must find it (the barrier)."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = Path(folder)

    def prepare_data(self) -> None:
        time.sleep(1.0)  # the other rank reaches the barrier long before this is written
        (self.folder / "data.pt").write_bytes(b"prepared")
        with open(self.folder / "prepared_by.txt", "a") as file:
            file.write(f"{self.trainer.global_rank}\n")

    def setup(self, stage: str) -> None:
        assert (self.folder / "data.pt").read_bytes() == b"prepared"
        self.data = regression_data(24)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4, shuffle=True)


def _fit_sharded(rank, world_size, folder):
    seen: dict[int, list[float]] = {0: [], 1: []}

    class Recording(Regressor):
        def training_step(self, batch, batch_idx):
            seen[self.trainer.current_epoch].extend(batch[0][:, 0].tolist())
            return super().training_step(batch, batch_idx)

    Trainer(**quiet(max_epochs=2, strategy="native_ddp")).fit(Recording(), datamodule=Sharded(folder))
    return seen


def test_datamodule_prepares_once_per_node_behind_a_barrier_and_its_loader_is_sharded(tmp_path):
    rank0, rank1 = run_distributed(_fit_sharded, world_size=2, args=(str(tmp_path),), timeout=120)
    assert (tmp_path / "prepared_by.txt").read_text() == "0\n"  # local rank 0 only
    everything = sorted(regression_data(24).tensors[0][:, 0].tolist())
    for epoch in (0, 1):
        assert len(rank0[epoch]) == len(rank1[epoch]) == 12
        assert sorted(rank0[epoch] + rank1[epoch]) == everything  # each sample once per epoch


def test_devices_2_launches_workers_that_use_the_datamodule(tmp_path):
    task = Regressor()
    trainer = Trainer(**quiet(max_epochs=1, devices=2, strategy="native_ddp", accelerator="cpu"))
    trainer.fit(task, datamodule=Sharded(str(tmp_path)))
    assert (tmp_path / "prepared_by.txt").read_text() == "0\n"
    assert trainer.global_step == 3  # 24 samples, 12 per rank in batches of 4


def test_datamodule_load_from_checkpoint_rebuilds_it_with_its_hyperparameters_and_state(tmp_path):
    class Saved(Curriculum):
        def __init__(self, keep_state: bool = True, batch_size: int = 8) -> None:
            super().__init__(keep_state)
            self.save_hyperparameters()

    trainer = Trainer(**quiet(max_epochs=2))
    trainer.fit(Advancing(), datamodule=Saved(batch_size=4))
    trainer.save_checkpoint(tmp_path / "dm.ckpt")
    loaded = Saved.load_from_checkpoint(tmp_path / "dm.ckpt")
    assert dict(loaded.hparams) == {"keep_state": True, "batch_size": 4}
    assert loaded.level == 2  # the state the run left it in
    assert Saved.load_from_checkpoint(tmp_path / "dm.ckpt", batch_size=16).hparams.batch_size == 16
