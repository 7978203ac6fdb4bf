"""A communication thread: blocking exchanges run off the backward, in order, on a process group of their own.

A comm hook whose exchange is a chain of blocking steps (ByteGrad's 8-bit scatter, decode and re-quantize,
gather) would hold the backward inside the autograd hook until the bucket is averaged. Handed to this thread
instead, the hook returns a future at once, autograd goes on computing the next buckets' gradients while this
one is on the wire, and the reducer waits for the futures at the end of the backward, as for an all-reduce.
BAGUA's backend does the same with its communication threads (`bagua-core`'s scheduled comm ops).

Why the numbers do not change and nothing deadlocks:

1. The thread runs what it is given one at a time, in submission order, so each exchange computes exactly
   what the blocking hook computed, in the same order (the error feedback of bucket i before bucket i+1's).
2. Its collectives run on their own process group (`dist.new_group`, made by every rank at setup, in the same
   order), so they never interleave with the main thread's on the default group (the used-parameter map,
   metric reductions, checkpoints).
3. Every rank submits the same exchanges in the same order (the reducer launches buckets in bucket order), so
   the thread's sequence of collectives is the same on every rank.
4. A failed or stuck exchange fails its future (or never completes it): the reducer's wait raises
   `CollectiveError` after `timeout`, as for any collective.

An exchange may come in two stages (`submit_staged`): a `start` that posts its first transfers without
waiting (ByteGrad's scatter) and a `finish` that waits for them and does the rest (decode, average, gather).
The thread then starts the next exchange, if one is already queued, before finishing the current one, so
the next bucket's scatter is on the wire while this one is averaged and gathered; with nothing queued it
finishes at once. Which of the two comes first depends on timing, so it can differ between ranks, and that
is safe because the stages use separate process groups (`groups[0]` for the starts, `groups[1]` for the
finishes): on each group every rank still runs the same collectives in the same order (starts and finishes
both follow submission order), and a start never waits, so no rank can hold a finish that another rank's
start would need. The numbers do not change: each exchange computes what it computed alone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.futures import Future

__all__ = ["CommThread"]


class CommThread:
    """One daemon thread that runs submitted exchanges in order, and the process groups they use.

    Args:
        name: the thread's name (shown in stack dumps of a hung rank).
        timeout: seconds a collective of the thread's groups may take.
        groups: how many process groups of its own the thread's exchanges get (two for staged exchanges).
    """

    def __init__(self, name: str, timeout: float, groups: int = 1) -> None:
        # Collective: every rank creates the thread's groups, in the same order.
        self.groups: list[dist.ProcessGroup] = [
            dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=timeout)) for _ in range(groups)
        ]
        self.group = self.groups[0]
        self._timeout = timeout
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the thread after everything submitted before; return a future of its result."""
        future: Future[Any] = Future()
        self._queue.put(_Item(fn, None, args, future))
        return future

    def submit_staged(self, start: Callable[..., Any], finish: Callable[[Any], Any], *args: Any) -> Future[Any]:
        """Run ``finish(start(*args))`` on the thread, in order, letting the next exchange's `start` run before this
        one's `finish` when it is already queued (see the module docstring); return a future of `finish`'s result."""
        future: Future[Any] = Future()
        self._queue.put(_Item(start, finish, args, future))
        return future

    def close(self, wait: float | None = None) -> None:
        """Let the thread finish what it was given, then stop it; wait at most `wait` seconds (None: the timeout)."""
        self._queue.put(None)
        self._thread.join(self._timeout if wait is None else wait)

    def _run(self) -> None:
        # A staged exchange whose start has run and whose finish waits: at most one (the next start goes first).
        pending: tuple[Callable[[Any], Any], Any, Future[Any]] | None = None
        while True:
            try:
                # Block for the next item only when no started exchange waits for its finish.
                item = self._queue.get(block=pending is None)
            except queue.Empty:
                _settle(pending)
                pending = None
                continue
            if (item is None or item.finish is None) and pending is not None:
                _settle(pending)  # a plain exchange or the end: the started one finishes first
                pending = None
            if item is None:
                return
            try:
                result = item.fn(*item.args)
            except BaseException as error:  # raised again by whoever waits on the future
                item.future.set_exception(error)
                continue
            if item.finish is None:
                item.future.set_result(result)
                continue
            if pending is not None:  # this start went ahead of the previous exchange's finish
                _settle(pending)
            pending = (item.finish, result, item.future)


@dataclass
class _Item:
    fn: Callable[..., Any]
    finish: Callable[[Any], Any] | None
    args: tuple[Any, ...]
    future: Future[Any]


def _settle(started: tuple[Callable[[Any], Any], Any, Future[Any]]) -> None:
    """Run a started exchange's finish and complete its future with the result (or the error)."""
    finish, handle, future = started
    try:
        result = finish(handle)
    except BaseException as error:  # raised again by whoever waits on the future
        future.set_exception(error)
    else:
        future.set_result(result)
