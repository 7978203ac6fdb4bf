"""A worker ends when whoever started it is gone, and a teardown's SIGTERM is not taken for a preemption.

An elastic agent (syncline's launcher, or torchrun) starts the workers and stops them. Two of its
messages are easy to misread from inside a worker:

- **The job is over**: the agent died (SIGKILL, the out-of-memory killer), its store closed, or another
  rank announced a failure. Nobody will collect the result, and a worker that finishes its stage then
  waits forever for a parent that is gone, holding its ports. However a rank learns it, it gets the same
  grace period, `grace_s()` seconds (`GRACE_S`, or ``SYNCLINE_GRACE_S``): it asks the loop to stop (as
  SIGHUP, so the step in flight finishes and every rank saves ``last.ckpt`` when they still can) and
  ends when the grace is over, whatever it is doing. (torch's spawn would deliver SIGINT instead, which
  reads as Ctrl-C; the guard switches that off.) The launcher passes its pid to its workers when it
  starts them (`LAUNCH_ENV`), so a worker whose launcher died while it was still importing knows it
  the moment it starts, instead of recording its new parent (init) as its launcher.
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
    "GRACE_S",
    "LAUNCH_ENV",
    "announce_failure",
    "external_stop_request",
    "grace_s",
    "job_over",
    "request_stop",
    "stage_finished",
    "start",
    "watch_peers",
    "watched",
]

#: Seconds a rank lives on once it learns that the job is over (its agent died, the store closed, a peer
#: failed): the step in flight, the step in which the ranks agree to stop, and the save of `last.ckpt`
#: must fit in it. 30 s is what Kubernetes (terminationGracePeriodSeconds) and SLURM (KillWait) give a
#: job between SIGTERM and SIGKILL by default.
GRACE_S = 30.0
#: The environment variable that overrides `GRACE_S` (seconds).
GRACE_ENV = "SYNCLINE_GRACE_S"
#: The environment variable in which `launch` passes "<its pid>-<launch id>" to every process it starts.
LAUNCH_ENV = "SYNCLINE_LAUNCH"
#: How often the parent is checked.
_POLL_S = 0.2
#: How often the store is asked whether a rank of the job failed.
_PEER_POLL_S = 1.0
#: The store key a failing rank sets (the store's prefix keeps restarted attempts apart).
_FAILED_KEY = "syncline/failed"
#: Exit status of a worker that ended itself: killed by SIGTERM, as the agent would have done.
_TERMINATED = 128 + signal.SIGTERM


class _Guard:
    def __init__(self) -> None:
        self.parent = 0
        self.siblings: set[int] = set()
        #: Set once this rank learns that the job is over; the loop then stops at the next step.
        self.over = threading.Event()
        self.over_lock = threading.Lock()
        self.finished = threading.Event()
        self.stop_file: Path | None = None
        self.started = False
        self.peers_watched = False
        self.exiting = threading.Event()
        self.failing = False


_GUARD = _Guard()


def grace_s() -> float:
    """Return the grace period in seconds: ``SYNCLINE_GRACE_S`` when set to a positive number, else `GRACE_S`."""
    with contextlib.suppress(KeyError, ValueError):
        value = float(os.environ[GRACE_ENV])
        if value > 0 and value != float("inf"):
            return value
    return GRACE_S


def launcher_pid() -> int | None:
    """Return the pid of the `launch` that started this process (from `LAUNCH_ENV`), or None."""
    with contextlib.suppress(KeyError, ValueError):
        return int(os.environ[LAUNCH_ENV].split("-", 1)[0])
    return None


def start(stop_file: str | os.PathLike[str] | None = None, parent: int | None = None) -> bool:
    """Watch this worker's parent and the SIGTERMs it receives (once per process; later calls do nothing).

    Args:
        stop_file: a file whose appearance asks the loop to stop (written by `request_stop`).
        parent: the pid of the process that started this one, as it passed it in; None reads the current
            parent, which is init (or a subreaper) when the real one is already gone.

    Returns:
        False when the parent is already gone (the job is over before it began), else True.
    """
    if stop_file is not None:
        _GUARD.stop_file = Path(stop_file)
    if _GUARD.started:
        return not _GUARD.over.is_set()
    _GUARD.started = True
    # torch's spawn asks the kernel for SIGINT when the parent dies, which reads as Ctrl-C; the parent
    # watch below says what happened instead (SIGHUP), whatever handler is in place at that moment.
    with contextlib.suppress(Exception):
        from torch.multiprocessing import _prctl_pr_set_pdeathsig

        _prctl_pr_set_pdeathsig(0)
    _GUARD.parent = os.getppid() if parent is None else parent
    if os.getppid() != _GUARD.parent:
        _GUARD.over.set()  # nothing has run yet: the caller ends at once
        return False
    _GUARD.siblings = _children(_GUARD.parent) - {os.getpid()}
    threading.Thread(target=_watch_parent, name="syncline-parent-watch", daemon=True).start()
    _watch_sigterm()
    return True


def stage_finished() -> None:
    """Say that this worker's stage has returned: once the job is over, it has nothing left to wait for."""
    _GUARD.finished.set()


def watched() -> bool:
    """Whether anything outside this process may ask it to stop: `start` or `watch_peers` ran, or a stop file is
    set. Otherwise `external_stop_request` can only return 0 (a plain script, a notebook)."""
    return _GUARD.started or _GUARD.peers_watched or _GUARD.stop_file is not None


def external_stop_request() -> int:
    """Return the signal whose stop was asked from outside this process (0 if none).

    SIGHUP when the job is over (the agent that started this worker is gone, its store closed, a peer
    failed); the signal named in the stop file when the launching process was signalled. Cheap enough
    for every optimizer step (one `stat` with a stop file).
    """
    if _GUARD.over.is_set():
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
    than being ended. Started only under an elastic agent, where a failed rank means the job is over, and
    not under `launch` (one machine), whose agent stops the group itself after a failure and whose death
    the parent watch sees first (a store call on the closed socket would print C++ warnings).
    """
    if _GUARD.peers_watched or (_GUARD.parent and _GUARD.parent == launcher_pid()):
        return
    _GUARD.peers_watched = True

    def watch() -> None:
        while not _GUARD.exiting.wait(_PEER_POLL_S):
            if _GUARD.over.is_set() or (_GUARD.parent and os.getppid() != _GUARD.parent):
                return  # the parent watch has it, without the store's C++ warnings about a closed socket
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
            # Its collective fails at once if it is in one; if it is stuck elsewhere, the grace ends it. A
            # closed store means the agent is gone: nobody collects a result, so a finished stage ends at once.
            job_over(what, end_when_finished=what.startswith("the job's store closed"))
            return

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


def job_over(what: str, end_when_finished: bool = True) -> None:
    """Stop at the next step (as SIGHUP), then end this process when the grace period is over.

    The one path for every way a rank learns that the job is over; the first call wins, later ones return
    at once. Blocks its (watch) thread until the process ends.

    Args:
        what: what happened, for the one line this prints.
        end_when_finished: end at once when the stage returns (nobody collects the result: the agent is
            gone); False leaves a finished stage to end the process its own way.
    """
    with _GUARD.over_lock:
        if _GUARD.over.is_set():
            return
        _GUARD.over.set()
    grace = grace_s()
    deadline = time.monotonic() + grace
    print(
        f"syncline: rank {os.environ.get('RANK', '?')}: {what}; stopping after the step in flight (saving "
        f"last.ckpt if the ranks still can) and ending within {grace:g} s.",
        file=sys.stderr,
        flush=True,
    )
    # C++ warnings of the store and of gloo about connections that the end of the job closed say nothing more.
    _silence_native_stderr()
    if _GUARD.finished.wait(max(0.0, deadline - time.monotonic())) and not end_when_finished:
        return
    _end(1)


def _silence_native_stderr() -> None:
    """Send what C++ writes to stderr (fd 2) to /dev/null; Python's `sys.stderr` keeps the original."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        keep = os.dup(2)
        sys.stderr = os.fdopen(keep, "w", buffering=1, closefd=False)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def _watch_parent() -> None:
    while os.getppid() == _GUARD.parent:
        # Siblings started after this one (the agent starts workers one by one) join the set.
        _GUARD.siblings |= _children(_GUARD.parent) - {os.getpid()}
        time.sleep(_POLL_S)
    job_over(f"the process that started this worker (pid {_GUARD.parent}) is gone")


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
