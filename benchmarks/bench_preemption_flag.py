"""What the preemption flag costs per optimizer step: BucketedDDP steps with and without the flag check.

Every optimizer step ends with `PreemptionWatch.should_stop`, a one-element all-reduce (max) of the
flag, started asynchronously and read at the end of the next step. This script times, in the same
processes and interleaved (so both see the same machine load), a BucketedDDP training step of a small
MLP alone and followed by the flag check, and the flag check alone back to back (its full round trip,
what a synchronous check would cost), over several repeats; it reports medians and ratios.

    python -m benchmarks preemption-flag [--world-size 2] [--steps 200] [--repeats 5] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

from syncline.testing import run_distributed

from .common import machine, ms

__all__ = ["add_arguments", "command"]


def _measure(rank: int, world_size: int, steps: int, repeats: int, width: int) -> dict[str, Any]:
    from syncline.strategies.bucketed_ddp import BucketedDDP
    from syncline.trainer.preemption import PreemptionWatch
    from tests.trainer._tasks import Regressor

    torch.manual_seed(0)
    task = Regressor(features=width)
    task.net = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    strategy = BucketedDDP()
    strategy.setup_environment()
    strategy.setup(task)
    optimizer = torch.optim.SGD(task.parameters(), lr=0.01)
    watch = PreemptionWatch(None)
    x, y = torch.randn(32, width), torch.randn(32, 1)

    def train_step() -> None:
        loss = nn.functional.mse_loss(task(x), y)
        strategy.backward(loss, sync=True)
        optimizer.step()
        optimizer.zero_grad()

    def timed(body) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            body()
        watch.finish()
        return (time.perf_counter() - start) / steps

    def checked_step() -> None:
        train_step()
        watch.should_stop(strategy)

    times: dict[str, list[float]] = {"step_s": [], "checked_step_s": [], "round_trip_s": []}
    for _ in range(repeats):
        for _ in range(10):  # warm-up
            checked_step()
        watch.finish()
        times["step_s"].append(timed(train_step))
        times["checked_step_s"].append(timed(checked_step))
        times["round_trip_s"].append(timed(lambda: watch.should_stop(strategy)))
    return {name: statistics.median(values) for name, values in times.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", default=None)


def command(args: argparse.Namespace) -> None:
    """Run the measurement and print (or write) its JSON."""
    results = run_distributed(_measure, args.world_size, (args.steps, args.repeats, args.width), timeout=600)
    step, checked, trip = (
        statistics.median(r[k] for r in results) for k in ("step_s", "checked_step_s", "round_trip_s")
    )
    report = {
        "machine": machine(),
        "world_size": args.world_size,
        "model_parameters": args.width * args.width + 2 * args.width + 1,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "median_step_ms": ms(step),
        "median_step_with_flag_check_ms": ms(checked),
        "flag_check_overhead": round(checked / step - 1, 4),
        "median_flag_round_trip_ms": ms(trip),
        "round_trip_over_step": round(trip / step, 4),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")
    print(text)
