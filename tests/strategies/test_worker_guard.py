"""Nothing outlives a failure, with real launched processes.

- SIGKILL of the process that called `fit` while its workers spawn or import: every process of the
  launch is gone within a minute (they used to wait 300 s for a store that was gone).
- SIGKILL of the caller during a 5 s step: the step finishes, every rank saves `last.ckpt`, and all end
  within the grace period; when a rank is stuck, within the grace period too.
- A rank stuck in compute when a peer raised: the agent's SIGTERM ends it at once (not after 30 s).
- The configured preemption signal (SIGUSR1) to the caller: every rank stops after one step with
  `last.ckpt`, status 75 and the path.
- A script without a main guard whose task is larger than a pipe's buffer: the one message, at once.
- A strategy option that cannot work on `devices` processes: refused before any process starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from syncline.checkpoint_file import load_checkpoint
from syncline.options import OptionError
from syncline.strategies import ParameterServer
from syncline.strategies.comm.worker_guard import GRACE_ENV, GRACE_S
from syncline.trainer import Trainer
from syncline.trainer.preemption import PREEMPTED_EXIT_CODE
from tests.trainer._faults import left_behind, run_script, script_env

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")

#: A task whose rank `stuck_rank` sleeps `stuck_s` seconds in the training step at step `at_step`,
#: whose rank `raise_rank` raises there, and whose steps take `step_s` seconds each.
_SCRIPT = """
import multiprocessing, os, sys, time
from pathlib import Path
if os.environ.get("SYNCLINE_HANG_ON_IMPORT") and multiprocessing.parent_process() is not None:
    time.sleep(600)  # a worker that never finishes importing this script
from syncline.callbacks import ModelCheckpoint
from syncline.trainer import Trainer
from syncline.trainer.preemption import TrainingPreempted
from tests.trainer._faults import Faulty
from tests.trainer._tasks import loader, regression_data


class Slow(Faulty):
    def training_step(self, batch, batch_idx):
        Path({pids!r}, "training").touch()
        step = self.trainer.global_step
        if step == {at_step} and self.global_rank == {stuck_rank}:
            Path({pids!r}, "stuck").write_text(str(time.time()))
            time.sleep({stuck_s})
        if step == {at_step} and self.global_rank == {raise_rank}:
            raise ValueError("boom on rank {raise_rank}")
        time.sleep({step_s})
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    task = Slow(None, pids_dir={pids!r})
    trainer = Trainer(
        max_steps={max_steps}, accelerator="cpu", devices=2, default_root_dir={root!r}, logger=False,
        enable_progress_bar=False, strategy={strategy!r}, preemption_signal={preemption_signal!r},
        callbacks=[ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=1000)],
    )
    try:
        trainer.fit(task, loader(regression_data(64), shuffle=True))
    except TrainingPreempted as stop:
        print(f"preempted: {{stop}}", flush=True)
        sys.exit(stop.code)
"""


def _start(tmp_path: Path, env: dict[str, str] | None = None, **fields) -> tuple[subprocess.Popen, Path]:
    """Start the script in tmp_path; every process it starts carries `_TAG` = tmp_path in its environment."""
    pids = tmp_path / "pids"
    pids.mkdir()
    values = {"at_step": -1, "stuck_rank": -1, "raise_rank": -1, "stuck_s": 0, "step_s": 0.05, "max_steps": 100000}
    values.update({"strategy": "bucketed_ddp", "preemption_signal": "SIGTERM"})
    values.update(fields)
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(_SCRIPT.format(pids=str(pids), root=str(tmp_path / "run"), **values)))
    process = subprocess.Popen(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env={**script_env(), _TAG: _tag(tmp_path), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return process, pids


def _wait_for(condition, timeout: float, what: str) -> float:
    """Poll `condition` until it holds; return the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


#: The environment variable that marks every process a test's script starts (inherited by all descendants).
_TAG = "SYNCLINE_TEST_TAG"


def _tag(tmp_path: Path) -> str:
    return f"{tmp_path.name}-{uuid.uuid5(uuid.NAMESPACE_URL, str(tmp_path)).hex[:12]}"


def _descendants(tmp_path: Path) -> list[int]:
    """The live processes (zombies excepted) whose environment carries this test's tag, orphans included."""
    needle = f"{_TAG}={_tag(tmp_path)}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            mine = entry.name.isdigit() and needle in (entry / "environ").read_bytes()
            if mine and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
    return found


def _spawned(tmp_path: Path) -> bool:
    """Whether the launch has spawned a worker (a descendant started by multiprocessing's spawn)."""
    for pid in _descendants(tmp_path):
        try:
            if b"--multiprocessing-fork" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def _kill_leftovers(pids: Path) -> None:
    for pid in left_behind(pids) + _descendants(pids.parent):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "local_sgd"])
def test_the_caller_killed_while_its_workers_import_leaves_nothing_behind(tmp_path: Path, strategy: str) -> None:
    # Killed 0.3 s and 1 s after its workers were spawned (while they import torch and the script), two
    # callers side by side; the second with a script that never finishes importing in the workers, which
    # only the launch's reaper can end (after the grace period, shortened here).
    runs = {}
    for delay, hang in ((0.3, False), (1.0, True)):
        folder = tmp_path / f"after_{delay:g}s"
        folder.mkdir()
        env = {"SYNCLINE_HANG_ON_IMPORT": "1", GRACE_ENV: "5"} if hang else {}
        runs[delay] = (folder, *_start(folder, env=env, strategy=strategy))
    killed_at = {}
    try:
        for delay, (folder, process, _) in runs.items():
            _wait_for(lambda folder=folder: _spawned(folder), 90, "the workers to be spawned")
            time.sleep(delay)
            process.kill()  # the OOM killer, kill -9
            killed_at[delay] = time.monotonic()
        for delay, (folder, _, _) in runs.items():
            _wait_for(lambda folder=folder: not _descendants(folder), 60, f"every process, killed after {delay} s")
            assert time.monotonic() - killed_at[delay] < 60
    finally:
        for _, process, pids in runs.values():
            _kill_leftovers(pids)
            process.kill()
            process.wait(10)


def test_sigkill_of_the_caller_during_a_5_s_step_saves_last_ckpt_and_ends_every_worker(tmp_path: Path) -> None:
    process, pids = _start(tmp_path, step_s=5.0)
    try:
        _wait_for(lambda: (pids / "training").exists(), 90, "the workers to start training")
        time.sleep(1.0)  # inside the first 5 s step
        process.kill()
        process.wait(10)
        gone = _wait_for(lambda: not _descendants(tmp_path), GRACE_S + 10, "the orphaned workers to end")
    finally:
        _kill_leftovers(pids)
        process.kill()
    _, stderr = process.communicate(timeout=10)  # the workers' output: they held the pipe
    # The step in flight finished, the ranks agreed at the next, saved, and ended inside the grace.
    assert gone < GRACE_S, stderr[-3000:]
    (last,) = (tmp_path / "run").rglob("last.ckpt")
    assert load_checkpoint(last)["progress"]["global_step"] > 0
    assert "is gone; stopping after the step in flight" in stderr
    # The closed store's C++ warnings (a stack of `frame #` lines per rank) are not printed.
    assert "frame #" not in stderr, stderr[-3000:]


def test_sigkill_of_the_caller_ends_a_stuck_worker_within_the_grace(tmp_path: Path) -> None:
    # Rank 1 sleeps in its step; rank 0 waits for it in the gradient all-reduce. A short grace period
    # keeps the test short; it is the same path as the default.
    process, pids = _start(tmp_path, env={GRACE_ENV: "4"}, at_step=2, stuck_rank=1, stuck_s=600)
    try:
        _wait_for(lambda: (pids / "stuck").exists(), 90, "rank 1 to get stuck")
        time.sleep(0.5)
        process.kill()
        process.wait(10)
        gone = _wait_for(lambda: not _descendants(tmp_path), 4 + 20, "the orphaned workers to end")
    finally:
        _kill_leftovers(pids)
        process.kill()
    assert gone <= 4 + 3, gone


def test_a_rank_stuck_in_compute_when_a_peer_raised_ends_at_once(tmp_path: Path) -> None:
    # The agent stops the group with SIGTERM after rank 1 raised; rank 0 must not take it for a
    # preemption (finish the step, save) and wait for the agent's SIGKILL 10-30 s later.
    process, pids = _start(tmp_path, at_step=2, stuck_rank=0, raise_rank=1, stuck_s=600)
    try:
        _, stderr = process.communicate(timeout=60)
        _wait_for(lambda: (pids / "stuck").exists(), 1, "rank 0 to get stuck")
        seconds = time.time() - float((pids / "stuck").read_text())
    finally:
        _kill_leftovers(pids)
        process.kill()
    assert process.returncode == 1, stderr[-3000:]
    assert "Worker rank 1 of 2 failed during fit: ValueError" in stderr
    assert "boom on rank 1" in stderr
    assert seconds < 8, f"the job ended {seconds:.1f} s after rank 0 got stuck"
    assert not left_behind(pids)


def test_the_preemption_signal_to_the_caller_stops_every_rank_with_last_ckpt_and_status_75(tmp_path: Path) -> None:
    # SLURM's `--signal=USR1` reaches the caller too (SIGTERM from Kubernetes or docker takes the same path).
    process, pids = _start(tmp_path, preemption_signal="SIGUSR1")
    try:
        _wait_for(lambda: len(list(pids.glob("*.pid"))) == 2, 90, "both workers to start training")
        time.sleep(1.0)
        process.send_signal(signal.SIGUSR1)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        _kill_leftovers(pids)
        process.kill()
    (last,) = (tmp_path / "run").rglob("last.ckpt")
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "SIGUSR1: stopping at the next step and saving a checkpoint" in stderr
    assert "preempted: Stopped by SIGUSR1 after step" in stdout
    assert f"saved {last}" in stdout
    step = load_checkpoint(last)["progress"]["global_step"]
    assert f"after step {step};" in stdout
    assert not left_behind(pids)


def test_a_large_task_without_a_main_guard_gets_the_message_at_once(tmp_path: Path) -> None:
    # The pickled task (128 kB of weights) is larger than a pipe's buffer (64 kB).
    result, seconds = run_script(
        tmp_path,
        """
        import torch
        from syncline.trainer import Task, Trainer
        from tests.trainer._tasks import Regressor, loader, quiet, regression_data

        class Wide(Regressor):
            def __init__(self):
                super().__init__()
                self.wide = torch.nn.Linear(8, 4000)

        Trainer(max_steps=2, accelerator="cpu", devices=2, **quiet()).fit(Wide(), loader(regression_data(16)))
        """,
        timeout=90,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "train.py, which starts training when it is imported" in result.stderr
    assert seconds < 60


def test_a_strategy_option_that_needs_more_processes_is_refused_before_launch() -> None:
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=ParameterServer(server_rank=5), logger=False, enable_progress_bar=False
    )
    start = time.monotonic()
    with pytest.raises(OptionError, match=r"server_rank=5\) needs at least 6 processes, but the job has 2"):
        trainer.fit(None, model=_NeverBuilt())  # type: ignore[arg-type]
    assert time.monotonic() - start < 5  # no process was started


class _NeverBuilt:
    """Stands in for a task: the check must come before anything looks at it."""
