"""A checkpoint whose trailer is valid but whose entries are not: one error naming the file.

Items 6, 8 and 10: missing entries are named with the file (no raw ``KeyError``); a stateful strategy
refuses a checkpoint without its state unless the task says ``strict_loading = False`` (Lightning's
attribute); strategy and world-size mismatches name the file; files get the umask's permissions.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

from syncline.checkpoint_file import CheckpointError, load_checkpoint, save_checkpoint
from syncline.strategies import LocalSGD
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


def _fit(tmp_path, strategy=None, ckpt_path=None, task=None, max_steps=2):
    torch.manual_seed(0)
    trainer = Trainer(max_steps=max_steps, strategy=strategy or "single", **quiet(default_root_dir=tmp_path))
    trainer.fit(task or Regressor(), loader(regression_data(16), batch_size=4), ckpt_path=ckpt_path)
    return trainer


def _edited(tmp_path, trainer, edit, name="edited.ckpt"):
    """Save `trainer`'s checkpoint, apply `edit` to it, and write it back whole (a valid trailer)."""
    trainer.save_checkpoint(tmp_path / "whole.ckpt")
    checkpoint = load_checkpoint(tmp_path / "whole.ckpt")
    edit(checkpoint)
    save_checkpoint(checkpoint, tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("entry", ["state_dict", "progress", "optimizer", "rng"])
def test_a_missing_entry_is_one_error_naming_the_file_and_the_entry(tmp_path, entry):
    path = _edited(tmp_path, _fit(tmp_path), lambda checkpoint: checkpoint.pop(entry))
    with pytest.raises(CheckpointError, match=f"Checkpoint {path} lacks '{entry}'"):
        _fit(tmp_path, ckpt_path=path, max_steps=4)


def test_evaluation_and_load_from_checkpoint_name_a_missing_state_dict(tmp_path):
    path = _edited(tmp_path, _fit(tmp_path), lambda checkpoint: checkpoint.pop("state_dict"))
    with pytest.raises(CheckpointError, match=f"Checkpoint {path} lacks 'state_dict'"):
        Trainer(**quiet()).validate(Regressor(), loader(regression_data(16)), ckpt_path=path)
    with pytest.raises(CheckpointError, match=f"Checkpoint {path} lacks 'state_dict'"):
        Regressor.load_from_checkpoint(path)


def test_a_stateful_strategy_refuses_a_checkpoint_without_its_state_unless_not_strict(tmp_path):
    trainer = _fit(tmp_path, LocalSGD(period=2), max_steps=3)
    path = _edited(tmp_path, trainer, lambda checkpoint: checkpoint.pop("strategy"))
    with pytest.raises(CheckpointError, match=f"Checkpoint {path} holds no state of strategy 'local_sgd'"):
        _fit(tmp_path, LocalSGD(period=2), ckpt_path=path, max_steps=5)
    lenient = Regressor()
    lenient.strict_loading = False
    resumed = _fit(tmp_path, LocalSGD(period=2), ckpt_path=path, task=lenient, max_steps=5)
    assert resumed.global_step == 5


def test_a_stateless_strategy_resumes_a_checkpoint_without_strategy_state(tmp_path):
    path = _edited(tmp_path, _fit(tmp_path), lambda checkpoint: checkpoint.pop("strategy"))
    assert _fit(tmp_path, ckpt_path=path, max_steps=4).global_step == 4


def test_strategy_and_world_size_mismatches_name_the_file(tmp_path):
    trainer = _fit(tmp_path, LocalSGD(period=2), max_steps=3)
    path = trainer_path = tmp_path / "local_sgd.ckpt"
    trainer.save_checkpoint(trainer_path)
    with pytest.raises(CheckpointError, match=f"Checkpoint {path} holds per-rank state of strategy 'local_sgd'"):
        _fit(tmp_path, "bucketed_ddp", ckpt_path=path, max_steps=5)

    def on_two(checkpoint):
        checkpoint["world_size"] = 2
        checkpoint["strategy"]["by_rank"] *= 2
        checkpoint["rng"] *= 2

    two = _edited(tmp_path, trainer, on_two, name="two.ckpt")
    with pytest.raises(CheckpointError, match=f"Checkpoint {two} was saved on 2 processes: LocalSGD keeps per-rank"):
        _fit(tmp_path, LocalSGD(period=2), ckpt_path=two, max_steps=5)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoints_get_the_permissions_of_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        save_checkpoint({"syncline_format": 2}, tmp_path / "x.ckpt")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "x.ckpt").stat().st_mode) == 0o666 & ~umask
