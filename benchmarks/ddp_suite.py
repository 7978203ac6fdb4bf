"""Experiments 1-4 of the suite: latency breakdown, bucket-size sweep, overlap on/off, skip-sync timing.

One two-rank job per workload (gloo, 127.0.0.1, one thread per rank). Every variant of the job (no
synchronization, BucketedDDP and NativeDDP at each bucket cap, BucketedDDP without overlap, skipped
synchronization every k micro-batches) trains its own copy of the same model on a fixed batch per rank,
and all variants stay alive for the whole job. Each repeat runs a block of every variant, in an order
rotated by one per repeat, so that drift of the machine (other jobs, thermal) hits all of them alike.

A step is forward, backward, and (when the step synchronizes) optimizer step and zero_grad. Every phase
is timed on every rank; a synchronized step is as slow as its slower rank, so each step counts with the
phases of its slower rank. Data loading is not timed: the batch is made once.

Exposed communication, the part of the step spent waiting for gradients after the backward's own
compute, is the median backward of a variant minus the median backward of `local` (same model, no
synchronization at all, both ranks computing at once so the cores are as busy). torch's reducer keeps
its timers private, so this is the one measure both reducers share; for BucketedDDP the reducer's own
wait (`comm/exposed_ms`) is recorded as well.

`run_device_workload` is the one-device experiment (section `device`): one process, world size 1, on
CUDA with NCCL when a GPU is present, else on the CPU with gloo. Communication is then a no-op copy, so
BucketedDDP / local and NativeDDP / local measure each reducer's own bookkeeping per step (hooks,
bucket views or copies, futures), and on CUDA every variant also runs under mixed precision (the
Trainer's `Precision`: autocast, and loss scaling for fp16). On CUDA each phase ends with
`torch.cuda.synchronize()`, so a phase's time is its kernels' time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from syncline.strategies.comm.ranks import run_distributed

from .common import ms, summary
from .workloads import build

__all__ = [
    "DDPPlan",
    "Variant",
    "device_variants",
    "plan_variants",
    "rank_timings",
    "run_ddp_workload",
    "run_device_workload",
    "summarize_job",
    "variant_name",
]

#: Bucket cap standing for "one bucket holds every gradient".
ALL_IN_ONE_MB = 1024.0


@dataclass(frozen=True)
class Variant:
    """One way of training the workload.

    Attributes:
        name: unique label, e.g. "bucketed cap=1" or "native default".
        reducer: "local" (no synchronization), "bucketed" (syncline's BucketedDDP) or "native" (torch's DDP).
        cap_mb: bucket cap, also used as the first bucket's cap so the sweep is one number; None: defaults.
        overlap: BucketedDDP only; False launches every bucket after the backward.
        sync_every: synchronize (and step the optimizer) every this many micro-batches.
        precision: the Trainer's precision setting: "32", "bf16-mixed" or "16-mixed" (CUDA only).
    """

    name: str
    reducer: str
    cap_mb: float | None = None
    overlap: bool = True
    sync_every: int = 1
    precision: str = "32"


@dataclass(frozen=True)
class DDPPlan:
    """How much to measure: bucket caps (with and without overlap), skip-sync intervals, repeats, steps."""

    caps_mb: tuple[float, ...]
    sync_every: tuple[int, ...]
    repeats: int
    steps: int
    warmup: int = 1
    skip_microbatches: int = 8
    no_overlap_caps_mb: tuple[float, ...] = ()


def plan_variants(plan: DDPPlan, sweep: bool = True) -> list[Variant]:
    """Return the variants of one workload's job; without `sweep` only the default ones."""
    variants = [
        Variant("local", "local"),
        Variant("native default", "native"),
        Variant("bucketed default", "bucketed"),
        Variant("bucketed default no-overlap", "bucketed", overlap=False),
    ]
    if not sweep:
        return variants
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
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.precision = Precision(variant.precision, device)
        self.cuda = device.type == "cuda"
        backend = dist.get_backend()  # the group `_rank` joined: gloo on the CPU, NCCL on CUDA
        self.strategy = None
        if variant.reducer == "bucketed":
            caps = (
                {} if variant.cap_mb is None else {"bucket_cap_mb": variant.cap_mb, "first_bucket_mb": variant.cap_mb}
            )
            self.strategy = BucketedDDP(backend=backend, timeout=timeout, overlap=variant.overlap, **caps)
        elif variant.reducer == "native":
            # An explicit cap also caps torch's first bucket (torch 2.x), as `first_bucket_mb` does ours.
            caps = {} if variant.cap_mb is None else {"bucket_cap_mb": variant.cap_mb}
            self.strategy = NativeDDP(backend=backend, timeout=timeout, **caps)
        if self.strategy is not None:
            self.strategy.setup(self.model)
        self.index = 0

    def _now(self) -> float:
        """The time, once this device's queued work is done (CUDA runs asynchronously to Python)."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step(self, sync: bool) -> tuple[float, float, float, float | None]:
        """Run one micro-batch; return forward, backward, optimizer seconds and BucketedDDP's exposed wait."""
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
        if strategy is None:
            loss.backward()
        else:
            strategy.backward(loss, sync=sync)
        backward_end = self._now()
        if sync:
            precision.step(self.optimizer)()
            if strategy is None:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                strategy.zero_grad(self.optimizer)
        end = self._now()
        self.index += 1
        exposed = None
        if sync and self.variant.reducer == "bucketed":
            exposed = strategy.communication_stats().get("comm/exposed_ms")
        return forward_end - start, backward_end - forward_end, end - backward_end, exposed

    def warm(self, steps: int) -> None:
        """Untimed micro-batches; an unsynchronized one leaves no accumulated gradient behind."""
        for _ in range(steps):
            sync = self.variant.sync_every == 1
            self.step(sync)
            if not sync:
                self.optimizer.zero_grad(set_to_none=self.strategy is None)

    def block(self, steps: int) -> list[tuple]:
        """Timed micro-batches: `steps` (a multiple of `sync_every`), synchronizing every `sync_every`."""
        k = self.variant.sync_every
        return [self.step((i + 1) % k == 0) for i in range(steps)]


def rank_timings(
    rank: int, world_size: int, workload_name: str, size: str, variants, plan: DDPPlan, timeout: float, device: str
):
    from syncline.strategies.comm.process_group import init_process_group_from_env

    cuda = device == "cuda"
    init_process_group_from_env(backend="nccl" if cuda else "gloo", timeout=timeout)
    on = torch.device("cuda", rank) if cuda else torch.device("cpu")
    workload = build(workload_name, size)
    batch = tuple(t.to(on) for t in workload.make_batch(torch.Generator().manual_seed(rank)))
    runners = [_Runner(v, workload, batch, timeout, on) for v in variants]
    # Two synchronized micro-batches build torch's buckets, rebuild ours, allocate optimizer state: never
    # timed. (A skip-sync variant's unsynchronized path is warmed before each of its blocks.)
    for runner in runners:
        for _ in range(2):
            runner.step(sync=True)
    timings: dict[str, list] = {v.name: [] for v in variants}
    for repeat in range(plan.repeats):
        shift = repeat % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.warm(plan.warmup)
            steps = plan.steps if runner.variant.sync_every == 1 else plan.skip_microbatches
            # Collective: start the block together, so neither rank times the other's lag.
            dist.barrier()
            timings[runner.variant.name].append(runner.block(steps))
    dist.barrier()
    return timings


# ------------------------------------------------------------ the parent
def run_ddp_workload(workload_name: str, size: str, plan: DDPPlan, sweep: bool, timeout: float) -> dict[str, Any]:
    """Run one workload's two-rank job (gloo, CPU) and summarize every variant."""
    return _run_job(workload_name, size, plan, plan_variants(plan, sweep), 2, "cpu", timeout)


def run_device_workload(
    workload_name: str, size: str, plan: DDPPlan, precisions: tuple[str, ...], device: str, timeout: float
) -> dict[str, Any]:
    """Run one workload's one-process job on `device` ("cpu" or "cuda") at each precision; summarize."""
    return _run_job(workload_name, size, plan, device_variants(precisions), 1, device, timeout)


def _run_job(
    workload_name: str, size: str, plan: DDPPlan, variants: list[Variant], world_size: int, device: str, timeout: float
) -> dict[str, Any]:
    args = (workload_name, size, variants, plan, timeout, device)
    per_rank = run_distributed(rank_timings, world_size, args, timeout=timeout)
    return summarize_job(workload_name, size, plan, variants, per_rank)


def summarize_job(
    workload_name: str, size: str, plan: DDPPlan, variants: list[Variant], per_rank: list[dict[str, list]]
) -> dict[str, Any]:
    """Summarize every variant of a job from each rank's timings (what `_rank` returns), exposed wait included."""
    workload = build(workload_name, size)
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
        result["reducer_exposed_wait_ms"] = round(statistics.median(exposed), 3)
    # Amortized over a block: every micro-batch of a window, the synchronizing one included; a sample is
    # one of the global batch (batch per rank x ranks).
    per_block = len(steps) // len(block_totals)
    result["per_sample"] = summary([total / (per_block * batch * world_size) for total in block_totals])
    return result
