"""Elastic restart: a killed worker's group restarts and resumes from last.ckpt bit-exactly.

Each script trains the same task twice, once undisturbed and once with rank 1 killed (SIGKILL) at step
5 of 8, checkpointing every 2 steps; the restarted group finds ``last.ckpt`` (step 4) by itself, and
both runs must end with equal weights (`torch.equal`: dropout and shuffling make every step depend on
the restored random streams and data order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.trainer._faults import run_script, start_steps

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find processes left behind")

_FIT = """
import os, sys, torch
from syncline.callbacks import ModelCheckpoint
from syncline.trainer import Trainer
from tests.trainer._faults import Faulty
from tests.trainer._tasks import loader, regression_data

def fit(name, fault, **options):
    torch.manual_seed(0)
    task = Faulty(fault, at_step=5, pids_dir={pids!r} if fault else None, dropout=0.2)
    trainer = Trainer(
        max_steps=8,
        accelerator="cpu",
        default_root_dir=os.path.join({root!r}, name),
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(every_n_train_steps=2, save_last=True, save_top_k=0)],
        **options,
    )
    trainer.fit(task, loader(regression_data(64), shuffle=True))
    return task.state_dict(), trainer.global_step
"""


def _equal(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "same weights: True after 8 and 8 steps" in result.stdout, result.stdout + result.stderr[-3000:]


def test_trainer_max_restarts_resumes_from_last_checkpoint_bit_exactly(tmp_path: Path) -> None:
    (tmp_path / "pids").mkdir()
    body = (
        _FIT.format(pids=str(tmp_path / "pids"), root=str(tmp_path))
        + """
if __name__ == "__main__":
    clean, steps = fit("clean", None, devices=2)
    restarted, restarted_steps = fit("restarted", "kill", devices=2, max_restarts=1)
    same = all(torch.equal(clean[k], restarted[k]) for k in clean)
    print(f"same weights: {same} after {steps} and {restarted_steps} steps")
"""
    )
    result, _ = run_script(tmp_path, body, timeout=240)
    _equal(result)
    # Two workers from step 0, then two restarted ones from last.ckpt (step 4), not from scratch.
    assert start_steps(tmp_path / "pids") == [0, 0, 4, 4]


def test_torchrun_max_restarts_resumes_from_last_checkpoint_bit_exactly(tmp_path: Path) -> None:
    (tmp_path / "pids").mkdir()
    # On the restart the script runs again from the top: the finished clean run resumes from its own
    # last.ckpt (step 8, nothing left to do) and the killed one from its step-4 last.ckpt.
    body = (
        _FIT.format(pids=str(tmp_path / "pids"), root=str(tmp_path))
        + """
clean, steps = fit("clean", None)
restarted, restarted_steps = fit("restarted", "kill")
if int(os.environ["RANK"]) == 0:
    same = all(torch.equal(clean[k], restarted[k]) for k in clean)
    print(f"same weights: {same} after {steps} and {restarted_steps} steps", flush=True)
"""
    )
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    result, _ = run_script(
        tmp_path, body, torchrun, "--standalone", "--nproc-per-node=2", "--max-restarts=1", timeout=240
    )
    _equal(result)
    assert start_steps(tmp_path / "pids") == [0, 0, 4, 4]
