"""The communication thread's order: plain exchanges one after another; staged ones start the next queued exchange
before finishing the current one, and finish at once when nothing is queued."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from syncline.strategies.comm.comm_thread import CommThread
from syncline.testing import run_distributed


def _staged_order(rank: int, world_size: int) -> list[str]:
    dist.init_process_group("gloo")
    thread = CommThread("test-comm-thread", timeout=30, groups=2)
    calls: list[str] = []
    release = threading.Event()

    def start(index: int) -> int:
        if index == 0:
            release.wait(10)  # hold the thread until all three are queued: it is "behind"
        calls.append(f"start{index}")
        return index * 10

    def finish(handle: int) -> int:
        calls.append(f"finish{handle // 10}")
        return handle + 1

    futures = [thread.submit_staged(start, finish, index) for index in range(3)]
    release.set()
    assert [future.wait() for future in futures] == [1, 11, 21]
    # Nothing queued: a lone staged exchange finishes at once; a plain one runs after it.
    alone = thread.submit_staged(start, finish, 3)
    assert alone.wait() == 31
    assert thread.submit(lambda: calls.append("plain") or 7).wait() == 7
    thread.close()
    assert len(thread.groups) == 2
    dist.destroy_process_group()
    return calls


def test_a_thread_behind_starts_the_next_exchange_before_finishing_the_current_one():
    (calls,) = run_distributed(_staged_order, world_size=1, timeout=60)
    assert calls == ["start0", "start1", "finish0", "start2", "finish1", "finish2", "start3", "finish3", "plain"]


def _failing(rank: int, world_size: int) -> str:
    dist.init_process_group("gloo")
    thread = CommThread("test-comm-thread", timeout=30, groups=2)

    def finish(handle: int) -> int:
        raise ValueError(f"finish of {handle} failed")

    future = thread.submit_staged(lambda: 5, finish)
    with pytest.raises(ValueError, match="finish of 5 failed"):
        future.wait()
    assert thread.submit(lambda: "still running").wait() == "still running"
    thread.close()
    dist.destroy_process_group()
    return "ok"


def test_a_failed_finish_fails_its_future_and_the_thread_goes_on():
    assert run_distributed(_failing, world_size=1, timeout=60) == ["ok"]
