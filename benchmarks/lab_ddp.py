"""The DDP paper's overlap and bucket-size experiments again, on shaped links (docs/performance.md, §9).

The same job as the suite's DDP comparison (`benchmarks/ddp.py`: every variant trains its own copy of the
workload on a fixed batch, blocks rotated per repeat, each step counted with its slower rank's phases), but
as a two-node torchrun job in the network lab (`syncline.lab.cluster`), so that the wire, not the two
shared cores, is what communication waits for. At each rate it reports the step time per variant, the overlap gain
(no-overlap / overlap at the same cap) and the bucket-size effect (slowest cap / fastest cap), next to
the link's bound for the step's bytes.

    python -m benchmarks lab ddp --rates 1gbit 100mbit --workload bert --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from syncline.lab.cluster import (
    UNAVAILABLE,
    add_worker_argument,
    lab_rate,
    lab_unavailable,
    parse_rate,
    run_worker_if_asked,
    run_worker_job,
)

from .common import CHECKOUT_ENV, paper_worker, write_json
from .ddp import Variant, rank_timings, summarize_job
from .plans import PLANS, Plan

__all__ = ["lab_variants", "run_lab_ddp"]

#: The command's defaults: the suite's full plan of this job.
DEFAULT_PLAN = PLANS["full"]["lab_ddp"]


def lab_variants(caps_mb: tuple[float, ...] = DEFAULT_PLAN.caps_mb) -> list[Variant]:
    """`local`, torch's DDP at its defaults, and BucketedDDP at each cap with and without overlap."""
    variants = [Variant("local", "local"), Variant("native default", "native"), Variant("bucketed default", "bucketed")]
    for cap in caps_mb:
        variants += [
            Variant(f"bucketed cap={cap:g}", "bucketed", cap),
            Variant(f"bucketed cap={cap:g} no-overlap", "bucketed", cap, overlap=False),
        ]
    return variants


def _worker(spec: dict[str, Any]) -> None:
    """One rank of the job: time every variant, gather the timings on rank 0, which writes them."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    plan = Plan(**spec["plan"])
    variants = [Variant(**v) for v in spec["variants"]]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timings = rank_timings(rank, world, spec["workload"], spec["size"], variants, plan, spec["timeout"], "cpu")
    everyone: list[Any] = [None] * world
    # Collective: every rank's timings, for rank 0 to write.
    dist.all_gather_object(everyone, timings)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(everyone))


def run_lab_ddp(
    rate: str | None, workload: str, plan: Plan, variants: list[Variant], nodes: int = 2, timeout: float = 3000.0
) -> dict[str, Any]:
    """Run the variants as a `nodes`-node job at `rate`; return `summarize_job`'s result plus the link's figures."""
    spec = {
        "plan": asdict(plan),
        "variants": [asdict(v) for v in variants],
        "workload": workload,
        "size": "full",
        "timeout": timeout,
    }
    per_rank = run_worker_job(paper_worker("ddp"), spec, nodes, rate, timeout, env=CHECKOUT_ENV)
    result = summarize_job(workload, "full", plan, variants, per_rank)
    result["rate"] = rate or "unshaped"
    result["nodes"] = nodes
    gradient_bytes = result["workload"]["parameters"] * 4
    if rate:
        # A ring all-reduce sends 2(n-1)/n of the gradients from every node.
        result["wire_bound_ms"] = round(2 * (nodes - 1) / nodes * gradient_bytes * 8 / parse_rate(rate) * 1e3, 1)
    return result


def _report(result: dict[str, Any]) -> str:
    variants = result["variants"]
    step = {name: v["step"]["median_ms"] for name, v in variants.items()}
    lines = [f"\n{result['nodes']} nodes, {result['rate']}: wire bound {result.get('wire_bound_ms', '-')} ms, "
             f"local step {step['local']:.1f} ms"]  # fmt: skip
    lines.append("| variant | step ms (median) | exposed comm ms |")
    lines.append("|---|---|---|")
    for name, v in variants.items():
        lines.append(f"| {name} | {v['step']['median_ms']:.1f} | {v.get('exposed_comm_ms', '-')} |")
    lines.append("overlap gain (no-overlap / overlap): " + ", ".join(
        f"cap {name.split('=')[1]}: {step[name + ' no-overlap'] / step[name]:.2f}"
        for name in step if name.startswith("bucketed cap=") and not name.endswith("no-overlap")
    ))  # fmt: skip
    caps = [step[n] for n in step if n.startswith("bucketed cap=") and not n.endswith("no-overlap")]
    lines.append(f"bucket-size effect (slowest / fastest cap, overlap on): {max(caps) / min(caps):.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    add_worker_argument(parser)
    parser.add_argument("--rates", type=lab_rate, nargs="+", default=list(DEFAULT_PLAN.rates), help="tc rates, or none")
    parser.add_argument("--workload", default="bert", choices=["bert", "cnn"])
    parser.add_argument("--repeats", type=int, default=DEFAULT_PLAN.repeats)
    parser.add_argument("--steps", type=int, default=DEFAULT_PLAN.steps, help="timed steps per variant per repeat")
    parser.add_argument("--caps", type=float, nargs="+", default=list(DEFAULT_PLAN.caps_mb))
    parser.add_argument("--out", type=Path, help="also write the results as JSON")


def command(args: argparse.Namespace) -> int | None:
    """Run the sweep at each rate; print the tables and write the JSON."""
    if run_worker_if_asked(args, _worker):
        return 0
    if lab_unavailable("lab ddp"):
        return UNAVAILABLE
    plan = replace(DEFAULT_PLAN, caps_mb=tuple(args.caps), repeats=args.repeats, steps=args.steps)
    variants = lab_variants(tuple(args.caps))
    results = []
    for rate in args.rates:
        result = run_lab_ddp(rate, args.workload, plan, variants)
        print(_report(result), flush=True)
        results.append(result)
    if args.out is not None:
        write_json(args.out, results)
    return 0
