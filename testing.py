"""Run a function in N local processes joined by gloo on 127.0.0.1, with a timeout: the tests' and benchmarks' runner.

    values = run_distributed(check_something, world_size=2, args=(cap,))   # one value per rank
    outcomes = run_ranks(fn, world_size=2)                                 # values or tracebacks, for errors

`fn(rank, world_size, *args)` runs in every process with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (a strategy joins the group itself, `init_process_group_from_env`) and one
intra-op thread, so the ranks do not fight over the cores. Processes come from a forkserver that has
imported torch once, so a run costs a fraction of a second rather than a fresh interpreter's torch
import. A rank that raises, dies or outlives the timeout is reported with every rank's traceback (for a
hung rank, the stack it hung in); `run_distributed` raises then, `run_ranks` returns the outcomes.
On a machine with fewer GPUs than ranks, the ranks see no GPU, so they compute on the CPU with gloo.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncline.trainer.launcher import free_port

__all__ = ["RankOutcome", "RanksFailedError", "run_distributed", "run_ranks"]

# Imported once by the forkserver; torch._dynamo alone (pulled in by the first optimizer) takes seconds.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.optim", "torch.profiler"]
#: Seconds a rank that reported gets to leave the process group before it is killed.
_GRACE_S = 10.0


class RanksFailedError(RuntimeError):
    """A rank of `run_distributed` raised, died or timed out; the message holds every rank's error."""


@dataclass
class RankOutcome:
    """What one rank returned, or the traceback of what it raised."""

    rank: int
    value: Any = None
    error: str | None = None


def run_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout: float = 60.0
) -> list[RankOutcome]:
    """Run `fn(rank, world_size, *args)` in `world_size` processes and return each rank's outcome.

    A rank still running after `timeout` seconds is killed and reported as timed out.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    results = context.Queue()
    import torch

    port = free_port()
    hide_gpus = torch.cuda.device_count() < world_size
    stacks = tempfile.TemporaryDirectory(prefix="syncline-ranks-")
    processes = [
        context.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, results, stacks.name, timeout, hide_gpus),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            outcome = pickle.loads(results.get(timeout=0.1))
            outcomes[outcome.rank] = outcome
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
    for rank, process in enumerate(processes):
        # A rank that reported gets a short grace to leave the group; one that did not is killed.
        process.join(timeout=min(_GRACE_S, max(0.0, deadline - time.monotonic())) if rank in outcomes else 0)
        if process.is_alive():
            process.kill()
            process.join()
        if rank not in outcomes:
            timed_out = time.monotonic() >= deadline
            reason = f"timed out after {timeout:g} s" if timed_out else f"died with exit code {process.exitcode}"
            stack = Path(stacks.name, f"rank{rank}.txt").read_text()
            outcomes[rank] = RankOutcome(rank, error=f"rank {rank} {reason} without reporting\n{stack}")
    results.close()
    stacks.cleanup()
    return [outcomes[rank] for rank in range(world_size)]


def run_distributed(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout: float = 60.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` processes and return each rank's value.

    Raises:
        RanksFailedError: some rank raised, died or timed out; the message holds every rank's error.
    """
    outcomes = run_ranks(fn, world_size, args, timeout)
    errors = [f"--- rank {o.rank} ---\n{o.error}" for o in outcomes if o.error is not None]
    if errors:
        raise RanksFailedError("distributed run failed:\n" + "\n".join(errors))
    return [o.value for o in outcomes]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: multiprocessing.Queue,
    stacks_dir: str,
    timeout: float,
    hide_gpus: bool,
) -> None:
    """Set up one rank's environment, run `fn`, report its outcome, leave the process group."""
    import torch
    import torch.distributed as dist

    # Just before the parent gives up on this rank, write down where it is stuck.
    stack_file = open(Path(stacks_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 - open until exit
    faulthandler.dump_traceback_later(max(timeout - 1.0, 0.5), file=stack_file)

    if hide_gpus:
        # The ranks share fewer GPUs than they are: they compute on the CPU and join with gloo. (Only if nothing
        # queried CUDA before: torch counts the GPUs once, and unpickling `fn` imports its module first.)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # One core per rank: the ranks must not fight over the cores with their intra-op threads.
    torch.set_num_threads(1)
    try:
        outcome = RankOutcome(rank, value=fn(rank, world_size, *args))
    except BaseException:
        outcome = RankOutcome(rank, error=traceback.format_exc())
    faulthandler.cancel_dump_traceback_later()
    # Plain pickle: torch's shared-memory reductions would need this process alive until read.
    results.put(pickle.dumps(outcome))
    if dist.is_initialized():
        dist.destroy_process_group()
