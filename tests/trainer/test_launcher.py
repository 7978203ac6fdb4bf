"""`Trainer(devices=2)` launches workers that listen on loopback only and report a failure once, briefly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Inside a launched worker: every socket that the launching process and its workers listen on.
_LISTENING = """
import os

def listening_addresses():
    launcher = os.getppid()
    pids = {launcher}
    for tid in os.listdir(f"/proc/{launcher}/task"):
        with open(f"/proc/{launcher}/task/{tid}/children") as file:
            pids.update(int(pid) for pid in file.read().split())
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as file:
            for line in file.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    found.append((table[-4:], address, int(port, 16)))
    return found
"""


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "GLOO_SOCKET_IFNAME"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_local_launch_listens_on_loopback_only(tmp_path):
    out = tmp_path / "listening.json"
    result = _script(
        tmp_path,
        _LISTENING
        + f"""
import json
from syncline.callbacks import Callback
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

class Report(Callback):
    def on_train_start(self, trainer, task):
        if trainer.global_rank == 0:
            with open({str(out)!r}, "w") as file:
                json.dump({{"store": int(os.environ["MASTER_PORT"]), "sockets": listening_addresses()}}, file)

if __name__ == "__main__":
    trainer = Trainer(max_steps=2, accelerator="cpu", devices=2, callbacks=[Report()], **quiet())
    trainer.fit(Regressor(), loader(regression_data(16)))
""",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    sockets = [tuple(s) for s in report["sockets"]]
    assert ("/tcp", "0100007F", report["store"]) in sockets  # the rendezvous store, on 127.0.0.1
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1
    assert [s for s in sockets if s[1] not in loopback] == []


def test_worker_exception_is_reported_once_with_rank_and_traceback(tmp_path):
    result = _script(
        tmp_path,
        """
        from syncline.trainer import Trainer
        from tests.trainer._tasks import Regressor, loader, quiet, regression_data

        class FailsOnRankOne(Regressor):
            def training_step(self, batch, batch_idx):
                if self.global_rank == 1 and batch_idx == 1:
                    raise ValueError("boom on rank 1")
                return super().training_step(batch, batch_idx)

        if __name__ == "__main__":
            trainer = Trainer(max_steps=4, accelerator="cpu", devices=2, **quiet())
            trainer.fit(FailsOnRankOne(), loader(regression_data(32)))
        """,
    )
    assert result.returncode == 1
    stderr = result.stderr
    assert "WorkerFailedError: Worker rank 1 of 2 failed during fit: ValueError in this traceback:" in stderr
    assert stderr.count("ValueError: boom on rank 1") == 1
    assert 'in training_step\n    raise ValueError("boom on rank 1")' in stderr
    assert "elastic" not in stderr and len(stderr.splitlines()) < 60, stderr


def test_script_without_main_guard_gets_one_message_saying_what_to_change(tmp_path):
    result = _script(
        tmp_path,
        """
        from syncline.trainer import Trainer
        from tests.trainer._tasks import Regressor, loader, quiet, regression_data

        Trainer(max_steps=2, accelerator="cpu", devices=2, **quiet()).fit(Regressor(), loader(regression_data(16)))
        """,
    )
    assert result.returncode == 1
    assert "train.py, which starts training when it is imported" in result.stderr
    assert 'under `if __name__ == "__main__":`' in result.stderr
    assert "bootstrapping phase" not in result.stderr
    assert len(result.stderr.splitlines()) < 30, result.stderr


def test_launch_folders_of_callers_that_no_longer_run_are_removed(tmp_path, monkeypatch):
    from syncline.trainer import launcher

    monkeypatch.setattr(launcher.tempfile, "tempdir", str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"syncline-launch-{int(ended.stdout)}-abc"
    mine = tmp_path / f"syncline-launch-{os.getpid()}-def"
    other = tmp_path / "syncline-launch-xyz"  # not a launch folder of this version: left alone
    for folder in (gone, mine, other):
        (folder / "attempt_0").mkdir(parents=True)
        (folder / "payload.pkl").write_bytes(b"x")
    launcher.remove_stale_launch_dirs()
    assert not gone.exists() and mine.exists() and other.exists()
