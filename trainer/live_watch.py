"""Every member of a live run aborts its round's group as soon as any member learns of a loss in that round.

With gloo, a member learns of a death from its collective only if it talks to the dead one directly: with 4
members or more, one that is not next to it in gloo's ring stays blocked in its all-reduce, on peers that are
alive but have left the collective, until the group's timeout (30 s in 3 of 4 lab runs with 4 nodes). So the
first member whose collective fails posts the loss in the run's store, one key per round (`LossWatch.post`),
and each member's `LossWatch` thread, polling that key every `POLL_S` seconds with a store client of its
own (a `TCPStore` client is not shared between threads), aborts the member's group when it appears
(`abort_default_group`): the blocked collective raises at once and the member takes the survivor's path.
A raise on a member (the job's failure notice) aborts the group too, so that no member waits out its
timeout before reading that notice. A member that stops sending the rendezvous's keep-alives while its
connections stay open (a frozen process, a node whose link was cut) fails nobody's collective: the watch
reads the round's keep-alives too, and posts such a member as the round's loss.

The watch is armed for one round at a time: disarmed before its group is left, armed again once the next
one is joined, so a loss posted for a round never aborts the next round's group; the abort of its own
round's group is not a new loss (its post is for the round that already has one).

The abort does not always end the collective: gloo's thread can stay blocked on a killed peer's pair until the
group's timeout (seen in about one local 3-worker run in 25), and the member's main thread with it, while the
others wait for it in the next round. So after an abort the watch also looks at where the main thread is: one
that stays at the very same point for `STUCK_S` seconds (a computing thread moves on, a failed collective
returns at once) is stuck, and the process ends itself with SIGKILL; its agent then restarts it as a
replacement (counted by `max_restarts`), healed from a member like any other, or the others go on without it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType

import torch.distributed as dist

from syncline.strategies.comm.group_abort import abort_default_group

__all__ = ["LOST", "POLL_S", "SILENT_EVERY_S", "STUCK_S", "LossWatch"]

#: Seconds between a member's looks at the store for a loss in its round.
POLL_S = 0.1
#: Seconds between a member's looks at the round's keep-alives (reading the rendezvous state).
SILENT_EVERY_S = 1.0
#: Seconds the main thread may stay at one point after its group was aborted before it counts as stuck.
STUCK_S = 15.0
#: Store key prefix of a round's loss (the round's number follows): what the first member to learn of it saw.
LOST = "syncline/live/lost/"


class LossWatch:
    """A daemon thread that aborts this member's group once its round's loss (or the job's failure) is posted.

    Args:
        host, port: the run's store.
        failed_key: the job's failure notice (a raise on a member ends the job).
        silent: given the watch's store client and the round, a member of it that stopped sending keep-alives
            (a frozen process, a node cut off: its connections stay open, so no collective fails), or None;
            asked every `SILENT_EVERY_S` seconds, and a silent member is posted as the round's loss.
    """

    def __init__(
        self, host: str, port: int, failed_key: str, silent: Callable[[dist.Store, int], str | None] | None = None
    ) -> None:
        # A client of its own: the member's store client is used by its main thread and the rendezvous's keep-alive.
        self._store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=10))
        self._failed_key = failed_key
        self._silent = silent
        self._looked = 0.0
        self._lock = threading.Lock()
        self._round: int | None = None
        #: After an abort: when the main thread was last seen to move, and where it was then.
        self._aborted: tuple[float, FrameType | None, int] | None = None
        self._aborted_round = -1
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="syncline-live-loss-watch", daemon=True)
        self._thread.start()
        # Before the interpreter finalizes: a thread caught inside a C++ store call then would abort the process.
        atexit.register(self.stop)

    def arm(self, number: int) -> None:
        """Watch round `number` (its group is the default group now)."""
        with self._lock:
            self._round = number

    def disarm(self) -> None:
        """Stop watching before the round's group is left (an abort in progress finishes first)."""
        with self._lock:
            self._round = None
            self._aborted = None

    def post(self, store: dist.Store, number: int, what: str) -> None:
        """Post a loss in round `number` (the first post of a round stays); every member's watch aborts its group."""
        with contextlib.suppress(Exception):
            store.compare_set(f"{LOST}{number}", "", what)

    def stop(self) -> None:
        """End the thread (at the end of the stage; it never blocks the process's exit, being a daemon)."""
        self.disarm()
        self._stop.set()
        self._thread.join(2.0)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._end_if_stuck()
            number = self._round
            if number is None:
                continue
            try:
                # Outside the lock: on a slow store, `disarm` must not wait for this call.
                posted = self._store.check([f"{LOST}{number}"]) or self._store.check([self._failed_key])
                if not posted and self._silent is not None and time.monotonic() - self._looked >= SILENT_EVERY_S:
                    self._looked = time.monotonic()
                    silent = self._silent(self._store, number)
                    if silent:
                        self.post(self._store, number, silent)
                        posted = True
            except Exception:
                continue  # the store is slow or gone: the member's own calls to it say which
            if not posted:
                continue
            with self._lock:
                if self._round == number:
                    abort_default_group()
                    self._round = None
                    self._aborted = (time.monotonic(), *self._main_place())
                    self._aborted_round = number

    def _main_place(self) -> tuple[FrameType | None, int]:
        frame = sys._current_frames().get(self._main)  # type: ignore[arg-type]
        return frame, (frame.f_lasti if frame is not None else -1)

    def _end_if_stuck(self) -> None:
        """After an abort: end this process if its main thread has not moved for `STUCK_S` seconds (see the module)."""
        with self._lock:
            if self._aborted is None:
                return
            since, frame, lasti = self._aborted
            now, (here, at) = time.monotonic(), self._main_place()
            if here is not frame or at != lasti:
                self._aborted = (now, here, at)
                return
            if now - since < STUCK_S:
                return
        where = f"{here.f_code.co_filename}:{here.f_lineno}" if here is not None else "native code"
        print(
            f"syncline: live recovery: this member's main thread is still blocked ({where}) {STUCK_S:g} s after its "
            f"group of round {self._aborted_round} was aborted (gloo did not end the collective): the process ends, "
            "and its agent restarts it as a replacement.",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)
