"""Code blocks of Lightning 2.x's documentation pages, run on syncline with only their imports changed.

Each test names its page (docs/source-pytorch/...) and holds the page's block as printed there; each changed
import carries a ``# Lightning:`` comment with the original. What the pages leave undefined (``LitModel``,
``model``, the data) is defined above the blocks, marked "not on the page"; so are the Trainer limits that
make a page's ``Trainer(...)`` finish in a second (`Trainer` below is syncline's with them as defaults).
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import syncline
from syncline import Task

# ---------------------------------------------------------------- not on the page


def _data(n: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


class LitModel(Task):
    """A classifier with its own loaders, standing in for the pages' LitModel."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(8), batch_size=4)


class _Rows(Dataset):
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


Trainer = functools.partial(syncline.Trainer, max_epochs=2, enable_progress_bar=False)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """The pages write to relative paths ("my/path/", "logs/"): run each block in its own directory."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------- the pages' blocks


def test_checkpointing_intermediate_modelcheckpoint(capsys):
    # common/checkpointing_intermediate.rst, "ModelCheckpoint"
    model = LitModel()  # not on the page

    from syncline.callbacks import ModelCheckpoint  # Lightning: from lightning.pytorch.callbacks import ...

    checkpoint_callback = ModelCheckpoint(dirpath="my/path/", save_top_k=2, monitor="val_loss")
    trainer = Trainer(callbacks=[checkpoint_callback])
    trainer.fit(model)

    # Access best and last model checkpoint directly from the callback
    print(checkpoint_callback.best_model_path)
    print(checkpoint_callback.last_model_path)
    # Or via the trainer
    print(trainer.checkpoint_callback.best_model_path)
    print(trainer.checkpoint_callback.last_model_path)

    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == printed[2] and os.path.isfile(printed[0])
    assert sorted(os.listdir("my/path")) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]


def test_checkpointing_intermediate_filename():
    # common/checkpointing_intermediate.rst, "Customize checkpointing behavior"
    from syncline.callbacks import ModelCheckpoint  # Lightning: from lightning.pytorch.callbacks import ...

    # saves a file like: my/path/sample-mnist-epoch=02-val_loss=0.32.ckpt
    checkpoint_callback = ModelCheckpoint(
        dirpath="my/path/",
        filename="sample-mnist-{epoch:02d}-{val_loss:.2f}",
    )

    Trainer(callbacks=[checkpoint_callback]).fit(LitModel())  # not on the page
    (name,) = os.listdir("my/path")
    assert name.startswith("sample-mnist-epoch=01-val_loss=") and name.endswith(".ckpt")


def test_checkpointing_intermediate_save_checkpoint():
    # common/checkpointing_intermediate.rst, "Save a checkpoint"
    MyLightningModule, hparams, trainer = LitModel, 32, Trainer()  # not on the page

    model = MyLightningModule(hparams)
    trainer.fit(model)
    trainer.save_checkpoint("example.ckpt")

    # load the checkpoint later as normal
    new_model = MyLightningModule.load_from_checkpoint(checkpoint_path="example.ckpt", hidden=32)

    torch.testing.assert_close(new_model.state_dict(), model.state_dict())


def test_debugging_basic_model_summary(capsys):
    # debug/debugging_basic.rst, "Print LightningModule weights summary"
    from syncline.callbacks import ModelSummary  # Lightning: from lightning.pytorch.callbacks import ...

    trainer = Trainer(callbacks=[ModelSummary(max_depth=-1)])

    trainer.fit(LitModel())  # not on the page
    assert "1 | net.0 | Linear     | 144    | train" in capsys.readouterr().err

    from syncline.model_summary import ModelSummary  # Lightning: lightning.pytorch.utilities.model_summary

    model = LitModel()
    summary = ModelSummary(model, max_depth=-1)
    print(summary)

    assert "178       Total params" in capsys.readouterr().out

    trainer = Trainer(enable_model_summary=False)

    trainer.fit(LitModel())  # not on the page
    assert "Total params" not in capsys.readouterr().err


def test_trainer_max_time():
    # common/trainer.rst, "max_time"
    # Default (disabled)
    trainer = Trainer(max_time=None)

    # Stop after 12 hours of training or when reaching 10 epochs (string)
    trainer = Trainer(max_time="00:12:00:00", max_epochs=10)

    # Stop after 1 day and 5 hours (dict)
    trainer = Trainer(max_time={"days": 1, "hours": 5})

    trainer.fit(LitModel())  # not on the page: far from the limit, the run ends at max_epochs
    assert trainer.current_epoch == 2


def test_timer_callback_docstring():
    # callbacks/timer.py, the Timer's example
    from syncline import Trainer  # Lightning: from lightning.pytorch import Trainer
    from syncline.callbacks import Timer  # Lightning: from lightning.pytorch.callbacks import Timer

    # stop training after 12 hours
    timer = Timer(duration="00:12:00:00")

    # or provide a datetime.timedelta

    timer = Timer(duration=timedelta(weeks=1))

    # or provide a dictionary
    timer = Timer(duration=dict(weeks=4, days=2))

    # force training to stop after given time limit
    trainer = Trainer(callbacks=[timer])

    trainer = functools.partial(Trainer, max_epochs=1, enable_progress_bar=False)(callbacks=[timer])  # not on the page
    trainer.fit(LitModel())  # not on the page

    # query training/validation/test time (in seconds)
    timer.time_elapsed("train")
    timer.start_time("validate")
    timer.end_time("test")

    assert timer.time_elapsed("train") > 0 and timer.time_remaining() > timedelta(weeks=4).total_seconds()
    assert timer.start_time("validate") is not None and timer.end_time("test") is None


def test_logging_custom_logger_and_manual_artifacts():
    # extensions/logging.rst, "Logging" and "Manual Logging Non-Scalar Artifacts"
    from syncline import callbacks as pl_loggers  # Lightning: from lightning.pytorch import loggers as pl_loggers

    tb_logger = pl_loggers.TensorBoardLogger(save_dir="logs/")
    trainer = Trainer(logger=tb_logger)

    class Artifacts(LitModel):  # not on the page: the page's step, in a task
        def training_step(self, batch, batch_idx):
            # the logger you used (in this case tensorboard)
            tensorboard = self.logger.experiment
            tensorboard.add_histogram("weights", self.net[0].weight, self.global_step)
            return super().training_step(batch, batch_idx)

    trainer.fit(Artifacts())  # not on the page
    assert trainer.log_dir == os.path.join("logs", "lightning_logs", "version_0")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(trainer.log_dir))


def test_logging_hp_metrics():
    # extensions/logging.rst, "Logging hyperparameters" (default_hp_metric=False, custom metrics)
    from syncline import callbacks as pl_loggers  # Lightning: from lightning.pytorch import loggers as pl_loggers

    class Model(LitModel):  # not on the page: the page's hooks, in a task
        def __init__(self, hidden: int = 16):
            super().__init__(hidden)
            self.save_hyperparameters()

        # Using custom or multiple metrics (default_hp_metric=False)
        def on_train_start(self):
            self.logger.log_hyperparams(self.hparams, {"hp/metric_1": 0, "hp/metric_2": 0})

        def validation_step(self, batch, batch_idx):
            some_scalar_1, some_scalar_2 = 1.0, 2.0  # not on the page
            self.log("hp/metric_1", some_scalar_1)
            self.log("hp/metric_2", some_scalar_2)

    trainer = Trainer(logger=pl_loggers.TensorBoardLogger(".", default_hp_metric=False))  # not on the page
    trainer.fit(Model())  # not on the page
    assert os.path.isfile(os.path.join(trainer.log_dir, "hparams.yaml"))


def test_lightning_module_freeze_and_predict_step():
    # common/lightning_module.rst: "Use it as such!" and "Prediction Loop"
    model = LitModel()  # not on the page
    Trainer().fit(model)  # not on the page
    PATH, x = "model.ckpt", _data(4).tensors[0]  # not on the page
    model.trainer.save_checkpoint(PATH)  # not on the page
    Net = LitModel  # not on the page

    net = Net.load_from_checkpoint(PATH)
    net.freeze()
    out = net(x)

    assert not out.requires_grad

    class Autoencoder(Task):  # Lightning: L.LightningModule
        def __init__(self):  # not on the page
            super().__init__()
            self.decoder = nn.Linear(8, 8)

        def forward(self, x):
            return self.decoder(x)

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            # this calls forward
            return self(batch)

    rows = _Rows(_data(4).tensors[0])  # not on the page
    data_module = syncline.DataModule.from_datasets(predict_dataset=rows, batch_size=2)  # not on the page
    model = Autoencoder()
    trainer = Trainer()  # not on the page: the page's accelerator="gpu", devices=2
    predictions = trainer.predict(model, data_module)

    assert [p.shape for p in predictions] == [(2, 8), (2, 8)]
