"""A rank that dies or raises ends every rank within seconds, with one message naming it.

The bound: every other rank exits within 60 s, not after the 30-minute collective
timeout (before the fix, a rank that raised waited 60 s at exit for ranks blocked in a collective).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.trainer._faults import left_behind, run_script

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find processes left behind")

_SCRIPT = """
import sys
from syncline.trainer import Trainer
from tests.trainer._faults import Faulty
from tests.trainer._tasks import loader, quiet, regression_data

if __name__ == "__main__":
    task = Faulty({fault!r}, at_step=3, pids_dir={pids!r})
    Trainer(max_steps=8, strategy="bucketed_ddp", {devices}**quiet()).fit(task, loader(regression_data(64)))
"""


def test_sigkill_of_a_launched_worker_stops_the_run_with_one_message(tmp_path: Path) -> None:
    (tmp_path / "pids").mkdir()
    result, seconds = run_script(
        tmp_path, _SCRIPT.format(fault="kill", pids=str(tmp_path / "pids"), devices="accelerator='cpu', devices=2, ")
    )
    assert result.returncode == 1
    assert seconds < 60
    assert "WorkerFailedError: Worker rank 1 of 2 failed during fit: the process was killed by SIGKILL" in result.stderr
    assert "elastic" not in result.stderr and len(result.stderr.splitlines()) < 20, result.stderr
    assert len(list((tmp_path / "pids").iterdir())) == 2
    assert left_behind(tmp_path / "pids") == []


def test_exception_on_one_rank_under_torchrun_stops_every_rank(tmp_path: Path) -> None:
    (tmp_path / "pids").mkdir()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    result, seconds = run_script(
        tmp_path,
        _SCRIPT.format(fault="raise", pids=str(tmp_path / "pids"), devices="accelerator='cpu', "),
        torchrun,
        "--standalone",
        "--nproc-per-node=2",
    )
    assert result.returncode != 0
    # Was 60 s and more: rank 1 waited at exit in a barrier that rank 0, blocked in a training collective,
    # never reached.
    assert seconds < 30, seconds
    assert "ValueError: boom on rank 1" in result.stderr
    assert left_behind(tmp_path / "pids") == []
