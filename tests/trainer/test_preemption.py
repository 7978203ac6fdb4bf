"""Preemption: SIGTERM to one rank, or Ctrl-C, stops every rank at one step with a checkpoint.

Rank 1 alone is signalled during step 5 of 10; rank 0 must learn it from the step-boundary flag (reduced
during step 6, read at its end), every rank stops after step 6 (a step no periodic checkpoint saves),
``last.ckpt`` is written, the exit status is 75, and ``ckpt_path="last"`` finishes the run with the
weights of an undisturbed one (`torch.equal`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from syncline.trainer import Trainer
from syncline.trainer.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch
from tests.trainer._faults import ROOT, run_script, start_steps
from tests.trainer._tasks import Regressor, loader, regression_data

_FIT = """
import os, torch
from syncline.callbacks import ModelCheckpoint
from syncline.trainer import Trainer
from syncline.trainer.preemption import TrainingPreempted
from tests.trainer._faults import Faulty
from tests.trainer._tasks import loader, regression_data

def fit(name, fault, ckpt_path=None):
    torch.manual_seed(0)
    task = Faulty(fault, at_step=4, pids_dir={pids!r} if name == "preempted" else None, dropout=0.2)
    trainer = Trainer(
        max_steps=10,
        accelerator="cpu",
        devices=2,
        default_root_dir=os.path.join({root!r}, name),
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(every_n_train_steps=4, save_last=True, save_top_k=0)],
    )
    trainer.fit(task, loader(regression_data(64), shuffle=True), ckpt_path=ckpt_path)
    return task.state_dict(), trainer.global_step

if __name__ == "__main__":
    clean, steps = fit("clean", None)
    try:
        fit("preempted", "term")
    except TrainingPreempted as stop:
        print(f"status {{stop.code}}: {{stop}}")
    resumed, resumed_steps = fit("preempted", None, ckpt_path="last")
    same = all(torch.equal(clean[k], resumed[k]) for k in clean)
    print(f"same weights: {{same}} after {{steps}} and {{resumed_steps}} steps")
"""


def test_sigterm_to_one_rank_stops_all_at_one_step_and_resume_is_bit_exact(tmp_path: Path) -> None:
    (tmp_path / "pids").mkdir()
    result, _ = run_script(tmp_path, _FIT.format(pids=str(tmp_path / "pids"), root=str(tmp_path)), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    last = tmp_path / "preempted" / "checkpoints" / "last.ckpt"
    assert f"status {PREEMPTED_EXIT_CODE}: Stopped by SIGTERM after step 6; saved {last}." in result.stdout
    assert "same weights: True after 10 and 10 steps" in result.stdout, result.stdout + result.stderr[-3000:]
    # The preempted workers from step 0, then the resumed ones from the preemption's step 6.
    assert start_steps(tmp_path / "pids") == [0, 0, 6, 6]


def test_ctrl_c_on_the_cli_checkpoints_and_exits_with_the_preemption_status(tmp_path: Path) -> None:
    """Ctrl-C signals the CLI and every worker (one process group): one graceful stop, status 75."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "syncline",
            "task._target_=tests.trainer._faults.Faulty",
            "+task.fault=group_int",
            f"hydra.run.dir={tmp_path / 'run'}",
            "trainer.devices=2",
            "trainer.accelerator=cpu",
            "trainer.max_steps=10",
            "trainer.max_epochs=5",
            "trainer.enable_progress_bar=false",
            "callbacks=[checkpoint]",
            "callbacks.checkpoint.monitor=null",  # the task has no validation data
        ],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr[-3000:]
    # The SIGINT reaches rank 0 during step 4 or, if it lags, at the end of step 3: one or two steps later.
    stopped = re.search(r"preempted: Stopped by SIGINT after step (\d+); saved (\S+last\.ckpt)\.", result.stderr)
    assert stopped is not None and int(stopped.group(1)) in (4, 5), result.stderr
    assert stopped.group(2).startswith(str(tmp_path / "run"))
    checkpoint = torch.load(stopped.group(2), weights_only=False)
    assert checkpoint["progress"]["global_step"] == int(stopped.group(1))


def test_a_second_signal_takes_the_default_action() -> None:
    """After the first signal (a flag), the handler steps aside, so a second one ends the process at once."""
    import signal

    watch = PreemptionWatch("SIGUSR1")
    watch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.received == signal.SIGUSR1
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) == watch._on_signal  # Ctrl-C is still watched
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


_PLAIN = """
import os, signal, torch
from syncline.callbacks import Callback
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, regression_data

class SignalAt(Callback):
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

torch.manual_seed(0)
trainer = Trainer(max_steps=10, logger=False, enable_progress_bar=False, callbacks=[SignalAt()])
trainer.fit(Regressor(optimizer="adam"), loader(regression_data(64), shuffle=True))
"""


def test_a_plain_script_says_what_a_preemption_saved_and_the_resume_says_what_it_restored(tmp_path, capfd):
    """No try/except in the script: the uncaught stop exits 75 and rank 0 has said what it saved and where."""
    result, _ = run_script(tmp_path, _PLAIN, timeout=120)
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"  # the default ModelCheckpoint's folder without a logger
    said = f'preempted: Stopped by SIGTERM after step 3; saved {last}. Resume with ckpt_path="last" (exit status 75).'
    assert said in result.stderr.splitlines(), result.stderr[-3000:]
    torch.manual_seed(0)
    trainer = Trainer(max_steps=10, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(Regressor(optimizer="adam"), loader(regression_data(64), shuffle=True), ckpt_path="last")
    assert trainer.global_step == 10
    resumed = [line for line in capfd.readouterr().err.splitlines() if line.startswith("Resumed from")]
    assert resumed == [
        f"Resumed from {last} at epoch 0, global step 3, after batch 3 of the epoch; restored the weights, optimizer "
        "state (Adam), the progress and random generators, callbacks (ModelCheckpoint)."
    ]
