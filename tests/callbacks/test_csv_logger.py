"""CSVLogger: file contents, a header that grows, hparams, versions, resume and ranks."""

from __future__ import annotations

import csv

import pytest
import yaml

from syncline.callbacks import CSVLogger
from tests.callbacks._tasks import Scripted, make_loader, make_trainer


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_header_grows_and_the_file_is_rewritten(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)  # every row reaches the file at once
    logger.log_metrics({"a": 1.0}, 0)
    logger.log_metrics({"a": 2.0}, 1)
    logger.log_metrics({"b": 3.5, "a": 0.25}, 2)
    logger.log_metrics({"a": 4.0}, 3)
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text() == (
        "step,a,b\n0,1.0,\n1,2.0,\n2,0.25,3.5\n3,4.0,\n"
    )


def test_fit_writes_the_logged_values(tmp_path):
    logger = CSVLogger(tmp_path)
    task = Scripted()
    trainer = make_trainer(tmp_path, max_epochs=2, logger=logger, log_every_n_steps=1)
    trainer.fit(task, make_loader(2), make_loader(1))

    rows = _rows(logger.metrics_file)
    # One process communicates nothing: no comm/* columns, as Lightning logs none.
    assert list(rows[0]) == ["step", "train_loss", "epoch", "val_loss"]
    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r["train_loss"]]
    # Lightning's steps: a step's values under the step before it, the first row at step 0.
    assert [step for step, _ in train] == [0, 1, 2, 3]
    assert [value for _, value in train] == pytest.approx(task.losses)
    val = [(int(r["step"]), float(r["epoch"])) for r in rows if r["val_loss"]]
    assert val == [(1, 0.0), (3, 1.0)]


def test_hparams_yaml(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version=3)
    logger.log_hyperparams({"lr": 0.1, "net": {"width": 16}})
    assert yaml.safe_load((tmp_path / "run" / "version_3" / "hparams.yaml").read_text()) == {
        "lr": 0.1,
        "net": {"width": 16},
    }


def test_versions_increment(tmp_path):
    CSVLogger(tmp_path, flush_logs_every_n_steps=1).log_metrics({"a": 1.0}, 0)
    CSVLogger(tmp_path, flush_logs_every_n_steps=1).log_metrics({"a": 1.0}, 0)
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0", "version_1"]


def test_resume_continues_the_file_without_the_rows_after_the_checkpoint(tmp_path):
    crashed = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    for step in range(1, 6):
        crashed.log_metrics({"loss": float(step)}, step)

    resumed = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    resumed.load_state_dict(crashed.state_dict())
    resumed.log_metrics({"loss": -3.0}, 3)
    resumed.log_metrics({"loss": -4.0, "acc": 0.5}, 4)
    assert [(r["step"], r["loss"], r["acc"]) for r in _rows(crashed.metrics_file)] == [
        ("1", "1.0", ""),
        ("2", "2.0", ""),
        ("3", "-3.0", ""),
        ("4", "-4.0", "0.5"),
    ]


def test_an_existing_file_of_another_run_is_replaced_with_a_warning(tmp_path):
    CSVLogger(tmp_path, version=0, flush_logs_every_n_steps=1).log_metrics({"old": 1.0}, 0)
    logger = CSVLogger(tmp_path, version=0, flush_logs_every_n_steps=1)
    with pytest.warns(UserWarning, match="replaced"):
        logger.log_metrics({"new": 2.0}, 0)
    assert _rows(logger.metrics_file) == [{"step": "0", "new": "2.0"}]


def test_nothing_is_written_on_a_non_zero_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"a": 1.0}, 0)
    assert not any(tmp_path.iterdir())
