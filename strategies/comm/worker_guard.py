"""A worker ends when whoever started it is gone, and a teardown's SIGTERM is not taken for a preemption.

An elastic agent (syncline's launcher, or torchrun) starts the workers and stops them. Two of its
messages are easy to misread from inside a worker:

- **The agent died** (SIGKILL, the out-of-memory killer). Nobody will collect the result, and a worker
  that finishes its stage then waits forever for a parent that is gone, holding its ports. A thread
  watches the parent: once it is gone, the worker asks the loop to stop (as SIGHUP, so every rank saves
  ``last.ckpt`` at the next step, when they still can) and ends within `ORPHAN_GRACE_S` seconds,
  whatever it is doing. (torch's spawn would deliver SIGINT instead, which reads as Ctrl-C; the guard
  switches that off.)
- **The agent stops the group because another worker failed.** It sends SIGTERM, which the preemption
  handler would take for a preemption: finish the step, save, stop. A rank stuck in compute then lives
  until the agent's SIGKILL, 30 s later. When a SIGTERM arrives while a sibling worker (another child of
  the same agent) has already exited, it is a teardown, and the worker ends at once. The signal is
  seen by a thread through `signal.set_wakeup_fd`, so this holds even while the main thread sits in one
  long C call, where no Python handler runs.

The launcher also asks its workers to stop through a file (`request_stop`) when the launching process
itself is signalled: a SIGTERM to the caller (Kubernetes, ``docker stop``) then stops every rank after
the same step with ``last.ckpt``, as a SIGTERM to a worker does, without a second signal to any worker.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "ORPHAN_GRACE_S",
    "PEER_FAILURE_GRACE_S",
    "announce_failure",
    "external_stop_request",
    "request_stop",
    "stage_finished",
    "start",
    "watch_peers",
]

#: Seconds a worker lives on after its agent died: long enough to finish a step and save `last.ckpt`.
ORPHAN_GRACE_S = 10.0
#: How often the parent is checked.
_POLL_S = 0.2
#: How often the store is asked whether a rank of the job failed.
_PEER_POLL_S = 1.0
#: Seconds a rank gets to end by itself (its collective fails at once) after another rank failed.
PEER_FAILURE_GRACE_S = 3.0
#: The store key a failing rank sets (the store's prefix keeps restarted attempts apart).
_FAILED_KEY = "syncline/failed"
#: Exit status of a worker that ended itself: killed by SIGTERM, as the agent would have done.
_TERMINATED = 128 + signal.SIGTERM


class _Guard:
    def __init__(self) -> None:
        self.parent = 0
        self.siblings: set[int] = set()
        self.orphaned = threading.Event()
        self.finished = threading.Event()
        self.stop_file: Path | None = None
        self.started = False
        self.peers_watched = False
        self.exiting = threading.Event()
        self.failing = False


_GUARD = _Guard()


def start(stop_file: str | os.PathLike[str] | None = None, grace_s: float = ORPHAN_GRACE_S) -> None:
    """Watch this worker's parent and the SIGTERMs it receives (once per process; later calls do nothing).

    Args:
        stop_file: a file whose appearance asks the loop to stop (written by `request_stop`).
        grace_s: seconds this process may live on once its parent is gone.
    """
    if stop_file is not None:
        _GUARD.stop_file = Path(stop_file)
    if _GUARD.started:
        return
    _GUARD.started = True
    # torch's spawn asks the kernel for SIGINT when the parent dies, which reads as Ctrl-C; the parent
    # watch below says what happened instead (SIGHUP), whatever handler is in place at that moment.
    with contextlib.suppress(Exception):
        from torch.multiprocessing import _prctl_pr_set_pdeathsig

        _prctl_pr_set_pdeathsig(0)
    _GUARD.parent = os.getppid()
    _GUARD.siblings = _children(_GUARD.parent) - {os.getpid()}
    threading.Thread(target=_watch_parent, args=(grace_s,), name="syncline-parent-watch", daemon=True).start()
    _watch_sigterm()


def stage_finished() -> None:
    """Say that this worker's stage has returned: once orphaned, it has nothing left to wait for."""
    _GUARD.finished.set()


def external_stop_request() -> int:
    """Return the signal whose stop was asked from outside this process (0 if none).

    SIGHUP when the agent that started this worker is gone; the signal named in the stop file when the
    launching process was signalled. Cheap enough for every optimizer step (one `stat` with a stop file).
    """
    if _GUARD.orphaned.is_set():
        return int(signal.SIGHUP)
    if _GUARD.stop_file is not None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            return int(signal.Signals[_GUARD.stop_file.read_text().strip()])
    return 0


def request_stop(stop_file: str | os.PathLike[str], signum: int) -> None:
    """Ask the workers watching `stop_file` to stop after their current step (from the launching process)."""
    path = Path(stop_file)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(signal.Signals(signum).name)
    os.replace(tmp, path)  # whole or absent: a worker never reads half a name


def announce_failure(store: Any, rank: int, deadline_s: float = 2.0) -> None:
    """Tell every rank that this one failed, through the process group's store; never blocks past `deadline_s`.

    A rank blocked in a collective learns of a failure by itself (its peer's connections close), but one
    stuck in compute, or waiting on another node, would not: `watch_peers` ends it.
    """
    _GUARD.failing = True
    thread = threading.Thread(target=lambda: store.set(_FAILED_KEY, str(rank)), name="syncline-announce", daemon=True)
    thread.start()
    thread.join(deadline_s)  # on a cut link the store may never answer: the failing rank ends anyway


def watch_peers(store: Any, rank: int) -> None:
    """End this process soon after another rank of the job announced a failure (once per process).

    Polls the store every second in a daemon thread; a rank whose own stage is failing announces rather
    than being ended. Started only under an elastic agent, where a failed rank means the job is over.
    """
    if _GUARD.peers_watched:
        return
    _GUARD.peers_watched = True

    def watch() -> None:
        while not _GUARD.exiting.wait(_PEER_POLL_S):
            try:
                if not store.check([_FAILED_KEY]):
                    continue
                what = f"rank {store.get(_FAILED_KEY).decode()} failed"
            except Exception as error:
                if not _closed(error):
                    continue  # slow or cut off: the collectives' timeouts decide
                # The agent that hosts the store has exited: the job is over (it may have ended before
                # this rank read the failure key).
                what = "the job's store closed (the agent hosting it has exited)"
            if what == f"rank {rank} failed" or _GUARD.failing or _GUARD.finished.is_set():
                return  # this rank is failing itself and ends on its own path, or its stage is over
            # Its collective fails at once if it is in one; if it is stuck elsewhere, end it.
            time.sleep(PEER_FAILURE_GRACE_S)
            if _GUARD.finished.is_set():
                return
            print(
                f"syncline: rank {rank}: {what} and this rank did not stop by itself within "
                f"{PEER_FAILURE_GRACE_S:g} s (it is busy outside any collective); ending now.",
                file=sys.stderr,
                flush=True,
            )
            _end(1)

    thread = threading.Thread(target=watch, name="syncline-peer-watch", daemon=True)
    thread.start()

    def stop_watching() -> None:
        # Before the interpreter finalizes: a daemon thread caught inside a C++ store call then would abort
        # the process ("terminate called without an active exception").
        _GUARD.exiting.set()
        thread.join(_PEER_POLL_S + 1.0)

    atexit.register(stop_watching)


def _closed(error: BaseException) -> bool:
    """Whether a store error says the connection is gone (not merely slow)."""
    text = str(error).lower()
    return any(word in text for word in ("closed", "broken pipe", "reset by peer", "connection refused"))


def _watch_parent(grace_s: float) -> None:
    while os.getppid() == _GUARD.parent:
        # Siblings started after this one (the agent starts workers one by one) join the set.
        _GUARD.siblings |= _children(_GUARD.parent) - {os.getpid()}
        time.sleep(_POLL_S)
    _GUARD.orphaned.set()
    rank = os.environ.get("RANK", "?")
    print(
        f"syncline: rank {rank}: the process that started this worker (pid {_GUARD.parent}) is gone; stopping "
        f"at the next step and ending within {grace_s:g} s.",
        file=sys.stderr,
        flush=True,
    )
    _GUARD.finished.wait(grace_s)
    _end(1)


def _watch_sigterm() -> None:
    """See each signal as it arrives (through the wakeup fd), and end at once on a teardown's SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_end)
        os.close(write_end)
        return

    def watch() -> None:
        while True:
            data = os.read(read_end, 64)
            if not data:
                return
            if signal.SIGTERM in data and _sibling_gone():
                print(
                    f"syncline: rank {os.environ.get('RANK', '?')}: SIGTERM after another worker ended: the group is "
                    "being stopped, not preempted; ending now.",
                    file=sys.stderr,
                    flush=True,
                )
                _end(_TERMINATED)

    threading.Thread(target=watch, name="syncline-sigterm-watch", daemon=True).start()


def _sibling_gone() -> bool:
    """Whether a worker started by the same agent as this one has exited (a zombie or reaped)."""
    for pid in _GUARD.siblings:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
    return False


def _children(pid: int) -> set[int]:
    """The live children of process `pid` (Linux's /proc; empty where it is not available)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                found.update(int(child) for child in (task / "children").read_text().split())
    return found


def _end(code: int) -> None:
    """End this process now: no exit hooks (they would wait for peers that are gone or stopping)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
