"""How much every job of the suite measures, per mode: one `Plan` class, one instance per job.

`PLANS[mode][job]` is a job's plan in a mode of `python -m benchmarks` ("full", "quick", "smoke"); a command
that runs one job alone (`ddp`, `many-params`, `lab ddp`) builds a `Plan` from its options. A field means the
same in every job that reads it (`repeats` is always the number of interleaved repeats, `steps` what each
repeat or run trains), and a job leaves the fields it does not read at their defaults:

- `ddp`, `ddp_mlp`: the two-rank DDP comparison per workload (`benchmarks/ddp.py`): workloads, caps_mb,
  no_overlap_caps_mb, sync_every, skip_microbatches, repeats, steps, warmup, size;
- `device`, `device_mlp`: the same at world size 1 on one device: workloads, precisions (the `device` job's),
  repeats, steps, warmup, size;
- `curves`: CharGPT through the Trainer, synchronizing every k: model, batch (per rank), steps
  (micro-batches), sync_every, labels (learning-rate rules), val_batches;
- `strategies`: CharGPT with every strategy: model, batch (global), steps, repeats, val_batches;
- `overhead`, `overhead_inprocess`: the Trainer against the raw loop, in fresh processes and in one: steps,
  warmup, repeats;
- `gpt2`: the GPT-2 study (`benchmarks/gpt2_study.py`): model, batch (global), steps, warmup, repeats,
  val_every, val_batches, target_loss, labels (configs);
- `lab_strategies`, `lab_ddp`, `lab_tradeoff`: the network lab's jobs (`benchmarks/lab_section.py`): nodes, rates,
  steps, labels; `lab_ddp` also caps_mb and repeats.

Every job but the lab's reads `timeout_s`.

One class rather than one per section, because the sections count the same things (repeats, steps, warm-up
steps, a model's settings, a batch, node counts and link rates): with a class per section each spelled them
its own way (`strategy_repeats`, `ddp_repeats`, `curve_microbatches`, ...), and the DDP harness, which the
suite, the `ddp` command and the lab all run, needs one plan type whoever calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ALL_IN_ONE_MB", "PLANS", "Plan"]

#: Bucket cap standing for "one bucket holds every gradient".
ALL_IN_ONE_MB = 1024.0

#: CharGPT for the loss curves: small and short, so four two-rank runs take about a minute and a half.
SMALL_GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "max_chars": 1_000_000, "sample_chars": 0}
#: CharGPT as `python -m syncline` trains it (4 layers, width 128, context 64), without the final sample.
DEFAULT_GPT = {"max_chars": 1_000_000, "sample_chars": 0}
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "max_chars": 20_000, "sample_chars": 0}
#: GPT-2's layout at a size where one rank's step takes about half a second on one core: 4.8 M parameters.
GPT2_MODEL = {
    "n_layer": 6,
    "n_head": 8,
    "n_embd": 256,
    "block_size": 128,
    "lr": 1e-3,
    "warmup_steps": 20,
    "max_chars": 1_000_000,
    "sample_chars": 0,
}
TINY_GPT2 = {**TINY_GPT, "lr": 3e-3, "warmup_steps": 2}
#: The quick and smoke modes' bucket sweep: per-parameter buckets and one bucket, with overlap off at the first.
FEW_CAPS = {"caps_mb": (0.0, ALL_IN_ONE_MB), "no_overlap_caps_mb": (0.0,)}
#: The lab's strategies and trade-off in the quick mode: a few strategies that differ in what they send.
QUICK_LAB = ("bucketed_ddp", "powersgd", "local_sgd")


@dataclass(frozen=True)
class Plan:
    """What one job measures: its sizes, repeats and steps (see the module's table for who reads what).

    Attributes:
        size: the workloads' size, "full" or "tiny" (`benchmarks/workloads.py`).
        workloads: the DDP jobs' workloads, by name.
        model: the model's settings over its defaults: CharGPT's, or a DDP workload's (width, depth, batch).
        batch: samples per step: per rank for `curves`, the global batch for `strategies` and `gpt2`.
        repeats: interleaved repeats, each in an order rotated by one.
        steps: timed steps per variant and repeat (DDP jobs), steps trained (training runs, the lab), micro-batches
            trained (`curves`).
        warmup: untimed steps before each timed block, or steps left out of the steady-state step time.
        sync_every: intervals of synchronization (every k micro-batches) that are measured.
        skip_microbatches: micro-batches per block of a DDP job's skip-sync variants.
        caps_mb: bucket caps swept, for both reducers.
        no_overlap_caps_mb: the caps at which BucketedDDP also runs with overlap off.
        precisions: the one-device job's precisions ("32" always; the mixed ones on CUDA only).
        labels: which of the job's named configs, strategies or learning-rate rules run; empty: all.
        nodes: the lab's node counts.
        rates: the lab's link rates (None: unshaped).
        val_every: steps between validations.
        val_batches: validation batches per rank.
        target_loss: the validation loss every config is timed to.
        timeout_s: seconds one run or job may take (the lab's jobs keep their own).
    """

    size: str = "full"
    workloads: tuple[str, ...] = ()
    model: dict[str, Any] = field(default_factory=dict)
    batch: int = 0
    repeats: int = 1
    steps: int = 2
    warmup: int = 1
    sync_every: tuple[int, ...] = (1,)
    skip_microbatches: int = 8
    caps_mb: tuple[float, ...] = ()
    no_overlap_caps_mb: tuple[float, ...] = ()
    precisions: tuple[str, ...] = ("32",)
    labels: tuple[str, ...] = ()
    nodes: tuple[int, ...] = ()
    rates: tuple[str | None, ...] = ()
    val_every: int = 0
    val_batches: int = 1
    target_loss: float = 0.0
    timeout_s: float = 900.0


def _mode(base: dict[str, Plan], size: str, timeout_s: float, **changes: dict[str, Any]) -> dict[str, Plan]:
    """`base`'s plans at `size` and `timeout_s`, each job with its `changes`."""
    unknown = set(changes) - set(base)
    if unknown:
        raise ValueError(f"no such job(s): {', '.join(sorted(unknown))}")
    return {job: replace(plan, size=size, timeout_s=timeout_s, **changes.get(job, {})) for job, plan in base.items()}


#: The full suite: about 15 minutes on 2 cores (`gpt2` about 30 more, `lab` about two hours).
_FULL = {
    "ddp": Plan(
        workloads=("cnn", "bert"),
        caps_mb=(0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, ALL_IN_ONE_MB),
        no_overlap_caps_mb=(0.0, 1.0, 4.0, ALL_IN_ONE_MB),
        sync_every=(1, 2, 4, 8),
        repeats=7,
        steps=2,
    ),
    # The tiny MLP: defaults only, and longer blocks, since its steps take under a millisecond.
    "ddp_mlp": Plan(workloads=("mlp",), repeats=7, steps=40, warmup=5),
    # One device, world size 1: the CNN and BERT only on CUDA (on the CPU a reducer's bookkeeping is lost in
    # their steps' spread); mixed precisions are timed on CUDA only.
    "device": Plan(workloads=("cnn", "bert"), precisions=("32", "bf16-mixed", "16-mixed"), repeats=7, steps=2),
    "device_mlp": Plan(workloads=("mlp",), repeats=7, steps=40, warmup=5),
    "curves": Plan(model=SMALL_GPT, batch=16, steps=384, sync_every=(1, 2, 4, 8), val_batches=20),
    "strategies": Plan(model=DEFAULT_GPT, batch=32, steps=80, repeats=2, val_batches=20),
    "overhead": Plan(steps=400, warmup=200, repeats=3),
    "overhead_inprocess": Plan(steps=1200, repeats=7),
    # The validation loss every config is timed to was chosen from a pilot so that all reach it.
    "gpt2": Plan(
        model=GPT2_MODEL, batch=16, steps=100, warmup=5, val_every=10, val_batches=4, repeats=3, target_loss=2.45
    ),
    "lab_strategies": Plan(nodes=(2, 4), rates=("1gbit", "100mbit"), steps=12),
    "lab_ddp": Plan(rates=("1gbit", "100mbit"), caps_mb=(0.0, 1.0, 4.0, 25.0, ALL_IN_ONE_MB), repeats=5, steps=2),
    # Up to the default example's full epoch.
    "lab_tradeoff": Plan(nodes=(2, 4), rates=(None, "1gbit", "100mbit"), steps=439),
}

PLANS: dict[str, dict[str, Plan]] = {
    "full": _mode(_FULL, "full", 900.0),
    # The same experiments, fewer points and repeats: about 2.5 minutes (`gpt2` about 10, `lab` about 10).
    "quick": _mode(
        _FULL,
        "full",
        300.0,
        ddp={**FEW_CAPS, "sync_every": (1, 4), "repeats": 2, "skip_microbatches": 4},
        ddp_mlp={"repeats": 2, "steps": 20},
        device={"repeats": 2},
        device_mlp={"repeats": 2, "steps": 20},
        curves={"steps": 64, "sync_every": (1, 4), "labels": ("base",), "val_batches": 5},
        strategies={"steps": 10, "repeats": 1, "val_batches": 5},
        overhead={"steps": 300, "warmup": 100, "repeats": 1},
        overhead_inprocess={"steps": 300, "repeats": 2},
        gpt2={"steps": 40, "repeats": 1, "target_loss": 3.0},
        lab_strategies={"nodes": (2,), "rates": ("100mbit",), "steps": 4, "labels": QUICK_LAB},
        lab_ddp={"rates": ("100mbit",), "repeats": 1},
        lab_tradeoff={"nodes": (2,), "rates": ("100mbit",), "labels": QUICK_LAB},
    ),
    # Tiny models and a couple of steps, for the test suite: that every job runs end to end.
    "smoke": _mode(
        _FULL,
        "tiny",
        120.0,
        ddp={**FEW_CAPS, "sync_every": (1, 2), "repeats": 1, "skip_microbatches": 2},
        ddp_mlp={"repeats": 1, "steps": 2, "warmup": 1},
        device={"repeats": 1},
        device_mlp={"repeats": 1, "steps": 2, "warmup": 1},
        curves={
            "model": TINY_GPT,
            "batch": 4,
            "steps": 4,
            "sync_every": (1, 2),
            "labels": ("base", "sqrt"),
            "val_batches": 1,
        },
        strategies={"model": TINY_GPT, "batch": 8, "steps": 2, "repeats": 1, "val_batches": 1},
        overhead={"steps": 30, "warmup": 10, "repeats": 1},
        overhead_inprocess={"steps": 30, "repeats": 1},
        gpt2={
            "model": TINY_GPT2,
            "batch": 8,
            "steps": 2,
            "warmup": 0,
            "val_every": 1,
            "val_batches": 1,
            "repeats": 1,
            "target_loss": 10.0,
            "labels": ("single", "sharded_ps bf16"),
        },
        lab_strategies={"nodes": (2,), "rates": ("1gbit",), "steps": 2, "labels": ("bucketed_ddp",)},
        lab_ddp={"rates": ()},
        lab_tradeoff={"nodes": (2,), "rates": ("1gbit",), "steps": 10, "labels": ("bucketed_ddp",)},
    ),
}
