"""What every part of the suite shares: statistics, the machine's description, and processes with timeouts.

- `summary(values)`: median, quartiles, min and max of a list of seconds, in milliseconds.
- `machine()`: CPU, cores, torch, python, backend, and the 1-minute load average.
- `slowest_rank(per_rank, name, key)` and `paired_block_ratio(per_rank, a, b)`: a synchronized step's time from
  every rank's timings, and two variants' ratio per repeat.
- `run_world(fn, world_size, args, timeout)`: `fn(rank, world_size, *args)` on local ranks joined by gloo,
  through the runner the tests use (`testing.py`), with the load average around it.
- `run_process(argv, timeout)`: any command in a fresh process of its own session, killed with its children on
  timeout; `run_child(command, args, timeout)` runs ``python -m benchmarks <command> ...`` through it and returns
  the JSON object the child wrote to the file named by `--out`.
- `paper_worker(command)`: a paper experiment's worker on the network lab's nodes (`syncline.lab.cluster`).

The Trainer settings of a measured run and the result files are the installed lab's (`syncline.lab.records`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from syncline.lab.records import QUIET_TRAINER, fill_marked_block, write_json
from syncline.testing import run_distributed

from . import MODULE

__all__ = [
    "CHECKOUT_ENV",
    "QUIET_TRAINER",
    "add_child_arguments",
    "add_out_argument",
    "fill_marked_block",
    "LAUNCHED_AT",
    "RESULTS",
    "ROOT",
    "BenchmarkError",
    "cpu_model",
    "machine",
    "ms",
    "paper_worker",
    "run_child",
    "run_child_command",
    "run_process",
    "run_world",
    "summary",
    "write_json",
]

ROOT = Path(__file__).resolve().parents[1]
#: Where the committed results live.
RESULTS = ROOT / "benchmarks" / "results"
#: What a process started from anywhere needs to import the suite (it is not installed): the checkout on its path.
CHECKOUT_ENV = {"PYTHONPATH": str(ROOT)}
#: Environment variable in which `run_child` passes the wall-clock time it started the child.
LAUNCHED_AT = "SYNCLINE_BENCH_LAUNCHED_AT"


class BenchmarkError(RuntimeError):
    """A benchmark process failed or timed out; the message carries its output."""


# ------------------------------------------------------------- statistics
def ms(seconds: float) -> float:
    """Return `seconds` in milliseconds, rounded to a microsecond."""
    return round(seconds * 1e3, 3)


def slowest_rank(per_rank: Sequence[dict[str, Any]], name: str, key: str) -> list[float]:
    """Return each timed step (or block) of variant `name` as its slowest rank took it: a synchronized step's time."""
    return [max(values) for values in zip(*(rank[name][key] for rank in per_rank))]


def paired_block_ratio(per_rank: Sequence[dict[str, Any]], a: str, b: str) -> dict[str, float]:
    """Return median, min and max over the repeats of variant `a`'s block time over `b`'s (slowest ranks).

    The two blocks of one repeat ran within a second of each other, so a slow spell of the machine (other
    jobs) cancels out of their ratio.
    """
    ratios = [x / y for x, y in zip(slowest_rank(per_rank, a, "block"), slowest_rank(per_rank, b, "block"))]
    return {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4), "max": round(max(ratios), 4)}


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
def run_world(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 3600.0
) -> tuple[list[Any], dict]:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks (`testing.py`).

    Returns every rank's value and the machine's 1-minute load average before and after, since other jobs
    widen the spread.
    """
    before = os.getloadavg()[0]
    values = run_distributed(fn, world_size, args, timeout=timeout)
    return values, {"before": before, "after": os.getloadavg()[0]}


def add_child_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a command `run_child` starts: what to train (``--config JSON``) and where to write (``--out``)."""
    parser.add_argument("--config", required=True, help="JSON: what to train and how")
    parser.add_argument("--out", type=Path, required=True)


def add_out_argument(parser: argparse.ArgumentParser, committed: str) -> None:
    """``--out FILE``: also write the results as JSON there. Without it they only print, so that the committed
    figures (`benchmarks/results/<committed>`) change only when asked."""
    parser.add_argument(
        "--out", type=Path, default=None, help=f"also write the JSON here (the committed figures: results/{committed})"
    )


def run_child_command(train: Callable[[dict[str, Any]], Any], args: argparse.Namespace) -> None:
    """Write ``train(config)`` as the JSON `run_child` reads."""
    args.out.write_text(json.dumps(train(json.loads(args.config))))


def run_process(
    argv: Sequence[str], timeout: float, cwd: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None
) -> str:
    """Run `argv` in a process of its own session; return its output (stdout and stderr together).

    Its own session, so that a timeout kills the process's own workers too (a launcher spawns ranks).

    Raises:
        BenchmarkError: the process exited with a non-zero status, or ran past `timeout` seconds.
    """
    process = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
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
        raise BenchmarkError(f"{' '.join(argv)} timed out after {timeout:g} s:\n{output[-3000:]}") from None
    if process.returncode != 0:
        raise BenchmarkError(f"{' '.join(argv)} failed ({process.returncode}):\n{output[-3000:]}")
    return output


def run_child(command: str, args: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m benchmarks <command> *args --out FILE`` in a fresh interpreter; return the JSON it wrote.

    Raises:
        BenchmarkError: the process failed, wrote nothing, or ran past `timeout` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="syncline-bench-") as tmp:
        out = Path(tmp, "result.json")
        argv = [sys.executable, "-m", MODULE, *command.split(), *args, "--out", str(out)]
        child_env = {**os.environ, **CHECKOUT_ENV, **(env or {})}
        # The child measures its time to first step from this moment (the same clock, the same machine).
        child_env[LAUNCHED_AT] = repr(time.time())
        output = run_process(argv, timeout, cwd=tmp, env=child_env)
        if not out.exists():
            raise BenchmarkError(f"{' '.join(argv)} wrote no {out.name}:\n{output[-3000:]}")
        return json.loads(out.read_text())


def paper_worker(command: str) -> list[str]:
    """What torchrun runs on each lab node for the worker of paper experiment `command` (`python -m benchmarks lab
    <command>`); the job needs `CHECKOUT_ENV` (the lab's nodes start it from the user's folder)."""
    return ["-m", MODULE, "lab", command]
