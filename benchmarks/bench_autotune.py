"""Bucket autotune against every fixed cap it chooses from: BucketedDDP(bucket_cap_mb="auto") side by side.

    python -m benchmarks autotune                            # world size 2 on this machine, gloo
    python -m benchmarks lab cluster --nodes 2 --rate 100mbit -- -m benchmarks autotune --repeats 3

Every variant trains its own copy of the same model (default: the `ddp` command's 12 x (Linear(512, 512) +
LayerNorm(512)), 12.7 MB of gradients; SGD, batch 64 per rank) in the same processes: BucketedDDP with
each fixed cap of the sweep (`--caps`, the autotuner's default candidates 1, 5, 25, 100 MiB) and with
`bucket_cap_mb="auto"` over the same caps. Each repeat builds every variant anew, so "auto" tunes again in
every repeat, and runs the variants in a rotated order (machine drift hits all alike). Per variant and
repeat: `--warmup` untimed steps (for "auto": its tuning steps, timed separately, which are its cost),
then `--steps` timed steps; a step is forward + backward + SGD step + zero_grad and lasts as long as on
its slowest rank. Reported: the median step per variant over all repeats, the per-repeat medians' range,
the cap "auto" chose in each repeat, and what tuning cost (its steps' time beyond the same number of
steady steps with the chosen cap).

Started alone, it spawns `--world-size` local processes; under torchrun (the network lab) it joins the
job's group and rank 0 prints the result, and writes it with `--out` (committed: results/autotune.json).
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

from .common import add_out_argument, machine, run_world, summary, write_json
from .workloads import LayerStack

DEFAULT_CAPS = (1.0, 5.0, 25.0, 100.0)


def variant_names(caps: list[float]) -> list[str]:
    return [f"{cap:g} MiB" for cap in caps] + ["auto"]


def make_strategy(name: str, caps: list[float], tune_steps: int) -> BucketedDDP:
    if name == "auto":
        return BucketedDDP(bucket_cap_mb="auto", autotune_caps_mb=caps, autotune_steps=tune_steps)
    return BucketedDDP(bucket_cap_mb=float(name.split()[0]))


def step(strategy: BucketedDDP, model: LayerStack, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    loss = strategy.training_step(model, batch, 0)
    strategy.backward(loss, sync=True)
    optimizer.step()
    strategy.zero_grad(optimizer)
    return time.perf_counter() - start


def run_variant(name: str, args: argparse.Namespace, batch: torch.Tensor) -> dict:
    """Build one variant, warm it up (tune it), time it; return this rank's step times and the chosen cap."""
    torch.manual_seed(0)
    model = LayerStack(args.width, args.depth)
    strategy = make_strategy(name, args.caps, args.tune_steps)
    strategy.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tuning = []
    if strategy.autotune is not None:
        while not strategy.autotune.done:
            tuning.append(step(strategy, model, optimizer, batch))
    for _ in range(args.warmup):
        step(strategy, model, optimizer, batch)
    dist.barrier()
    timed = [step(strategy, model, optimizer, batch) for _ in range(args.steps)]
    chosen = strategy.autotune.chosen_mb if strategy.autotune is not None else None
    strategy.teardown()
    return {"steps": timed, "tuning": tuning, "chosen_mb": chosen}


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> list | None:
    """One rank's runs of every variant; rank 0 returns every rank's (the others None)."""
    torch.set_num_threads(args.threads)
    init_process_group_from_env(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    names = variant_names(args.caps)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(run_variant(name, args, batch))
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, runs)
    return gathered if rank == 0 else None


def summarize(per_rank: list[dict], args: argparse.Namespace) -> dict:
    variants = {}
    for name in per_rank[0]:
        repeats = list(zip(*(r[name] for r in per_rank)))  # per repeat, every rank's run
        # A synchronized step lasts as long as on its slowest rank.
        steps = [[max(values) for values in zip(*(run["steps"] for run in ranks))] for ranks in repeats]
        medians = [statistics.median(s) for s in steps]
        entry = {
            "step": summary([t for s in steps for t in s]),
            "repeat_medians_ms": [round(m * 1e3, 3) for m in medians],
        }
        if name == "auto":
            chosen = [ranks[0]["chosen_mb"] for ranks in repeats]
            tuning = [[max(values) for values in zip(*(run["tuning"] for run in ranks))] for ranks in repeats]
            # Tuning's cost: its steps beyond as many steady steps of the same repeat.
            cost = [sum(t) - len(t) * m for t, m in zip(tuning, medians)]
            entry.update(
                chosen_mb=chosen,
                tuning_steps=len(tuning[0]),
                tuning_cost_ms={"median": round(statistics.median(cost) * 1e3, 1), "max": round(max(cost) * 1e3, 1)},
            )
        variants[name] = entry
    best = min((n for n in variants if n != "auto"), key=lambda n: variants[n]["step"]["median_ms"])
    return {
        "machine": {**machine(), "world_size": len(per_rank), "threads_per_rank": args.threads},
        "setup": {
            "model": f"{args.depth} x (Linear({args.width}, {args.width}) + LayerNorm({args.width}))",
            "gradient_mb": round(sum(p.numel() * 4 for p in LayerStack(args.width, args.depth).parameters()) / 1e6, 2),
            "batch_per_rank": args.batch,
            "caps_mb": args.caps,
            "repeats": args.repeats,
            "steps": args.steps,
            "warmup": args.warmup,
            "autotune_steps": args.tune_steps,
        },
        "variants": variants,
        "best_fixed": best,
        "auto_over_best_fixed": round(variants["auto"]["step"]["median_ms"] / variants[best]["step"]["median_ms"], 4),
    }


def print_table(result: dict) -> None:
    print(f"{'variant':10} {'median step ms (p25-p75)':>26} {'per-repeat medians ms':>24}")
    for name, v in result["variants"].items():
        s, reps = v["step"], v["repeat_medians_ms"]
        spread = f"{min(reps):11.2f}-{max(reps):<8.2f}"
        print(f"{name:10} {s['median_ms']:10.2f} ({s['p25_ms']:6.2f}-{s['p75_ms']:6.2f}) {spread}")
    auto = result["variants"]["auto"]
    print(f"\nauto chose (MiB, per repeat): {auto['chosen_mb']}")
    print(f"tuning: {auto['tuning_steps']} steps, cost beyond steady steps: {auto['tuning_cost_ms']} ms")
    print(f"auto / best fixed ({result['best_fixed']}) median step: {result['auto_over_best_fixed']:.3f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--caps", type=float, nargs="+", default=list(DEFAULT_CAPS), help="fixed caps, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant per repeat")
    parser.add_argument("--tune-steps", type=int, default=2, help="autotune_steps of the auto variant")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    add_out_argument(parser, "autotune.json")


def command(args: argparse.Namespace) -> None:
    """Run every variant (on this machine, or as a torchrun job in the lab) and write the JSON."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun (the network lab)
        gathered = run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        load = None
    else:
        (gathered, *_), load = run_world(run_rank, args.world_size, (args,))
    if gathered is None:
        return
    result = summarize(gathered, args)
    result["machine"]["load_average_1min"] = load
    print_table(result)
    if args.out is not None:
        write_json(args.out, result)
