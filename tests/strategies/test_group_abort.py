"""`abort_default_group` ends gloo's collectives in flight at once, which torch 2.13's `abort()` does not;
`leave_default_group` leaves a group whose collective stays blocked without waiting for it.

Three real processes join a gloo group with a 60 s timeout through `init_process_group_from_env`; rank 2
stays in the group without taking part in the next collectives, so ranks 0 and 1 are blocked on a peer that
is alive, as a member not next to a dead one is in gloo's ring.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer._faults import run_script

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="gloo's connections are found through /proc")

_SCRIPT = """
import multiprocessing, os, sys, threading, time
import torch
import torch.distributed as dist

def rank_main(rank, port, how, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="abort-test")
    from syncline.strategies import BucketedDDP
    from syncline.strategies.comm.group_abort import abort_default_group
    from syncline.strategies.comm.process_group import init_process_group_from_env
    if how == "leave":
        # Joined without `joined_group`: no connection is known to close, so the abort cannot end the collective
        # (as when gloo's own thread stays blocked on a killed peer's pair after the connections closed).
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    else:
        init_process_group_from_env("gloo", 60.0)
    tensor = torch.ones(1 << 16)
    dist.all_reduce(tensor)  # collective: all three, so every connection is up
    if rank == 2:
        time.sleep(40)  # in the group, in no collective: ranks 0 and 1 wait on it
        os._exit(0)
    if rank == 0 and how == "leave":
        from syncline.strategies.comm.group_abort import leave_default_group
        import gc
        work = dist.all_reduce(torch.zeros(1), async_op=True)  # blocked on rank 2 in gloo's thread
        time.sleep(0.5)
        open(out + ".failed", "w").write(repr(time.time()))
        leave_default_group()
        del work
        gc.collect()
        sys.exit(0)  # the interpreter's exit: the group's destructor would join the blocked thread
    if how == "leave":
        time.sleep(40)
        os._exit(0)
    if how == "exit":
        # The preemption flag's all-reduce in flight on ranks 0 and 1 (blocked on rank 2)...
        tensor = torch.zeros(1)
        work = dist.all_reduce(tensor, async_op=True)
    if rank == 0 and how == "exit":
        # ... then rank 0's stage fails and the process exits normally.
        time.sleep(0.5)
        BucketedDDP().on_stage_failure()
        open(out + ".failed", "w").write(repr(time.time()))
        sys.exit(1)
    if rank == 0 and how == "thread":
        threading.Timer(1.0, abort_default_group).start()
    start = time.monotonic()
    try:
        dist.all_reduce(tensor)  # collective: blocked on rank 2
    except RuntimeError as error:
        open(out + str(rank), "w").write(f"{time.monotonic() - start:.2f} {str(error).splitlines()[0][:200]}")
    os._exit(0)

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    how, out = sys.argv[1], sys.argv[2]
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(r, port, how, out)) for r in range(3)]
    for p in ranks:
        p.start()
    ranks[0].join(50)
    open(out + ".exited", "w").write(repr(time.time()))
    for p in ranks:
        p.kill()
"""


def _run(tmp_path: Path, how: str) -> Path:
    out = tmp_path / "out"
    script = _SCRIPT.replace("sys.argv[1], sys.argv[2]", f"{how!r}, {str(out)!r}")
    result, _ = run_script(tmp_path, script, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_an_abort_from_another_thread_ends_the_blocked_collective_at_once(tmp_path: Path) -> None:
    out = _run(tmp_path, "thread")
    seconds, message = Path(f"{out}0").read_text().split(" ", 1)
    assert float(seconds) < 10, (seconds, message)  # not the 60 s timeout (after the abort's 1 s)
    assert "closed" in message.lower(), message


def test_a_rank_whose_stage_failed_exits_without_waiting_out_its_collective_in_flight(tmp_path: Path) -> None:
    # Without the abort, the teardown at exit waits for the flag's all-reduce: until rank 2 leaves (measured: 39.5 s).
    out = _run(tmp_path, "exit")
    failed = float(Path(f"{out}.failed").read_text())
    exited = float(Path(f"{out}.exited").read_text())
    assert exited - failed < 10, exited - failed


def test_a_left_group_whose_collective_stays_blocked_does_not_hold_up_the_exit(tmp_path: Path) -> None:
    # Destroying the group instead (its last reference gone) waited for the blocked all-reduce: until rank 2 left.
    out = _run(tmp_path, "leave")
    left = float(Path(f"{out}.failed").read_text())
    exited = float(Path(f"{out}.exited").read_text())
    assert exited - left < 10, exited - left
