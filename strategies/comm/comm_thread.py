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
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.futures import Future

__all__ = ["CommThread"]


class CommThread:
    """One daemon thread that runs submitted exchanges in order, and the process group they use.

    Args:
        name: the thread's name (shown in stack dumps of a hung rank).
        timeout: seconds a collective of the thread's group may take.
    """

    def __init__(self, name: str, timeout: float) -> None:
        # Collective: every rank creates the thread's group, in the same order.
        self.group: dist.ProcessGroup = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=timeout))
        self._timeout = timeout
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the thread after everything submitted before; return a future of its result."""
        future: Future[Any] = Future()
        self._queue.put((fn, args, future))
        return future

    def close(self) -> None:
        """Let the thread finish what it was given, then stop it."""
        self._queue.put(None)
        self._thread.join(self._timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, future = item
            try:
                result = fn(*args)
            except BaseException as error:  # raised again by whoever waits on the future
                future.set_exception(error)
            else:
                future.set_result(result)
