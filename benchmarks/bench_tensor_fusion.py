"""Horovod's tensor fusion against BucketedDDP: time per step, fused all-reduces and negotiation cycles.

    python -m benchmarks tensor-fusion                 # 2 ranks, gloo, one thread per rank
    python -m benchmarks tensor-fusion --steps 40 --repeats 5

An MLP of `DEPTH` Linear(WIDTH, WIDTH) layers (8 x 512 x 512: 2.1 M parameters, 8.4 MB of float32
gradients) trains with SGD on random batches. Each variant runs `--steps` timed steps (forward, backward
with the strategy's synchronization, SGD step, zero_grad) after 3 untimed ones, in the same two
processes, variants interleaved in a rotated order per repeat so that load from other processes spreads
over all of them. A step is timed as the slower rank's. Reported: the median step (p25-p75) over every
timed step, the ratio to `bucketed_ddp`, and for `tensor_fusion` the fused all-reduces and negotiation
cycles of one synchronized backward. Results: stdout, and with `--out` JSON (committed: results/tensor_fusion.json).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from syncline.strategies import BucketedDDP, Strategy, TensorFusion
from syncline.testing import run_distributed

from .common import add_out_argument, load_average, machine, summary, write_json

DEPTH, WIDTH, BATCH, WARMUP = 8, 512, 32, 3

#: The variants compared, by label.
VARIANTS: dict[str, Callable[[], Strategy]] = {
    "bucketed_ddp": BucketedDDP,
    "tensor_fusion (64 MB, 5 ms)": TensorFusion,
    "tensor_fusion (2 MB, 1 ms)": lambda: TensorFusion(fusion_threshold_mb=2, cycle_time_ms=1),
    "tensor_fusion (0 MB, 0 ms)": lambda: TensorFusion(fusion_threshold_mb=0, cycle_time_ms=0),
}


def _rank(rank: int, world_size: int, steps: int, repeats: int) -> dict:
    """Time every variant `repeats` times in this rank; return per-variant step times and fusion counters."""
    times: dict[str, list[float]] = {label: [] for label in VARIANTS}
    counters: dict[str, dict[str, float]] = {}
    generator = torch.Generator().manual_seed(rank)
    for repeat in range(repeats):
        labels = list(VARIANTS)
        labels = labels[repeat % len(labels) :] + labels[: repeat % len(labels)]
        for label in labels:
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)))
            strategy = VARIANTS[label]()
            strategy.setup_environment()
            strategy.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            for step in range(WARMUP + steps):
                x = torch.randn(BATCH, WIDTH, generator=generator)
                start = time.perf_counter()
                strategy.backward(model(x).square().mean(), sync=True)
                strategy.optimizer_step(optimizer, optimizer.step)
                strategy.zero_grad(optimizer)
                elapsed = time.perf_counter() - start
                if step >= WARMUP:
                    # The slower rank's time is the step's: all-reduce it (max) before keeping it.
                    slowest = strategy.reduce(torch.tensor([elapsed]), "max")
                    times[label].append(float(slowest))
            stats = strategy.communication_stats()
            counters[label] = {k: v for k, v in stats.items() if k.startswith(("fusion/", "comm/bytes"))}
            strategy.teardown()
    return {"times": times, "counters": counters}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser, "tensor_fusion.json")


def command(args: argparse.Namespace) -> None:
    """Run the comparison and write the table and the JSON."""
    load_before = load_average()
    ranks = run_distributed(_rank, 2, args=(args.steps, args.repeats), timeout=1200)
    result = ranks[0]
    rows = {label: {**summary(result["times"][label]), **result["counters"][label]} for label in VARIANTS}
    reference = rows["bucketed_ddp"]["median_ms"]
    print("| variant | median ms/step (p25-p75) | vs bucketed_ddp | fused all-reduces | cycles | bytes/step |")
    print("|---|---|---|---|---|---|")
    for label, row in rows.items():
        print(
            f"| {label} | {row['median_ms']:.1f} ({row['p25_ms']:.1f}-{row['p75_ms']:.1f}) | "
            f"{row['median_ms'] / reference:.2f}x | {row.get('fusion/allreduces', '-')} | "
            f"{row.get('fusion/cycles', '-')} | {int(row['comm/bytes']):,} |"
        )
    if args.out is None:
        return
    write_json(
        args.out,
        {
            "machine": machine(),
            "load_average": {"before": load_before, "after": load_average()},
            "model": {"depth": DEPTH, "width": WIDTH, "batch": BATCH},
            "steps": args.steps,
            "repeats": args.repeats,
            "rows": rows,
        },
    )
