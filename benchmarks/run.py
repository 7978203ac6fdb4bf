"""Run syncline's benchmark suite: the DDP paper's experiments on this machine, in one command.

    python -m benchmarks              # the full suite, about 15 minutes on 2 cores -> results/suite.json
    python -m benchmarks --report     # the same, then the figures (docs/img) and the tables of docs/performance.md
    python -m benchmarks --quick      # the same experiments, fewer points and repeats, about 2.5 minutes
    python -m benchmarks --sections ddp,overhead --out /tmp/x.json

Sections (in the order they run):

- `ddp`: per workload (ResNet-style CNN, BERT-style encoder, the tiny MLP), one two-rank gloo job in which
  every variant is interleaved: latency breakdown (forward, backward, exposed communication, optimizer) of
  local training, BucketedDDP and NativeDDP at their defaults; a bucket-size sweep for both reducers;
  BucketedDDP with overlap off at every size; skipped synchronization every k micro-batches.
- `device`: one process on one device (CUDA with NCCL when a GPU is present, else the CPU with gloo):
  local training, NativeDDP and BucketedDDP at world size 1, so each reducer's own per-step cost shows
  without communication (the tiny MLP; on CUDA also the CNN and BERT, and bf16 and fp16 mixed precision).
- `curves`: CharGPT (the default example) trained through the Trainer on two ranks with BucketedDDP,
  synchronizing every k micro-batches: loss curves and final validation loss.
- `overhead`: Trainer vs hand-written loop vs pytorch-lightning on the tiny MLP, in fresh processes.
- `strategies`: CharGPT for a fixed number of steps with every registered strategy.
- `gpt2` (only when named, `--sections gpt2`; about 30 minutes -> results/gpt2_study.json): the GPT-2
  data-parallel study (benchmarks/gpt2_study.py): a 4.8 M-parameter CharGPT with single, both parameter
  servers, tensor_fusion, the sharded server and tensor_fusion under bf16-mixed, bucketed_ddp and
  native_ddp: samples per second, memory per rank, bytes per step and time to a target validation loss.
- `lab` (only when named, `--sections lab`; about two hours -> results/lab.json; root and iproute2): the
  network lab (benchmarks/lab/__init__.py): every strategy against its link's bound on 2 and 4 nodes at 1 Gbit/s
  and 100 Mbit/s, the overlap and bucket-size sweep on shaped links, and BAGUA's trade-off (seconds to a
  fixed validation loss, strategy x link x nodes). Where namespaces are not permitted it says so in one
  line and records only that.

Every figure is a median over repeats with its spread; the JSON holds the machine's description and its
load average at the start and end of every section. `python -m benchmarks plot` draws the figures and
`python -m benchmarks report` prints the report's tables from the JSON; `--report` does both into docs/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .analysis import headlines
from .common import ROOT, load_average, machine
from .ddp_suite import ALL_IN_ONE_MB, DDPPlan, run_ddp_workload, run_device_workload
from .example_runs import run_example, summarize_runs
from .gpt2_study import GPT2_PLANS, GPT2Plan, run_gpt2_study
from .lab import LAB_PLANS, LabPlan, run_lab_section
from .overhead import run_overhead
from .plot import plot_all
from .report import fill

__all__ = ["OPTIONAL_SECTIONS", "PLANS", "SECTIONS", "add_arguments", "command"]

SECTIONS = ("ddp", "device", "curves", "overhead", "strategies")
#: Sections that run only when `--sections` names them, each into its own results file by default.
OPTIONAL_SECTIONS = {"gpt2": "gpt2_study", "lab": "lab"}
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
FIGURES = ROOT / "docs" / "img"

#: CharGPT for the loss curves: small and short, so four two-rank runs take about a minute and a half.
SMALL_GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "max_chars": 1_000_000, "sample_chars": 0}
#: CharGPT as `python -m syncline` trains it (4 layers, width 128, context 64), without the final sample.
DEFAULT_GPT = {"max_chars": 1_000_000, "sample_chars": 0}
#: The curves' base learning rate (CharGPT's default) and the rules that scale it for an effective batch k times larger.
CURVE_LR = 3e-3
LR_SCALINGS = {"base": lambda k: 1.0, "sqrt": math.sqrt, "linear": float}
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "max_chars": 20_000, "sample_chars": 0}


@dataclass(frozen=True)
class Plan:
    """Sizes, repeats and steps of every section for one mode of the suite."""

    size: str
    ddp: DDPPlan
    mlp: DDPPlan
    workloads: tuple[str, ...] = ("cnn", "bert")
    #: The one-device section: world size 1, no sweep; mixed precisions are timed on CUDA only.
    device: DDPPlan = DDPPlan(caps_mb=(), sync_every=(1,), repeats=7, steps=2)
    #: The tiny MLP on one device: the reducers' fixed cost per step, which its 0.3 ms steps make visible.
    device_mlp: DDPPlan = DDPPlan(caps_mb=(), sync_every=(1,), repeats=7, steps=40, warmup=5)
    device_precisions_cuda: tuple[str, ...] = ("bf16-mixed", "16-mixed")
    curve_model: dict = field(default_factory=lambda: dict(SMALL_GPT))
    curve_batch: int = 16
    curve_microbatches: int = 384
    curve_sync_every: tuple[int, ...] = (1, 2, 4, 8)
    #: Learning rates tried for k > 1 besides the base rate: `lr * sqrt(k)` and `lr * k`.
    curve_lr_scalings: tuple[str, ...] = ("sqrt", "linear")
    strategy_model: dict = field(default_factory=lambda: dict(DEFAULT_GPT))
    strategy_global_batch: int = 32
    strategy_steps: int = 80
    strategy_repeats: int = 2
    val_batches: int = 20
    overhead_steps: int = 400
    overhead_warmup: int = 200
    overhead_repeats: int = 3
    overhead_inprocess_steps: int = 1200
    overhead_inprocess_repeats: int = 7
    timeout_s: float = 900.0
    gpt2: GPT2Plan = GPT2_PLANS["full"]
    lab: LabPlan = LAB_PLANS["full"]


PLANS = {
    "full": Plan(
        size="full",
        ddp=DDPPlan(
            caps_mb=(0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, ALL_IN_ONE_MB),
            no_overlap_caps_mb=(0.0, 1.0, 4.0, ALL_IN_ONE_MB),
            sync_every=(1, 2, 4, 8),
            repeats=7,
            steps=2,
            skip_microbatches=8,
        ),
        mlp=DDPPlan(caps_mb=(), sync_every=(1,), repeats=7, steps=40, warmup=5),
    ),
    "quick": Plan(
        size="full",
        ddp=DDPPlan(
            caps_mb=(0.0, ALL_IN_ONE_MB),
            no_overlap_caps_mb=(0.0,),
            sync_every=(1, 4),
            repeats=2,
            steps=2,
            skip_microbatches=4,
        ),
        mlp=DDPPlan(caps_mb=(), sync_every=(1,), repeats=2, steps=20, warmup=5),
        device=DDPPlan(caps_mb=(), sync_every=(1,), repeats=2, steps=2),
        device_mlp=DDPPlan(caps_mb=(), sync_every=(1,), repeats=2, steps=20, warmup=5),
        curve_microbatches=64,
        curve_sync_every=(1, 4),
        curve_lr_scalings=(),
        strategy_steps=10,
        strategy_repeats=1,
        val_batches=5,
        overhead_steps=300,
        overhead_warmup=100,
        overhead_repeats=1,
        overhead_inprocess_steps=300,
        overhead_inprocess_repeats=2,
        timeout_s=300.0,
        gpt2=GPT2_PLANS["quick"],
        lab=LAB_PLANS["quick"],
    ),
    "smoke": Plan(
        size="tiny",
        ddp=DDPPlan(
            caps_mb=(0.0, ALL_IN_ONE_MB),
            no_overlap_caps_mb=(0.0,),
            sync_every=(1, 2),
            repeats=1,
            steps=2,
            skip_microbatches=2,
        ),
        mlp=DDPPlan(caps_mb=(), sync_every=(1,), repeats=1, steps=2),
        device=DDPPlan(caps_mb=(), sync_every=(1,), repeats=1, steps=2),
        device_mlp=DDPPlan(caps_mb=(), sync_every=(1,), repeats=1, steps=2),
        curve_model=dict(TINY_GPT),
        curve_batch=4,
        curve_microbatches=4,
        curve_sync_every=(1, 2),
        curve_lr_scalings=("sqrt",),
        strategy_model=dict(TINY_GPT),
        strategy_global_batch=8,
        strategy_steps=2,
        strategy_repeats=1,
        val_batches=1,
        overhead_steps=30,
        overhead_warmup=10,
        overhead_repeats=1,
        overhead_inprocess_steps=30,
        overhead_inprocess_repeats=1,
        timeout_s=120.0,
        gpt2=GPT2_PLANS["smoke"],
        lab=LAB_PLANS["smoke"],
    ),
}


# ---------------------------------------------------------------- sections
def run_ddp(plan: Plan, log) -> dict[str, Any]:
    """Experiments 1-3 and skip-sync timing: one two-rank job per workload."""
    results = {}
    for name in (*plan.workloads, "mlp"):
        log(f"ddp: {name}")
        sweep = name != "mlp"
        results[name] = run_ddp_workload(name, plan.size, plan.ddp if sweep else plan.mlp, sweep, plan.timeout_s)
    return results


def run_device(plan: Plan, log) -> dict[str, Any]:
    """One process on one device: each reducer's own cost at world size 1, and mixed precision on CUDA."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    precisions = ("32",)
    if cuda:
        precisions += tuple(
            p for p in plan.device_precisions_cuda if p != "bf16-mixed" or torch.cuda.is_bf16_supported()
        )
    results: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if cuda else machine()["cpu"],
        "backend": "nccl" if cuda else "gloo",
        "world_size": 1,
        "precisions": list(precisions),
        "workloads": {},
    }
    # On the CPU a reducer's sub-millisecond bookkeeping is lost in the 10% spread of a 250 ms CNN or BERT
    # step (two trial runs put BucketedDDP / local at 0.94 and 1.08 on the CNN), so only the MLP runs there.
    for name in (*plan.workloads, "mlp") if cuda else ("mlp",):
        log(f"device: {name} on {device}, precisions {', '.join(precisions)}")
        job = plan.device_mlp if name == "mlp" else plan.device
        results["workloads"][name] = run_device_workload(name, plan.size, job, precisions, device, plan.timeout_s)
    return results


def run_curves(plan: Plan, log) -> dict[str, Any]:
    """Experiment 4's convergence half: CharGPT with BucketedDDP, synchronizing every k micro-batches.

    Every k trains on the same micro-batches with the base learning rate (`runs`); each k > 1 is also
    trained with the rate scaled for its k times larger effective batch (`lr_scaled`: sqrt, linear), so
    that the convergence cost is not only that of a learning rate tuned for k = 1.
    """
    runs: dict[str, Any] = {}
    scaled: dict[str, dict[str, Any]] = {}
    model = {**plan.curve_model, "batch_size": plan.curve_batch, "warmup_steps": 32, "lr": CURVE_LR}
    for k in plan.curve_sync_every:
        for scaling in ("base", *plan.curve_lr_scalings) if k > 1 else ("base",):
            lr = CURVE_LR * LR_SCALINGS[scaling](k)
            log(f"curves: sync every {k}, lr {lr:.2e} ({scaling})")
            config = _example_config(plan, "bucketed_ddp", 2, {**model, "lr": lr}, plan.curve_microbatches, k)
            result = {"lr": lr, **summarize_runs([run_example(config, plan.timeout_s)])}
            if scaling == "base":
                runs[str(k)] = result
            else:
                scaled.setdefault(str(k), {})[scaling] = result
    return {
        "model": model,
        "microbatches": plan.curve_microbatches,
        "world_size": 2,
        "runs": runs,
        "lr_scaled": scaled,
    }


def run_strategies(plan: Plan, log) -> dict[str, Any]:
    """Experiment 6: CharGPT for a fixed number of steps with every strategy, interleaved over repeats."""
    strategies = [("single", 1), ("bucketed_ddp", 2), ("native_ddp", 2)]
    runs: dict[str, list] = {name: [] for name, _ in strategies}
    for repeat in range(plan.strategy_repeats):
        shift = repeat % len(strategies)
        for name, devices in strategies[shift:] + strategies[:shift]:
            log(f"strategies: {name} (repeat {repeat + 1})")
            # The same global batch for every strategy, so all take the same steps on the same samples.
            model = {**plan.strategy_model, "batch_size": plan.strategy_global_batch // devices}
            runs[name].append(
                run_example(_example_config(plan, name, devices, model, plan.strategy_steps), plan.timeout_s)
            )
    return {
        "steps": plan.strategy_steps,
        "global_batch": plan.strategy_global_batch,
        "model": plan.strategy_model,
        "strategies": {
            name: {"devices": dict(strategies)[name], **summarize_runs(items)} for name, items in runs.items()
        },
    }


def _example_config(plan: Plan, strategy: str, devices: int, model: dict, microbatches: int, accumulate: int = 1):
    return {
        "strategy": strategy,
        "devices": devices,
        "accumulate": accumulate,
        "microbatches": microbatches,
        "val_batches": plan.val_batches,
        # One thread, as every rank has: on a shared machine a second OpenMP thread per process can
        # wait on a busy core and slow the process down many times over.
        "threads": 1,
        "timeout": plan.timeout_s,
        "model": {"warmup_steps": 50, **model},
    }


def run_overhead_section(plan: Plan, log) -> dict[str, Any]:
    """Experiment 5: framework overhead per step and to the first step."""
    log("overhead: raw loop, Trainer, Lightning (fresh processes, then one process)")
    return run_overhead(
        plan.overhead_steps,
        plan.overhead_warmup,
        plan.overhead_repeats,
        plan.timeout_s,
        plan.overhead_inprocess_steps,
        plan.overhead_inprocess_repeats,
    )


def run_gpt2(plan: Plan, log) -> dict[str, Any]:
    """The GPT-2 data-parallel study (benchmarks/gpt2_study.py)."""
    return run_gpt2_study(plan.gpt2, log)


def run_lab(plan: Plan, log) -> dict[str, Any]:
    """The network lab (benchmarks/lab/__init__.py): strategies against the link's bound, overlap, BAGUA's trade-off."""
    return run_lab_section(plan.lab, log)


_RUNNERS = {
    "ddp": run_ddp,
    "device": run_device,
    "curves": run_curves,
    "overhead": run_overhead_section,
    "strategies": run_strategies,
    "gpt2": run_gpt2,
    "lab": run_lab,
}


# -------------------------------------------------------------------- main
def run_suite(mode: str, sections: tuple[str, ...], out: Path, log=print) -> dict[str, Any]:
    """Run `sections` of the suite in `mode` ("full", "quick", "smoke"); write and return the results."""
    plan = PLANS[mode]
    start = time.perf_counter()
    results: dict[str, Any] = {
        "suite": "syncline benchmarks (the DDP paper's experiments at CPU scale)",
        "mode": mode,
        "command": "python -m benchmarks"
        + {"full": "", "quick": " --quick", "smoke": " --smoke"}[mode]
        + ("" if sections == SECTIONS else f" --sections {','.join(sections)}"),
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**machine(), "load_average_start": load_average()},
        "plan": asdict(plan),
        "sections": {},
    }
    for section in sections:
        section_start = time.perf_counter()
        load_before = load_average()
        results["sections"][section] = _RUNNERS[section](plan, log)
        results["sections"][section]["_timing"] = {
            "wall_s": round(time.perf_counter() - section_start, 1),
            "load_average_start": load_before,
            "load_average_end": load_average(),
        }
        log(f"{section}: {results['sections'][section]['_timing']['wall_s']} s")
    results["machine"]["load_average_end"] = load_average()
    results["wall_s"] = round(time.perf_counter() - start, 1)
    results["headline"] = headlines(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options (`python -m benchmarks` with no command takes them too)."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer points and repeats (about 2.5 minutes)")
    mode.add_argument("--smoke", action="store_true", help="tiny models, a couple of steps (for the test suite)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {SECTIONS}, or of those run only when named: {tuple(OPTIONAL_SECTIONS)}",
    )
    parser.add_argument(
        "--out", type=Path, help="JSON file (default: benchmarks/results/suite.json; quick: <temp>/syncline-benchmarks)"
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help=f"full suite only: then draw {FIGURES.relative_to(ROOT)}/*.png and fill {PAGE.relative_to(ROOT)}'s tables",
    )


def command(args: argparse.Namespace) -> None:
    """Run the sections asked for; with --report, draw the figures and fill the page's tables."""
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.report and (name != "full" or args.sections != ",".join(SECTIONS)):
        sys.exit("--report writes docs/performance.md, which quotes a full run: drop --quick/--smoke/--sections")
    if args.report:
        # Fail before a 14-minute run, not after it.
        import matplotlib  # noqa: F401  (the bench extra: pip install -e ".[bench]")
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = [s for s in sections if s not in SECTIONS and s not in OPTIONAL_SECTIONS]
    if unknown:
        sys.exit(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join((*SECTIONS, *OPTIONAL_SECTIONS))}")
    stem = "suite"
    if len(sections) == 1 and sections[0] in OPTIONAL_SECTIONS:
        stem = OPTIONAL_SECTIONS[sections[0]]
    # Only a full run replaces the committed results; a quick or smoke run goes to the temp folder.
    folder = RESULTS if name == "full" else Path(tempfile.gettempdir()) / "syncline-benchmarks"
    out = args.out or folder / (stem + {"full": ".json", "quick": "_quick.json", "smoke": "_smoke.json"}[name])

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    results = run_suite(name, sections, out, log)
    log(f"done in {results['wall_s']} s; wrote {out}")
    print(json.dumps(results["headline"], indent=1))
    if args.report:
        for path in plot_all(results, FIGURES):
            log(f"wrote {path}")
        PAGE.write_text(fill(PAGE.read_text(), results))
        log(f"filled the tables of {PAGE}; its prose quotes numbers too: reread it")
