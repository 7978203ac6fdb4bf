"""The DDP comparison: syncline's reducer against torch's DDP, per workload, size and precision.

    python -m benchmarks ddp          # the layer stack, world size 2, gloo (--out FILE: also the JSON)

One harness for every job that sets the two reducers side by side: the suite's `ddp` and `device` sections
(`benchmarks/run.py`), this module's `ddp` command, `many-params` and the lab's `ddp` job all describe their
variants as `Variant`s and time them with `rank_timings`. Every variant of a job trains its own copy of the
same model (a workload of `benchmarks/workloads.py`, SGD at lr 1e-3) on a fixed batch per rank, and all
variants stay alive for the whole job. Each repeat runs a block of every variant, in an order rotated by one
per repeat, so that drift of the machine (other jobs, thermal) hits all of them alike: `warmup` untimed
micro-batches, a barrier, then `steps` timed ones (`skip_microbatches` for a skip-sync variant).

A step is forward, backward, and (when the step synchronizes) optimizer step and zero_grad. Every phase
is timed on every rank; a synchronized step is as slow as its slower rank. Data loading is not timed: the
batch is made once.

Exposed communication, the part of the step spent waiting for gradients after the backward's own compute,
is measured against a variant without synchronization: the suite's `local` (the same model, no strategy,
both ranks computing at once so the cores are as busy), the `ddp` command's `*_local` (the same strategy
with `sync=False`). torch's reducer keeps its timers private, so this is the one measure both reducers
share; BucketedDDP's own wait (`comm/exposed_ms`) is recorded as well, and for the naive baselines, which
communicate after the backward, the communication is timed directly.

`run_device_workload` is the one-device job (section `device`): one process, world size 1, on CUDA with
NCCL when a GPU is present, else on the CPU with gloo. Communication is then a no-op copy, so BucketedDDP
/ local and NativeDDP / local measure each reducer's own bookkeeping per step (hooks, bucket views or
copies, futures), and on CUDA every variant also runs under mixed precision (the Trainer's `Precision`:
autocast, and loss scaling for fp16). On CUDA each phase ends with `torch.cuda.synchronize()`, so a
phase's time is its kernels' time.

The `ddp` command runs the layer stack (12 x (Linear(512, 512) + LayerNorm), batch 64 per rank) with
BucketedDDP and NativeDDP at their defaults, BucketedDDP without overlap, both with `sync=False`, and two
naive baselines (one all-reduce per parameter, one flat all-reduce, after the backward); it reports the
median step over all timed steps with the 25th-75th percentiles and the spread of the per-repeat
medians, to a table and `benchmarks/results/ddp.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from syncline.testing import run_distributed

from .common import add_out_argument, machine, ms, paired_block_ratio, run_world, slowest_rank, summary, write_json
from .plans import Plan
from .workloads import build

__all__ = [
    "COMMAND_PLAN",
    "Variant",
    "add_arguments",
    "command",
    "comparison_variants",
    "device_variants",
    "per_step",
    "plan_variants",
    "rank_timings",
    "run_ddp_workload",
    "run_device_workload",
    "summarize_comparison",
    "summarize_job",
    "variant_name",
]

#: Reducers that communicate after the backward, outside any strategy: one all-reduce per gradient, or one of all.
NAIVE = ("naive", "naive_flat")


@dataclass(frozen=True)
class Variant:
    """One way of training the workload.

    Attributes:
        name: unique label, e.g. "bucketed cap=1" or "native default".
        reducer: "local" (no synchronization), "bucketed" (syncline's BucketedDDP), "native" (torch's DDP),
            "naive" (an all-reduce per gradient after the backward) or "naive_flat" (one flat all-reduce).
        cap_mb: bucket cap, also used as the first bucket's cap so the sweep is one number; None: defaults.
        overlap: BucketedDDP only; False launches every bucket after the backward.
        sync_every: synchronize (and step the optimizer) every this many micro-batches; 0: never synchronize
            but step the optimizer every micro-batch (a strategy's backward without its communication).
        precision: the Trainer's precision setting: "32", "bf16-mixed" or "16-mixed" (CUDA only).
        find_unused_parameters: the reducer's option of that name.
        static_graph: the reducer's option of that name.
    """

    name: str
    reducer: str
    cap_mb: float | None = None
    overlap: bool = True
    sync_every: int = 1
    precision: str = "32"
    find_unused_parameters: bool = False
    static_graph: bool = False


def plan_variants(plan: Plan) -> list[Variant]:
    """Return the variants of one workload's job: the defaults, then `plan`'s bucket and skip-sync sweeps."""
    variants = [
        Variant("local", "local"),
        Variant("native default", "native"),
        Variant("bucketed default", "bucketed"),
        Variant("bucketed default no-overlap", "bucketed", overlap=False),
    ]
    for cap in plan.caps_mb:
        variants += [Variant(f"native cap={cap:g}", "native", cap), Variant(f"bucketed cap={cap:g}", "bucketed", cap)]
        if cap in plan.no_overlap_caps_mb:
            variants.append(Variant(f"bucketed cap={cap:g} no-overlap", "bucketed", cap, overlap=False))
    for k in plan.sync_every:
        if k > 1:
            variants += [
                Variant(f"native sync-every={k}", "native", sync_every=k),
                Variant(f"bucketed sync-every={k}", "bucketed", sync_every=k),
            ]
    return variants


def variant_name(name: str, precision: str) -> str:
    """A variant's label at `precision`: `name` itself for fp32, else e.g. "local bf16-mixed"."""
    return name if precision == "32" else f"{name} {precision}"


def device_variants(precisions: tuple[str, ...]) -> list[Variant]:
    """The one-device job's variants: no synchronization, NativeDDP and BucketedDDP, at each precision."""
    return [
        Variant(variant_name(name, precision), reducer, precision=precision)
        for precision in precisions
        for name, reducer in (("local", "local"), ("native default", "native"), ("bucketed default", "bucketed"))
    ]


def comparison_variants() -> list[Variant]:
    """The `ddp` command's variants; native_ddp and bucketed_ddp stay neighbours under rotation, except when the
    rotation splits them."""
    return [
        Variant("native_ddp", "native"),
        Variant("bucketed_ddp", "bucketed"),
        Variant("bucketed_ddp_no_overlap", "bucketed", overlap=False),
        Variant("native_ddp_local", "native", sync_every=0),
        Variant("bucketed_ddp_local", "bucketed", sync_every=0),
        Variant("naive_per_param_allreduce", "naive"),
        Variant("naive_flat_allreduce", "naive_flat"),
    ]


# --------------------------------------------------------------- one rank
class _Runner:
    """A variant's model, optimizer and strategy on this rank."""

    def __init__(self, variant: Variant, workload, batch, timeout: float, device: torch.device) -> None:
        from syncline.strategies.bucketed_ddp import BucketedDDP
        from syncline.strategies.native_ddp import NativeDDP
        from syncline.trainer.precision import Precision

        self.variant = variant
        self.batch = batch
        torch.manual_seed(0)
        self.model = workload.make_model().to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=workload.momentum)
        self.precision = Precision(variant.precision, device)
        self.cuda = device.type == "cuda"
        backend = dist.get_backend()  # the group `rank_timings` joined: gloo on the CPU, NCCL on CUDA
        # Only the options a variant turns on, so that every other one is the reducer's own default.
        options = {name: True for name in ("find_unused_parameters", "static_graph") if getattr(variant, name)}
        self.strategy = None
        if variant.reducer == "bucketed":
            caps = (
                {} if variant.cap_mb is None else {"bucket_cap_mb": variant.cap_mb, "first_bucket_mb": variant.cap_mb}
            )
            self.strategy = BucketedDDP(backend=backend, timeout=timeout, overlap=variant.overlap, **caps, **options)
        elif variant.reducer == "native":
            # An explicit cap also caps torch's first bucket (torch 2.x), as `first_bucket_mb` does ours.
            caps = {} if variant.cap_mb is None else {"bucket_cap_mb": variant.cap_mb}
            self.strategy = NativeDDP(backend=backend, timeout=timeout, **caps, **options)
        if self.strategy is not None:
            self.strategy.setup(self.model)
        elif variant.reducer in NAIVE:
            with torch.no_grad():
                for p in self.model.parameters():
                    # Collective: every rank starts from rank 0's parameters, as a strategy's setup makes them.
                    dist.broadcast(p, src=0)
        self.index = 0

    def _now(self) -> float:
        """The time, once this device's queued work is done (CUDA runs asynchronously to Python)."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step(self, sync: bool) -> tuple[float, float, float, float | None]:
        """Run one micro-batch; return forward, backward and optimizer seconds, and the exposed wait (or None)."""
        strategy, k, precision = self.strategy, self.variant.sync_every, self.precision
        start = self._now()
        with precision.autocast():
            if strategy is None:
                loss = self.model.training_step(self.batch, self.index)
            else:
                strategy.sync_next_backward = sync
                loss = strategy.training_step(self.model, self.batch, self.index)
        if k > 1:
            loss = loss / k
        loss = precision.scale_loss(loss)
        forward_end = self._now()
        exposed = None
        if strategy is not None:
            strategy.backward(loss, sync=sync)
        else:
            loss.backward()
            if sync and self.variant.reducer in NAIVE:
                communication_start = self._now()
                self._all_reduce()
                exposed = self._now() - communication_start
        backward_end = self._now()
        if sync or k == 0:
            precision.step(self.optimizer)()
            if strategy is None:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                strategy.zero_grad(self.optimizer)
        end = self._now()
        self.index += 1
        if sync and strategy is not None:
            wait_ms = strategy.communication_stats().get("comm/exposed_ms")  # BucketedDDP's own measure
            exposed = None if wait_ms is None else wait_ms / 1e3
        return forward_end - start, backward_end - forward_end, end - backward_end, exposed

    def _all_reduce(self) -> None:
        """Average the gradients: per parameter, or as one flat tensor."""
        grads = [p.grad for p in self.model.parameters()]
        world_size = dist.get_world_size()
        if self.variant.reducer == "naive_flat":
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(world_size)
            # Collective: one all-reduce of every gradient.
            dist.all_reduce(flat)
            for grad, value in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(value.view_as(grad))
        else:
            for grad in grads:
                grad.div_(world_size)
                # Collective: one all-reduce per gradient.
                dist.all_reduce(grad)

    def warm(self, steps: int) -> None:
        """Untimed micro-batches; an unsynchronized one of a skip-sync variant leaves no gradient behind."""
        k = self.variant.sync_every
        for _ in range(steps):
            self.step(sync=k == 1)
            if k > 1:
                self.optimizer.zero_grad(set_to_none=self.strategy is None)

    def block(self, steps: int) -> list[tuple]:
        """Timed micro-batches: `steps` (a multiple of `sync_every`), synchronizing every `sync_every`."""
        k = self.variant.sync_every
        return [self.step(k > 0 and (i + 1) % k == 0) for i in range(steps)]


def rank_timings(
    rank: int,
    world_size: int,
    workload_name: str,
    size: str,
    variants: list[Variant],
    plan: Plan,
    timeout: float,
    device: str,
) -> dict[str, list[list[tuple]]]:
    """Time every variant on this rank: per variant, a block per repeat of (forward, backward, optimizer,
    exposed) per micro-batch, in seconds. Joins the process group; call it on every rank."""
    from syncline.strategies.comm.process_group import init_process_group_from_env

    cuda = device == "cuda"
    init_process_group_from_env(backend="nccl" if cuda else "gloo", timeout=timeout)
    on = torch.device("cuda", rank) if cuda else torch.device("cpu")
    workload = build(workload_name, size, **plan.model)
    batch = workload.make_batch(torch.Generator().manual_seed(rank))
    batch = batch.to(on) if isinstance(batch, torch.Tensor) else tuple(t.to(on) for t in batch)
    runners = [_Runner(v, workload, batch, timeout, on) for v in variants]
    # Two micro-batches build torch's buckets, rebuild ours, allocate optimizer state: never timed. (A skip-sync
    # variant's unsynchronized path is warmed before each of its blocks.)
    for runner in runners:
        for _ in range(2):
            runner.step(sync=runner.variant.sync_every != 0)
    timings: dict[str, list] = {v.name: [] for v in variants}
    for repeat in range(plan.repeats):
        shift = repeat % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.warm(plan.warmup)
            steps = plan.steps if runner.variant.sync_every <= 1 else plan.skip_microbatches
            # Collective: start the block together, so neither rank times the other's lag.
            dist.barrier()
            timings[runner.variant.name].append(runner.block(steps))
    dist.barrier()
    return timings


def per_step(per_rank: list[dict[str, list[list[tuple]]]]) -> list[dict[str, dict[str, list[float]]]]:
    """Each rank's timings as flat lists per variant: every step's seconds and backward, the exposed waits, and
    each block's median step (what `common.slowest_rank` and `common.paired_block_ratio` read)."""
    flat = []
    for timings in per_rank:
        ranks = {}
        for name, blocks in timings.items():
            steps = [[f + b + o for f, b, o, _ in block] for block in blocks]
            ranks[name] = {
                "step": [s for block in steps for s in block],
                "backward": [r[1] for block in blocks for r in block],
                "exposed": [r[3] for block in blocks for r in block if r[3] is not None],
                "block": [statistics.median(block) for block in steps],
            }
        flat.append(ranks)
    return flat


# ------------------------------------------------------------ the suite
def run_ddp_workload(workload_name: str, size: str, plan: Plan, timeout: float) -> dict[str, Any]:
    """Run one workload's two-rank job (gloo, CPU) with `plan`'s variants and summarize every variant."""
    return _run_job(workload_name, size, plan, plan_variants(plan), 2, "cpu", timeout)


def run_device_workload(
    workload_name: str, size: str, plan: Plan, precisions: tuple[str, ...], device: str, timeout: float
) -> dict[str, Any]:
    """Run one workload's one-process job on `device` ("cpu" or "cuda") at each precision; summarize."""
    return _run_job(workload_name, size, plan, device_variants(precisions), 1, device, timeout)


def _run_job(
    workload_name: str, size: str, plan: Plan, variants: list[Variant], world_size: int, device: str, timeout: float
) -> dict[str, Any]:
    args = (workload_name, size, variants, plan, timeout, device)
    per_rank = run_distributed(rank_timings, world_size, args, timeout=timeout)
    return summarize_job(workload_name, size, plan, variants, per_rank)


def summarize_job(
    workload_name: str, size: str, plan: Plan, variants: list[Variant], per_rank: list[dict[str, list]]
) -> dict[str, Any]:
    """Summarize every variant of a job from each rank's `rank_timings`, exposed wait included."""
    workload = build(workload_name, size, **plan.model)
    batch = workload.config["batch"]
    results = {}
    for variant in variants:
        results[variant.name] = _summarize(variant, [r[variant.name] for r in per_rank], batch, len(per_rank))
    for result in results.values():
        if result["reducer"] != "local" and result["sync_every"] == 1:
            local_backward = results[variant_name("local", result["precision"])]["phases_ms"]["backward"]
            result["exposed_comm_ms"] = round(result["phases_ms"]["backward"] - local_backward, 3)
    return {"workload": workload.describe(), "plan": asdict(plan), "variants": results}


def _summarize(variant: Variant, ranks: list[list[list[tuple]]], batch: int, world_size: int) -> dict[str, Any]:
    """Combine the ranks' blocks: every step counts with the phases of its slower rank."""
    steps, phases, block_medians, block_totals, exposed = [], [], [], [], []
    for blocks in zip(*ranks):  # one repeat: the same block on every rank
        block = []
        for records in zip(*blocks):  # one micro-batch on every rank
            slower = max(records, key=lambda r: r[0] + r[1] + r[2])
            block.append(slower[0] + slower[1] + slower[2])
            phases.append(slower[:3])
            exposed += [r[3] for r in records if r[3] is not None]
        steps += block
        block_medians.append(statistics.median(block))
        block_totals.append(sum(block))
    result = {
        **asdict(variant),
        "step": summary(steps),
        "block_medians_ms": [ms(b) for b in block_medians],
        "phases_ms": {
            name: ms(statistics.median(p[i] for p in phases))
            for i, name in enumerate(("forward", "backward", "optimizer"))
        },
    }
    if exposed:
        result["reducer_exposed_wait_ms"] = ms(statistics.median(exposed))
    # Amortized over a block: every micro-batch of a window, the synchronizing one included; a sample is
    # one of the global batch (batch per rank x ranks).
    per_block = len(steps) // len(block_totals)
    result["per_sample"] = summary([total / (per_block * batch * world_size) for total in block_totals])
    return result


# ---------------------------------------------------- the `ddp` command
#: The `ddp` command's defaults: the layer stack at its full size, 20 repeats of 10 timed steps after 3 untimed.
COMMAND_PLAN = Plan(workloads=("layers",), repeats=20, steps=10, warmup=3, timeout_s=3600.0)


def summarize_comparison(per_rank: list[dict], plan: Plan, world_size: int) -> dict[str, Any]:
    """The `ddp` command's summary: step and backward per variant as their slowest rank took them, exposed
    communication, and BucketedDDP / NativeDDP by median step and per repeat."""
    per_rank = per_step(per_rank)

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
    workload = build(plan.workloads[0], plan.size, **plan.model)
    width, depth = workload.config["width"], workload.config["depth"]
    return {
        "machine": {**machine(), "world_size": world_size},
        "setup": {
            "world_size": world_size,
            "model": f"{depth} x (Linear({width}, {width}) + LayerNorm({width}))",
            "parameters": workload.describe()["parameters"],
            "batch_per_rank": workload.config["batch"],
            "optimizer": "SGD(lr=1e-3)",
            "repeats": plan.repeats,
            "steps_per_block": plan.steps,
            "warmup_per_block": plan.warmup,
            "exposed_comm_method": "median backward(sync=True) - median backward(sync=False) of the same strategy; "
            "naive baselines and no-overlap: time from end of loss.backward() to end of communication",
        },
        "variants": variants,
        "ratio_bucketed_over_native": round(ratio, 4),
        "paired_block_ratio_bucketed_over_native": paired_block_ratio(per_rank, "bucketed_ddp", "native_ddp"),
    }


def _print_table(summary: dict) -> None:
    """Print the `ddp` command's table and ratios."""
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
    parser.add_argument("--repeats", type=int, default=COMMAND_PLAN.repeats)
    parser.add_argument("--steps", type=int, default=COMMAND_PLAN.steps, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, default=COMMAND_PLAN.warmup, help="untimed steps before each block")
    add_out_argument(parser, "ddp.json")


def command(args: argparse.Namespace) -> None:
    """Time the comparison's variants on `--world-size` local ranks; print the table and write the JSON."""
    plan = replace(COMMAND_PLAN, repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    job = (plan.workloads[0], plan.size, comparison_variants(), plan, plan.timeout_s, "cpu")
    per_rank, load = run_world(rank_timings, args.world_size, job, plan.timeout_s)
    result = summarize_comparison(per_rank, plan, args.world_size)
    result["machine"]["load_average_1min"] = load
    _print_table(result)
    if args.out is not None:
        write_json(args.out, result)
