"""A live member whose collective the abort does not end (gloo's thread stuck on a lost peer) ends itself.

Two real processes join a gloo group without `joined_group`, so the abort knows no connection to close and the
member's all-reduce, blocked on a peer that is alive but in no collective, stays blocked as gloo's can on a
killed peer's pair. The loss is posted in the run's store; the member's `LossWatch` aborts its group, sees
its main thread not move for `STUCK_S` seconds (2 here, 15 by default), and ends the process with SIGKILL,
which its agent takes for a death: a replacement, instead of waiting out the group's 60 s timeout.
"""

from __future__ import annotations

from pathlib import Path

from tests.trainer._faults import run_script

_SCRIPT = """
import multiprocessing, os, socket, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def rank_main(rank, group_port, store_port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group_port))
    from syncline.trainer import live_watch
    live_watch.STUCK_S = 2.0
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(4))  # collective: both, so the connections are up
    if rank == 1:
        time.sleep(30)  # in the group, in no collective
        os._exit(0)
    watch = live_watch.LossWatch("127.0.0.1", store_port, "failed")
    watch.arm(0)
    dist.all_reduce(torch.ones(4))  # collective: blocked on rank 1, for good
    print("the blocked all-reduce returned", flush=True)

if __name__ == "__main__":
    store_port = free_port()
    store = dist.TCPStore("127.0.0.1", store_port, None, True, timeout=timedelta(seconds=30))
    context = multiprocessing.get_context("spawn")
    group_port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, group_port, store_port)) for r in range(2)]
    for p in ranks:
        p.start()
    time.sleep(8)  # both have joined and rank 0 is blocked (the imports take seconds)
    posted = time.monotonic()
    store.set("syncline/live/lost/0", "rank 1: lost")
    ranks[0].join(40)
    print(f"rank 0 exit {ranks[0].exitcode} after {time.monotonic() - posted:.1f} s", flush=True)
    for p in ranks:
        p.kill()
"""


def test_a_member_stuck_in_its_aborted_collective_ends_itself_for_a_replacement(tmp_path: Path) -> None:
    result, _ = run_script(tmp_path, _SCRIPT, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    exit_line = next(line for line in result.stdout.splitlines() if line.startswith("rank 0 exit"))
    code, seconds = exit_line.split()[3], float(exit_line.split()[5])
    assert code == "-9", (exit_line, result.stderr[-2000:])  # SIGKILL: its agent restarts it
    assert seconds < 15, exit_line  # 2 s without moving after the abort, not the group's 60 s timeout
    assert "still blocked" in result.stderr and "returned" not in result.stdout
