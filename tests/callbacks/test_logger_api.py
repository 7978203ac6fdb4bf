"""The loggers' public API and file layout, as Lightning 2.x's TensorBoardLogger and CSVLogger have them
(loggers/tensorboard.py, loggers/csv_logs.py and lightning_fabric's loggers)."""

from __future__ import annotations

import csv
import os
from argparse import Namespace

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from syncline import Trainer
from syncline.callbacks import CSVLogger, TensorBoardLogger
from tests.callbacks._tasks import Scripted, make_loader, make_trainer


def _rows(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_default_logger_writes_under_lightning_logs(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, max_epochs=1, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.log_dir == str(tmp_path / "lightning_logs" / "version_0")
    trainer.fit(Scripted(), make_loader(2))
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt").is_file()
    assert TensorBoardLogger(tmp_path).log_dir == str(tmp_path / "lightning_logs" / "version_1")
    assert CSVLogger(tmp_path).name == "lightning_logs"


def test_name_none_puts_the_versions_in_save_dir_and_sub_dir_goes_below(tmp_path):
    assert TensorBoardLogger(tmp_path, name=None).log_dir == str(tmp_path / "version_0")
    assert CSVLogger(tmp_path, name="").log_dir == str(tmp_path / "version_0")
    logger = TensorBoardLogger(tmp_path, name="exp", version="run", sub_dir="fit")
    assert (logger.root_dir, logger.log_dir) == (str(tmp_path / "exp"), str(tmp_path / "exp" / "run" / "fit"))


class NamedLogger(TensorBoardLogger):
    @property
    def name(self):
        return "mine"

    @property
    def version(self):
        return "fixed"


def test_name_and_version_can_be_overridden(tmp_path):
    assert NamedLogger(tmp_path).log_dir == str(tmp_path / "mine" / "fixed")


def test_tensorboard_api(tmp_path):
    logger = TensorBoardLogger(tmp_path, prefix="p", log_graph=True)
    assert isinstance(logger.experiment, SummaryWriter)
    logger.log_hyperparams(Namespace(lr=0.1, layers=2), metrics={"hp_metric": 0.5})
    logger.log_metrics({"loss": 1.0})  # step None: the next step
    logger.log_metrics({"loss": 0.5}, step=7)
    logger.log_metrics({"loss": 0.25})
    task = Scripted()
    task.example_input_array = make_loader(1).dataset.tensors[0][:2]
    logger.log_graph(task)
    logger.finalize("success")
    assert yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()) == {
        "lr": 0.1,
        "layers": 2,
    }
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("p-loss")] == [(0, 1.0), (7, 0.5), (8, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("hp_metric")] == [(0, 0.5)]
    assert events.Graph() is not None


def test_tensorboard_save_writes_hparams_yaml_when_missing(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.hparams = {"a": 1}
    logger.log_metrics({"x": 1.0}, 0)
    logger.save()
    assert yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()) == {"a": 1}


def test_csv_rows_wait_for_the_flush_interval_and_the_end(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=3)
    assert logger.experiment is logger
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_metrics({"a": 2.0}, step=1)
    assert not os.path.exists(logger.metrics_file_path)
    logger.log_metrics({"a": 3.0, "b": 9.0}, step=2)  # (2 + 1) % 3 == 0: written
    assert [row["a"] for row in _rows(logger.metrics_file_path)] == ["1.0", "2.0", "3.0"]
    logger.log_metrics({"b": 4.0})  # step None: the rows kept so far
    assert len(logger.metrics) == 1
    logger.finalize("success")
    assert _rows(logger.metrics_file_path)[-1] == {"step": "0", "a": "", "b": "4.0"}


def test_csv_logger_in_a_fit_writes_every_row_and_hparams(tmp_path):
    class WithHparams(Scripted):
        def __init__(self, lr=0.05):
            super().__init__(lr=lr)
            self.save_hyperparameters()

    logger = CSVLogger(tmp_path, prefix="run")
    make_trainer(tmp_path, max_epochs=2, logger=logger, log_every_n_steps=1).fit(WithHparams(), make_loader(3))
    rows = _rows(logger.metrics_file_path)
    assert [row["step"] for row in rows if row["run-train_loss"]] == ["0", "1", "2", "3", "4", "5"]
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as file:
        assert yaml.safe_load(file) == {"lr": 0.05}


def test_task_reaches_the_writer_through_self_logger_experiment(tmp_path):
    class Writes(Scripted):
        def on_train_end(self):
            self.logger.experiment.add_text("note", "hello", 0)
            assert self.loggers == [self.logger]

    logger = TensorBoardLogger(tmp_path)
    make_trainer(tmp_path, logger=logger).fit(Writes(), make_loader(2))
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert "note/text_summary" in events.Tags()["tensors"]
