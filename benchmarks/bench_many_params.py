"""Per-parameter cost: BucketedDDP against torch's DDP on a model of thousands of small parameter tensors.

    python -m benchmarks many-params          # world size 2, gloo, one thread per rank

The model is `DEPTH` x (Linear(WIDTH, WIDTH) + LayerNorm(WIDTH)) with a small width, so that a step's
compute is small and the reducer's per-parameter bookkeeping (one Python hook per gradient, the
unused-parameter walk) is what differs between the two reducers: torch's hooks are C++. Variants run
in the same two processes, interleaved in a rotated order per repeat (the DDP harness, `benchmarks/ddp.py`);
a step is forward + backward + SGD step + the strategy's zero_grad, timed as the slower rank's. Reported: the
median step over all timed steps (p25-p75), and the BucketedDDP/NativeDDP ratio of medians and of
per-repeat paired block medians, for the default options, `find_unused_parameters=True`, and
BucketedDDP's `static_graph=True` against torch's.

`--one-process` measures instead, in one process (a gloo group of one, so no peer and no wait), the
backward of each strategy against a plain `loss.backward()` without any reducer: (median backward -
plain median backward) / parameter tensors is the reducer's own cost per parameter during the
backward, and `prepare_for_backward` alone times the unused-parameter graph walk.

Results go to a table on stdout, and with `--out` to JSON (committed: `benchmarks/results/many_params.json`;
`--one-process`: `many_params_one_process.json`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from syncline.strategies.bucketed_ddp import BucketedDDP
from syncline.strategies.comm.process_group import init_process_group_from_env
from syncline.strategies.native_ddp import NativeDDP
from syncline.trainer.launcher import free_port

from .common import add_out_argument, machine, ms, paired_block_ratio, run_world, slowest_rank, write_json
from .ddp import Variant, per_step, rank_timings
from .plans import Plan
from .workloads import LayerStack

WIDTH, BATCH = 16, 8

#: (ours, torch's) pairs whose step-time ratio is reported.
PAIRS = {
    "default": ("bucketed_ddp", "native_ddp"),
    "find_unused_parameters": ("bucketed_ddp_unused", "native_ddp_unused"),
    "static_graph": ("bucketed_ddp_static", "native_ddp_static"),
}


def build_variants() -> list[Variant]:
    """The strategies, each training its own copy of the model; each pair stays adjacent under rotation, except
    when the rotation splits it."""
    return [
        Variant("native_ddp", "native"),
        Variant("bucketed_ddp", "bucketed"),
        Variant("native_ddp_unused", "native", find_unused_parameters=True),
        Variant("bucketed_ddp_unused", "bucketed", find_unused_parameters=True),
        Variant("native_ddp_static", "native", static_graph=True),
        Variant("bucketed_ddp_static", "bucketed", static_graph=True),
    ]


def _plan(args: argparse.Namespace) -> Plan:
    """The layer stack at WIDTH and `--depth`, with the command's repeats and steps."""
    model = {"width": WIDTH, "depth": args.depth, "batch": BATCH}
    return Plan(
        workloads=("layers",),
        model=model,
        repeats=args.repeats,
        steps=args.steps,
        warmup=args.warmup,
        timeout_s=3600.0,
    )


def summarize(per_rank: list[dict], args: argparse.Namespace) -> dict:
    """Median step per variant (its slowest rank's) and each pair's ratios, from every rank's `rank_timings`."""
    per_rank = per_step(per_rank)
    variants = {}
    for name in per_rank[0]:
        step = slowest_rank(per_rank, name, "step")
        q = statistics.quantiles(step, n=4)
        variants[name] = {
            "median_ms": ms(statistics.median(step)),
            "p25_ms": ms(q[0]),
            "p75_ms": ms(q[2]),
            "timed_steps": len(step),
        }
    ratios = {}
    for label, (ours, native) in PAIRS.items():
        ratios[label] = {
            "ratio_of_medians": round(variants[ours]["median_ms"] / variants[native]["median_ms"], 4),
            "paired_block_ratio": paired_block_ratio(per_rank, ours, native),
        }
    model = LayerStack(WIDTH, args.depth)
    return {
        "machine": {**machine(), "world_size": args.world_size},
        "setup": {
            "world_size": args.world_size,
            "model": f"{args.depth} x (Linear({WIDTH}, {WIDTH}) + LayerNorm({WIDTH}))",
            "parameter_tensors": len(list(model.parameters())),
            "parameters": sum(p.numel() for p in model.parameters()),
            "batch_per_rank": BATCH,
            "optimizer": "SGD(lr=1e-3)",
            "repeats": args.repeats,
            "steps_per_block": args.steps,
            "warmup_per_block": args.warmup,
        },
        "variants": variants,
        "bucketed_over_native": ratios,
    }


def print_table(summary: dict) -> None:
    print(f"{'variant':22} {'median step ms (p25-p75)':>28}")
    for name, v in summary["variants"].items():
        print(f"{name:22} {v['median_ms']:10.2f} ({v['p25_ms']:7.2f}-{v['p75_ms']:7.2f})")
    print()
    for label, ratio in summary["bucketed_over_native"].items():
        paired = ratio["paired_block_ratio"]
        print(
            f"BucketedDDP / NativeDDP, {label:24}: {ratio['ratio_of_medians']:.3f} "
            f"(paired per repeat: median {paired['median']:.3f}, range {paired['min']:.3f}-{paired['max']:.3f})"
        )


def one_process(args: argparse.Namespace) -> dict:
    """Time forward, backward and zero_grad of each strategy against plain training, in this process."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    init_process_group_from_env(backend="gloo")
    names = ["plain", "native_ddp", "bucketed_ddp", "native_ddp_unused", "bucketed_ddp_unused", "bucketed_ddp_static"]
    makers = {
        "plain": lambda: None,
        "native_ddp": NativeDDP,
        "bucketed_ddp": BucketedDDP,
        "native_ddp_unused": lambda: NativeDDP(find_unused_parameters=True),
        "bucketed_ddp_unused": lambda: BucketedDDP(find_unused_parameters=True),
        "bucketed_ddp_static": lambda: BucketedDDP(static_graph=True),
    }
    batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
    runs = {}
    for name in names:
        torch.manual_seed(0)
        model, strategy = LayerStack(WIDTH, args.depth), makers[name]()
        if strategy is not None:
            strategy.setup(model)
        runs[name] = (model, strategy, torch.optim.SGD(model.parameters(), lr=1e-3))
    times: dict[str, dict[str, list[float]]] = {n: {"backward": [], "prepare": []} for n in names}
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            model, strategy, optimizer = runs[name]
            for i in range(args.warmup + args.steps):
                loss = model.training_step(batch, i) if strategy is None else strategy.training_step(model, batch, i)
                start = time.perf_counter()
                if isinstance(strategy, BucketedDDP):
                    # The walk alone: what prepare_for_backward costs before the backward starts.
                    walk = strategy.find_unused_parameters or strategy.static_graph
                    strategy.reducer.prepare_for_backward(sync=True, loss=loss if walk else None)
                    prepared = time.perf_counter()
                    loss.backward()
                    strategy.reducer.finalize_backward()
                elif strategy is not None:
                    prepared = start
                    strategy.backward(loss, sync=True)
                else:
                    prepared = start
                    loss.backward()
                end = time.perf_counter()
                if i >= args.warmup:
                    times[name]["backward"].append(end - start)
                    times[name]["prepare"].append(prepared - start)
                optimizer.step()
                if strategy is None:
                    optimizer.zero_grad()
                else:
                    strategy.zero_grad(optimizer)
    dist.destroy_process_group()
    tensors = len(list(LayerStack(WIDTH, args.depth).parameters()))
    plain = statistics.median(times["plain"]["backward"])
    result = {"parameter_tensors": tensors, "repeats": args.repeats, "steps_per_block": args.steps, "variants": {}}
    for name in names:
        backward = statistics.median(times[name]["backward"])
        result["variants"][name] = {
            "backward_median_ms": round(1e3 * backward, 3),
            "backward_min_ms": round(1e3 * min(times[name]["backward"]), 3),
            "prepare_median_ms": round(1e3 * statistics.median(times[name]["prepare"]), 3),
            "overhead_per_parameter_us": round(1e6 * (backward - plain) / tensors, 3),
        }
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--depth", type=int, default=1000, help="blocks of 4 parameter tensors")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each block")
    parser.add_argument("--one-process", action="store_true", help="the reducer's own per-parameter cost")
    add_out_argument(parser, "many_params.json; --one-process: many_params_one_process.json")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    if args.one_process:
        result = one_process(args)
        for name, v in result["variants"].items():
            print(
                f"{name:22} backward {v['backward_median_ms']:8.2f} ms (min {v['backward_min_ms']:8.2f})  "
                f"prepare {v['prepare_median_ms']:6.3f} ms  over plain {v['overhead_per_parameter_us']:6.2f} us/param"
            )
        if args.out is not None:
            write_json(args.out, result)
        return
    plan = _plan(args)
    job = ("layers", plan.size, build_variants(), plan, plan.timeout_s, "cpu")
    per_rank, load = run_world(rank_timings, args.world_size, job, plan.timeout_s)
    summary = summarize(per_rank, args)
    summary["machine"]["load_average_1min"] = load
    print_table(summary)
    if args.out is not None:
        write_json(args.out, summary)
