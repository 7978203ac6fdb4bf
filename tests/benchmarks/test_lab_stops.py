"""Ctrl-C or SIGTERM to the network lab ends every torchrun agent, worker and namespace it started within 10 s.

A two-node lab runs a job that would sleep for ten minutes; each worker records its own pid, its agent's and
the lab's (the process that owns the namespaces). After the signal to the command, every one of them is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncline.lab.cluster import namespaces_unavailable

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))

ROOT = Path(__file__).resolve().parents[2]

_JOB = """
import os, sys, time
agent = os.getppid()  # torchrun: `ip netns exec` runs it in its own process
with open(f"/proc/{agent}/stat") as stat:
    lab = int(stat.read().rsplit(")", 1)[1].split()[1])
with open(os.path.join(sys.argv[1], f"{os.getpid()}.pids"), "w") as out:
    out.write(f"{os.getpid()} {agent} {lab}")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_lab_ends_every_agent_worker_and_namespace_within_10_s(tmp_path, signum):
    job, pids_dir = tmp_path / "job.py", tmp_path / "pids"
    job.write_text(_JOB)
    pids_dir.mkdir()
    command = [sys.executable, "-m", "benchmarks", "lab", "cluster", "--nodes", "2", "--timeout", "120"]
    lab = subprocess.Popen(
        [*command, "--log-dir", str(tmp_path / "logs"), "--", str(job), str(pids_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(pids_dir.glob("*.pids"))) < 2 and lab.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        started = {int(pid) for file in pids_dir.glob("*.pids") for pid in file.read_text().split()}
        assert len(started) == 5, (started, lab.poll())  # two workers, two agents, one lab
        lab.send_signal(signum)
        sent = time.monotonic()
        while any(_alive(pid) for pid in started) and time.monotonic() - sent < 10:
            time.sleep(0.1)
        left = sorted(pid for pid in started if _alive(pid))
        assert not left, f"still running {time.monotonic() - sent:.1f} s after {signum.name}: {left}"
        output, _ = lab.communicate(timeout=10)
        assert lab.returncode == 130, output
        assert "stopped" in output and "Traceback" not in output, output
    finally:
        if lab.poll() is None:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
