"""Per-step cost of the non-finite loss check against a BucketedDDP training step, 2 ranks on gloo.

    python -m benchmarks nonfinite            # world size 2, one thread per rank

In the same two processes, interleaved per repeat: a training step of a small MLP (forward, backward
with BucketedDDP's all-reduces, SGD step, zero_grad) without the check, and the check alone
(`NonfiniteLossGuard.observe` + `window_is_finite`: one all-reduce of world_size floats and one host
sync). Reported: medians (p25-p75) over all timed iterations and the check/step ratio, on stdout; the JSON
goes where `--out` says (the committed figures: `--out benchmarks/results/nonfinite.json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from syncline.testing import run_distributed

from .common import machine, summary

RESULTS = Path(__file__).parent / "results" / "nonfinite.json"
STEPS, REPEATS, WARMUP = 50, 5, 10


class _Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _measure(rank: int, world_size: int) -> dict[str, list[float]]:
    from syncline.strategies import BucketedDDP
    from syncline.trainer.nonfinite import NonfiniteLossGuard

    torch.manual_seed(0)
    strategy = BucketedDDP()
    strategy.setup_environment()
    task = _Task()
    strategy.setup(task)
    optimizer = torch.optim.SGD(task.parameters(), lr=0.01)
    guard = NonfiniteLossGuard("raise", strategy)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    times: dict[str, list[float]] = {"step": [], "check": []}

    def step() -> torch.Tensor:
        loss = nn.functional.mse_loss(task(x), y)
        strategy.backward(loss, sync=True)
        optimizer.step()
        strategy.zero_grad(optimizer)
        return loss

    def check() -> None:
        guard.observe(loss)
        guard.window_is_finite(0, 0)

    for _ in range(WARMUP):
        loss = step()
        check()
    for _ in range(REPEATS):
        for name, fn in (("step", step), ("check", check)):
            strategy.barrier()
            for _ in range(STEPS):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    strategy.teardown()
    return times


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Two ranks, fixed sizes; where the JSON goes, when asked."""
    parser.add_argument("--out", type=Path, default=None, help=f"also write the JSON here (committed: {RESULTS})")


def command(args: argparse.Namespace) -> None:
    """Measure both loops and write the JSON."""
    results: Any = run_distributed(_measure, 2, timeout=300)
    # The slower rank's time per iteration.
    merged = {name: [max(a, b) for a, b in zip(results[0][name], results[1][name])] for name in results[0]}
    report = {name: summary(values) for name, values in merged.items()}
    ratio = statistics.median(merged["check"]) / statistics.median(merged["step"])
    output = {"machine": machine(), "world_size": 2, "summary_ms": report, "check_over_step": ratio}
    for name, values in report.items():
        print(f"{name:6s} median {values['median_ms']:.3f} ms (p25 {values['p25_ms']:.3f}, p75 {values['p75_ms']:.3f})")
    print(f"check / step: {ratio:.3f}")
    if args.out is not None:  # the committed file only when asked for
        args.out.write_text(json.dumps(output, indent=2) + "\n")
