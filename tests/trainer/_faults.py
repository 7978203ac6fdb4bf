"""A task that misbehaves on one rank at one step, and helpers to run scripts that train it.

`Faulty(fault=...)` trains like `Regressor` and, on rank `rank` when it reaches optimizer step `at_step`
(in the first attempt only, so that an elastic restart runs clean), raises, kills itself with SIGKILL,
signals itself with SIGTERM, or sends SIGINT to its whole process group (what Ctrl-C in a terminal
does). Each process writes its pid under `pids_dir` (with its rank and the step its training starts at),
so a test can check that none is left behind and where a restarted one resumed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.trainer._tasks import Regressor, loader, regression_data

ROOT = Path(__file__).resolve().parents[2]

#: What `Faulty` does at its step: the name of the fault.
FAULTS = ("raise", "kill", "term", "group_int")


class Faulty(Regressor):
    """`Regressor` that raises or is signalled on one rank at one optimizer step."""

    def __init__(
        self, fault: str | None, at_step: int = 3, rank: int = 1, pids_dir: str | None = None, dropout: float = 0.0
    ) -> None:
        super().__init__(dropout=dropout)
        self.fault, self.at_step, self.fault_rank, self.pids_dir = fault, at_step, rank, pids_dir

    def train_dataloader(self):
        return loader(regression_data(64), shuffle=True)

    def on_train_start(self) -> None:
        if self.pids_dir is not None:
            # Where training starts: 0, or the step of the checkpoint a restarted process resumed from.
            Path(self.pids_dir, f"{os.getpid()}.pid").write_text(f"{self.global_rank} {self.trainer.global_step}")

    def training_step(self, batch, batch_idx):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.global_rank == self.fault_rank and self.trainer.global_step == self.at_step and first_attempt:
            if self.fault == "raise":
                raise ValueError(f"boom on rank {self.fault_rank}")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            if self.fault == "group_int":
                os.killpg(os.getpgrp(), signal.SIGINT)
        return super().training_step(batch, batch_idx)


def script_env() -> dict[str, str]:
    """The environment of a script that a test starts: this checkout importable, no process group inherited."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "GLOO_SOCKET_IFNAME"):
        env.pop(name, None)
    return env


def run_script(
    tmp_path: Path, body: str, *command: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float]:
    """Write `body` to tmp_path/train.py, run it (with `command` in front, e.g. torchrun); return it and its seconds."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    env = script_env()
    start = time.monotonic()
    result = subprocess.run(
        [*(command or (sys.executable,)), str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        start_new_session=True,  # its own process group, for the Ctrl-C test
    )
    return result, time.monotonic() - start


def left_behind(pids_dir: Path) -> list[int]:
    """Return the pids written under `pids_dir` whose processes still run (zombies count as gone)."""
    alive = []
    for file in pids_dir.glob("*.pid"):
        pid = int(file.stem)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def start_steps(pids_dir: Path) -> list[int]:
    """Return the step each process under `pids_dir` started training at, sorted."""
    return sorted(int(file.read_text().split()[1]) for file in pids_dir.glob("*.pid"))
