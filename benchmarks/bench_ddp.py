"""Benchmark BucketedDDP against torch's DDP (NativeDDP) and two naive all-reduce baselines.

    python -m benchmarks ddp                  # world size 2, gloo, one thread per rank

Every variant trains its own copy of the same model (12 x (Linear(512, 512) + LayerNorm), batch 64
per rank, SGD) in the same two processes. Variants are interleaved: each repeat runs a block of
steps of every variant, in a rotated order, so drift of the machine (thermal, other load) hits all
variants alike. A step is forward + backward + optimizer step + zero_grad; its time is the slower
rank's. We report the median over all timed steps, with the 25th-75th percentiles and the spread of
the per-repeat medians.

Exposed communication (the part of the step spent waiting for gradients after the backward's
compute) is measured as the median backward time with synchronization minus the median backward
time of the same strategy with synchronization skipped (`sync=False`, no collective at all), both
interleaved. This works for torch's DDP, whose reducer hides its timers, and for ours; for
BucketedDDP the reducer's own measure (`comm/exposed_ms`: time `finalize_backward` waits) is
reported too. For the naive baselines, which communicate only after the backward, all of their
communication is exposed and is timed directly.

Results go to a table on stdout and to `benchmarks/results/ddp.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from syncline.strategies.bucketed_ddp import BucketedDDP
from syncline.strategies.comm.process_group import init_process_group_from_env
from syncline.strategies.native_ddp import NativeDDP

from .common import machine, ms, paired_block_ratio, run_world, slowest_rank, write_json
from .workloads import LayerStack

WIDTH, DEPTH, BATCH = 512, 12, 64


# ---------------------------------------------------------------- variants
class Variant:
    """One way of training a `LayerStack`; `step` returns (backward seconds, exposed seconds or None)."""

    def __init__(self, name: str, sync: bool = True, width: int = WIDTH, depth: int = DEPTH) -> None:
        self.name = name
        self.sync = sync
        torch.manual_seed(0)
        self.model = LayerStack(width, depth)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self, batch: torch.Tensor, batch_idx: int) -> tuple[float, float | None]:
        raise NotImplementedError


class StrategyVariant(Variant):
    """A strategy's own reducer: its backward, the optimizer step and its zero_grad (`many-params` uses it too)."""

    def __init__(self, name: str, strategy, sync: bool = True, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__(name, sync, width, depth)
        self.strategy = strategy
        strategy.setup(self.model)

    def step(self, batch: torch.Tensor, batch_idx: int) -> tuple[float, float | None]:
        strategy = self.strategy
        strategy.sync_next_backward = self.sync
        loss = strategy.training_step(self.model, batch, batch_idx)
        start = time.perf_counter()
        strategy.backward(loss, sync=self.sync)
        backward = time.perf_counter() - start
        self.optimizer.step()
        strategy.zero_grad(self.optimizer)
        exposed = strategy.communication_stats().get("comm/exposed_ms")
        return backward, None if exposed is None or not self.sync else exposed / 1e3


class NaiveVariant(Variant):
    """Plain backward, then all-reduce every gradient (per parameter, or as one flat tensor)."""

    def __init__(self, name: str, flat: bool) -> None:
        super().__init__(name)
        self.flat = flat
        with torch.no_grad():
            for p in self.model.parameters():
                dist.broadcast(p, src=0)

    def step(self, batch: torch.Tensor, batch_idx: int) -> tuple[float, float | None]:
        loss = self.model.training_step(batch, batch_idx)
        start = time.perf_counter()
        loss.backward()
        comm_start = time.perf_counter()
        grads = [p.grad for p in self.model.parameters()]
        world_size = dist.get_world_size()
        if self.flat:
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(world_size)
            dist.all_reduce(flat)
            for grad, value in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(value.view_as(grad))
        else:
            for grad in grads:
                grad.div_(world_size)
                dist.all_reduce(grad)
        end = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return end - start, end - comm_start


def build_variants() -> list[Variant]:
    # native_ddp and bucketed_ddp stay neighbours under rotation, except when the rotation splits them.
    return [
        StrategyVariant("native_ddp", NativeDDP()),
        StrategyVariant("bucketed_ddp", BucketedDDP()),
        StrategyVariant("bucketed_ddp_no_overlap", BucketedDDP(overlap=False)),
        StrategyVariant("native_ddp_local", NativeDDP(), sync=False),
        StrategyVariant("bucketed_ddp_local", BucketedDDP(), sync=False),
        NaiveVariant("naive_per_param_allreduce", flat=False),
        NaiveVariant("naive_flat_allreduce", flat=True),
    ]


# ------------------------------------------------------------------ timing
def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> list | None:
    init_process_group_from_env(backend="gloo")
    variants = build_variants()
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(BATCH, WIDTH, generator=generator)
    gathered = time_variants(variants, batch, args)
    return gathered if rank == 0 else None


def time_variants(variants: list, batch: torch.Tensor, args: argparse.Namespace) -> list[dict[str, dict[str, list]]]:
    """Time every variant's steps on this rank; return every rank's timings (collective: call it on all).

    Each repeat runs `args.warmup` untimed and `args.steps` timed steps of each variant, in an order rotated
    by one every repeat, so that drift of the machine (thermal, other load) hits all. A variant's `step` may
    return (backward seconds, exposed seconds or None), recorded beside the step's time.
    """
    timings: dict[str, dict[str, list]] = {
        v.name: {"step": [], "backward": [], "exposed": [], "block": []} for v in variants
    }
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            for i in range(args.warmup):
                variant.step(batch, i)
            # Collective: every rank starts the timed block together.
            dist.barrier()
            block = []
            for i in range(args.steps):
                start = time.perf_counter()
                measured = variant.step(batch, i)
                block.append(time.perf_counter() - start)
                if measured is not None:
                    backward, exposed = measured
                    timings[variant.name]["backward"].append(backward)
                    if exposed is not None:
                        timings[variant.name]["exposed"].append(exposed)
            timings[variant.name]["step"].extend(block)
            timings[variant.name]["block"].append(statistics.median(block))
    gathered: list = [None] * dist.get_world_size()
    # Collective: rank 0 summarizes every rank's timings.
    dist.all_gather_object(gathered, timings)
    return gathered


def summarize(per_rank: list[dict], args: argparse.Namespace) -> dict:
    def quantiles(values: list[float]) -> dict[str, float]:
        q = statistics.quantiles(values, n=4)
        return {"median_ms": ms(statistics.median(values)), "p25_ms": ms(q[0]), "p75_ms": ms(q[2])}

    variants = {}
    for name in per_rank[0]:
        step, backward, blocks = (slowest_rank(per_rank, name, key) for key in ("step", "backward", "block"))
        entry = {
            "step": quantiles(step),
            "backward": quantiles(backward),
            "block_medians_ms": {"min": ms(min(blocks)), "max": ms(max(blocks))},
            "timed_steps": len(step),
        }
        exposed = [v for r in per_rank for v in r[name]["exposed"]]
        if exposed:
            entry["measured_exposed_comm_ms"] = ms(statistics.median(exposed))
        variants[name] = entry
    for ours, local in [("native_ddp", "native_ddp_local"), ("bucketed_ddp", "bucketed_ddp_local")]:
        variants[ours]["exposed_comm_ms"] = round(
            variants[ours]["backward"]["median_ms"] - variants[local]["backward"]["median_ms"], 3
        )
    variants["bucketed_ddp_no_overlap"]["exposed_comm_ms"] = variants["bucketed_ddp_no_overlap"].get(
        "measured_exposed_comm_ms"
    )
    for name in ("naive_per_param_allreduce", "naive_flat_allreduce"):
        variants[name]["exposed_comm_ms"] = variants[name]["measured_exposed_comm_ms"]
    ratio = variants["bucketed_ddp"]["step"]["median_ms"] / variants["native_ddp"]["step"]["median_ms"]
    return {
        "machine": {**machine(), "world_size": args.world_size},
        "setup": {
            "world_size": args.world_size,
            "model": f"{DEPTH} x (Linear({WIDTH}, {WIDTH}) + LayerNorm({WIDTH}))",
            "parameters": sum(p.numel() for p in LayerStack(WIDTH, DEPTH).parameters()),
            "batch_per_rank": BATCH,
            "optimizer": "SGD(lr=1e-3)",
            "repeats": args.repeats,
            "steps_per_block": args.steps,
            "warmup_per_block": args.warmup,
            "exposed_comm_method": "median backward(sync=True) - median backward(sync=False) of the same strategy; "
            "naive baselines and no-overlap: time from end of loss.backward() to end of communication",
        },
        "variants": variants,
        "ratio_bucketed_over_native": round(ratio, 4),
        "paired_block_ratio_bucketed_over_native": paired_block_ratio(per_rank, "bucketed_ddp", "native_ddp"),
    }


def print_table(summary: dict) -> None:
    header = (
        f"{'variant':28} {'step ms (p25-p75)':>24} {'block medians':>16} {'backward ms':>12} {'exposed comm ms':>16}"
    )
    print(header)
    print("-" * len(header))
    for name, v in summary["variants"].items():
        step = v["step"]
        exposed = v.get("exposed_comm_ms")
        print(
            f"{name:28} {step['median_ms']:8.2f} ({step['p25_ms']:6.2f}-{step['p75_ms']:6.2f}) "
            f"{v['block_medians_ms']['min']:7.2f}-{v['block_medians_ms']['max']:<7.2f} "
            f"{v['backward']['median_ms']:12.2f} {'' if exposed is None else f'{exposed:16.2f}'}"
        )
    paired = summary["paired_block_ratio_bucketed_over_native"]
    print(f"\nBucketedDDP / NativeDDP median step time: {summary['ratio_bucketed_over_native']:.3f}")
    print(
        f"BucketedDDP / NativeDDP per repeat (paired blocks): median {paired['median']:.3f}, "
        f"range {paired['min']:.3f}-{paired['max']:.3f}"
    )
    own = summary["variants"]["bucketed_ddp"].get("measured_exposed_comm_ms")
    if own is not None:
        print(f"BucketedDDP reducer's own measure of its exposed wait: {own} ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each block")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ddp.json")


def command(args: argparse.Namespace) -> None:
    """Run the command."""

    (per_rank, *_), load = run_world(run_rank, args.world_size, (args,))
    summary = summarize(per_rank, args)
    summary["machine"]["load_average_1min"] = load
    print_table(summary)
    write_json(args.out, summary)
