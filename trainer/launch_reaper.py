"""End every process of a launch when the process that launched it dies, at any moment, imports included.

A worker's own guard (`worker_guard`) ends it within the grace period once its launcher is gone, with
``last.ckpt`` when it can; but the guard runs only once the worker has imported the script that started
it (torch alone takes seconds), and a worker that never gets that far cannot watch anything. So `launch`
also starts this reaper: a small process (the standard library only, no torch) that learns of the
launcher's death at once (the pipe from it closes without a goodbye), waits the grace period plus a
margin for the workers to save and end by themselves, and then SIGKILLs whatever is left of the launch:
every process whose environment carries the launch's id (`LAUNCH_ENV`), the workers, their data-loader
processes and the resource tracker they share. A launch that ends normally says goodbye and the reaper
exits.

Run as a script (``python -I -S launch_reaper.py PID ID GRACE``), not imported, so it starts in tens of
milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["GOODBYE", "MARGIN_S", "reap_after", "start"]

#: What the launcher writes to the reaper's stdin when the launch ended normally.
GOODBYE = b"done\n"
#: Seconds past the grace period before the reaper kills: the workers' own deadline comes first.
MARGIN_S = 2.0
#: How often the reaper looks for what is left of the launch.
_POLL_S = 0.2


def start(launcher: int, launch_id: str, grace_s: float) -> subprocess.Popen[bytes]:
    """Start the reaper of the launch `launch_id` of process `launcher`; write `GOODBYE` to its stdin to end it."""
    env = {k: v for k, v in os.environ.items() if launch_id not in v}
    return subprocess.Popen(
        [sys.executable, "-I", "-S", __file__, str(launcher), launch_id, repr(grace_s)],
        stdin=subprocess.PIPE,
        env=env,
        # Its own session: Ctrl-C in the terminal, or a signal to the caller's process group, leaves it be.
        start_new_session=True,
    )


def _launch_processes(launch_id: str) -> list[int]:
    """The live processes (not zombies) whose initial environment carries `launch_id`, this one excepted."""
    needle = launch_id.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def reap_after(launch_id: str, seconds: float) -> None:
    """Wait up to `seconds` for the processes of `launch_id` to end by themselves; SIGKILL those left."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _launch_processes(launch_id):
            return
        time.sleep(_POLL_S)
    for pid in _launch_processes(launch_id):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _main(launcher: int, launch_id: str, grace_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    received = b""
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], _POLL_S)
        if ready:
            data = os.read(sys.stdin.fileno(), 64)
            received += data
            if received.endswith(GOODBYE):
                return  # the launch ended normally
            if data:
                continue
            break  # the pipe closed without a goodbye: the launcher died
        if os.getppid() != launcher:
            break
    reap_after(launch_id, grace_s + MARGIN_S)


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
