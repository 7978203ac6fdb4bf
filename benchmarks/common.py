"""What every part of the suite shares: statistics, the machine's description, and processes with timeouts.

- `summary(values)`: median, quartiles, min and max of a list of seconds, in milliseconds.
- `machine()`: CPU, cores, torch, python, backend, and the 1-minute load average.
- `run_ranks(fn, world_size, args, timeout)`: `fn(rank, world_size, *args)` in real processes joined by
  gloo on 127.0.0.1 at a free port, one intra-op thread each; returns every rank's value or raises with
  every rank's error. A rank that outlives the timeout is killed.
- `run_child(module, args, timeout)`: `python -m <module> ...` in a fresh interpreter (its own session,
  killed with its children on timeout); returns the JSON object it wrote to the file named by `--out`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from syncline.strategies.comm.launcher import free_port

__all__ = [
    "fill_marked_block",
    "LAUNCHED_AT",
    "ROOT",
    "BenchmarkError",
    "cpu_model",
    "machine",
    "ms",
    "run_child",
    "run_ranks",
    "summary",
]

ROOT = Path(__file__).resolve().parents[1]
#: Environment variable in which `run_child` passes the wall-clock time it started the child.
LAUNCHED_AT = "SYNCLINE_BENCH_LAUNCHED_AT"


class BenchmarkError(RuntimeError):
    """A benchmark process failed or timed out; the message carries its output."""


# ------------------------------------------------------------- statistics
def ms(seconds: float) -> float:
    """Return `seconds` in milliseconds, rounded to a microsecond."""
    return round(seconds * 1e3, 3)


def summary(seconds: Sequence[float]) -> dict[str, float]:
    """Return median, 25th and 75th percentiles, min and max of `seconds`, in milliseconds."""
    values = sorted(seconds)
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = values[0]
    return {
        "median_ms": ms(statistics.median(values)),
        "p25_ms": ms(q1),
        "p75_ms": ms(q3),
        "min_ms": ms(values[0]),
        "max_ms": ms(values[-1]),
        "n": len(values),
    }


# ---------------------------------------------------------------- machine
def machine() -> dict[str, Any]:
    """Describe this machine and its load now."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": "gloo",
        "world_size": 2,
        "threads_per_rank": 1,
    }


def load_average() -> list[float]:
    """Return the 1, 5 and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    """Return the processor's model name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------ multi-process jobs
def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 600.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes; return each rank's value.

    Raises:
        BenchmarkError: a rank raised, died, or was still running after `timeout` seconds.
    """
    # A forkserver that has imported torch once: each job's ranks start in a fraction of a second, from a
    # process that has run nothing else.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "torch.optim"])
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[Any, str | None]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, value, error = pickle.loads(results.get(timeout=0.5))
            outcomes[rank] = (value, error)
        except queue.Empty:
            if all(not p.is_alive() for p in processes):
                break
    for process in processes:
        process.join(timeout=10 if len(outcomes) == world_size else 0)
        if process.is_alive():
            process.kill()
            process.join()
    errors = []
    for rank, process in enumerate(processes):
        if rank not in outcomes:
            why = f"timed out after {timeout:g} s" if time.monotonic() >= deadline else f"exit code {process.exitcode}"
            errors.append(f"rank {rank} {why} without reporting")
        elif outcomes[rank][1] is not None:
            errors.append(f"rank {rank} raised:\n{outcomes[rank][1]}")
    if errors:
        raise BenchmarkError("distributed benchmark failed:\n" + "\n".join(errors))
    return [outcomes[rank][0] for rank in range(world_size)]


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

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
        outcome = (rank, fn(rank, world_size, *args), None)
    except BaseException:
        outcome = (rank, None, traceback.format_exc())
    results.put(pickle.dumps(outcome))
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_world(run_rank: Callable[..., None], world_size: int, args: Any) -> tuple[Any, dict[str, float]]:
    """Run ``run_rank(rank, world_size, port, args, results)`` in `world_size` spawned processes.

    Returns what the ranks put on `results` first (the benchmark scripts' rank 0 puts its per-rank
    figures there) and the machine's 1-minute load average before and after, since other jobs widen
    the spread.
    """
    port = free_port()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=run_rank, args=(rank, world_size, port, args, results)) for rank in range(world_size)
    ]
    load_before = os.getloadavg()[0]
    for process in processes:
        process.start()
    per_rank = results.get(timeout=3600)
    for process in processes:
        process.join()
    return per_rank, {"before": load_before, "after": os.getloadavg()[0]}


#: The Trainer arguments of a measured run: no logs, checkpoints or progress output, no sanity validation.
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "num_sanity_val_steps": 0,
}


def child_main(train: Callable[[dict[str, Any]], Any], description: str) -> None:
    """``python -m <module> --config JSON --out FILE``: write ``train(config)`` as the JSON `run_child` reads."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="JSON: what to train and how")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(train(json.loads(args.config))))


def write_json(path: Path, data: Any) -> None:
    """Write `data` as indented JSON to `path` (creating its folder) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {path}")


def run_child(module: str, args: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m module *args --out FILE` from the repository root; return the JSON it wrote.

    Raises:
        BenchmarkError: the process failed, wrote nothing, or ran past `timeout` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="syncline-bench-") as tmp:
        out = Path(tmp, "result.json")
        command = [sys.executable, "-m", module, *args, "--out", str(out)]
        child_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        # The child measures its time to first step from this moment (the same clock, the same machine).
        child_env[LAUNCHED_AT] = repr(time.time())
        # Its own session, so that a timeout kills the child's own workers too (elastic launch spawns ranks).
        process = subprocess.Popen(
            command,
            cwd=tmp,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise BenchmarkError(f"{' '.join(command)} timed out after {timeout:g} s:\n{output[-3000:]}") from None
        if process.returncode != 0 or not out.exists():
            raise BenchmarkError(f"{' '.join(command)} failed ({process.returncode}):\n{output[-3000:]}")
        return json.loads(out.read_text())


def fill_marked_block(page: str, marker: str, text: str) -> str:
    """Return `page` with what lies between ``<!-- marker -->`` and ``<!-- /marker -->`` replaced by `text`.

    Raises:
        ValueError: the page has no such block.
    """
    block = re.compile(rf"(<!-- {re.escape(marker)} -->\n)(?:.*?\n)?(<!-- /{re.escape(marker)} -->)", re.DOTALL)
    if not block.search(page):
        raise ValueError(f"the page has no <!-- {marker} --> ... <!-- /{marker} --> block")
    return block.sub(lambda m: f"{m.group(1)}\n{text}\n\n{m.group(2)}", page)
