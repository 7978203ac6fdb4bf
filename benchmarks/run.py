"""Run syncline's benchmark suite: the DDP paper's experiments on this machine, in one command.

    python -m benchmarks              # the full suite, about 15 minutes on 2 cores; its headline figures print
    python -m benchmarks --report     # the same into results/suite.json, the figures (docs/img), docs/performance.md
    python -m benchmarks --quick      # the same experiments, fewer points and repeats, about 2.5 minutes
    python -m benchmarks --sections ddp,overhead --out /tmp/x.json   # every figure as JSON

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
- `gpt2` (only when named, `--sections gpt2 --out benchmarks/results/gpt2_study.json`; about 30 minutes): the GPT-2
  data-parallel study (benchmarks/gpt2_study.py): a 4.8 M-parameter CharGPT with single, both parameter
  servers, tensor_fusion, the sharded server and tensor_fusion under bf16-mixed, bucketed_ddp and
  native_ddp: samples per second, memory per rank, bytes per step and time to a target validation loss.
- `lab` (only when named, `--sections lab --out benchmarks/results/lab.json`; about two hours; root, iproute2): the
  network lab (benchmarks/lab_section.py): every strategy against its link's bound on 2 and 4 nodes at 1 Gbit/s
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
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .analysis import headlines
from .common import ROOT, load_average, machine
from .ddp import run_ddp_workload, run_device_workload
from .example_runs import run_example, summarize_runs
from .gpt2_study import run_gpt2_study
from .lab_section import run_lab_section
from .overhead import run_overhead
from .plans import PLANS, Plan
from .plot import plot_all
from .report import fill

__all__ = ["OPTIONAL_SECTIONS", "SECTIONS", "add_arguments", "command", "run_suite"]

#: One mode's plans, by job (`benchmarks/plans.py`).
Plans = Mapping[str, Plan]

SECTIONS = ("ddp", "device", "curves", "overhead", "strategies")
#: Sections that run only when `--sections` names them: the committed results file of each (`--out`).
OPTIONAL_SECTIONS = {"gpt2": "gpt2_study.json", "lab": "lab.json"}
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
FIGURES = ROOT / "docs" / "img"

#: The curves' base learning rate (CharGPT's default) and the rules that scale it for an effective batch k times larger.
CURVE_LR = 3e-3
LR_SCALINGS = {"base": lambda k: 1.0, "sqrt": math.sqrt, "linear": float}


# ---------------------------------------------------------------- sections
def run_ddp(plans: Plans, log) -> dict[str, Any]:
    """Experiments 1-3 and skip-sync timing: one two-rank job per workload (the MLP's without the sweeps)."""
    results = {}
    for plan in (plans["ddp"], plans["ddp_mlp"]):
        for name in plan.workloads:
            log(f"ddp: {name}")
            results[name] = run_ddp_workload(name, plan.size, plan, plan.timeout_s)
    return results


def run_device(plans: Plans, log) -> dict[str, Any]:
    """One process on one device: each reducer's own cost at world size 1, and mixed precision on CUDA."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    precisions = ("32",)
    if cuda:
        precisions += tuple(
            p for p in plans["device"].precisions if p != "32" and (p != "bf16-mixed" or torch.cuda.is_bf16_supported())
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
    for plan in (plans["device"], plans["device_mlp"]) if cuda else (plans["device_mlp"],):
        for name in plan.workloads:
            log(f"device: {name} on {device}, precisions {', '.join(precisions)}")
            results["workloads"][name] = run_device_workload(name, plan.size, plan, precisions, device, plan.timeout_s)
    return results


def run_curves(plans: Plans, log) -> dict[str, Any]:
    """Experiment 4's convergence half: CharGPT with BucketedDDP, synchronizing every k micro-batches.

    Every k trains on the same micro-batches with the base learning rate (`runs`); each k > 1 is also
    trained with the rate scaled for its k times larger effective batch (`lr_scaled`: sqrt, linear), so
    that the convergence cost is not only that of a learning rate tuned for k = 1.
    """
    plan = plans["curves"]
    runs: dict[str, Any] = {}
    scaled: dict[str, dict[str, Any]] = {}
    model = {**plan.model, "batch_size": plan.batch, "warmup_steps": 32, "lr": CURVE_LR}
    # The base rate always runs: it is the reference of every k.
    scalings = ("base", *(s for s in plan.labels or LR_SCALINGS if s != "base"))
    for k in plan.sync_every:
        for scaling in scalings if k > 1 else ("base",):
            lr = CURVE_LR * LR_SCALINGS[scaling](k)
            log(f"curves: sync every {k}, lr {lr:.2e} ({scaling})")
            config = _example_config(plan, "bucketed_ddp", 2, {**model, "lr": lr}, plan.steps, k)
            result = {"lr": lr, **summarize_runs([run_example(config, plan.timeout_s)])}
            if scaling == "base":
                runs[str(k)] = result
            else:
                scaled.setdefault(str(k), {})[scaling] = result
    return {
        "model": model,
        "microbatches": plan.steps,
        "world_size": 2,
        "runs": runs,
        "lr_scaled": scaled,
    }


def run_strategies(plans: Plans, log) -> dict[str, Any]:
    """Experiment 6: CharGPT for a fixed number of steps with every strategy, interleaved over repeats."""
    plan = plans["strategies"]
    strategies = [("single", 1), ("bucketed_ddp", 2), ("native_ddp", 2)]
    runs: dict[str, list] = {name: [] for name, _ in strategies}
    for repeat in range(plan.repeats):
        shift = repeat % len(strategies)
        for name, devices in strategies[shift:] + strategies[:shift]:
            log(f"strategies: {name} (repeat {repeat + 1})")
            # The same global batch for every strategy, so all take the same steps on the same samples.
            model = {**plan.model, "batch_size": plan.batch // devices}
            runs[name].append(run_example(_example_config(plan, name, devices, model, plan.steps), plan.timeout_s))
    return {
        "steps": plan.steps,
        "global_batch": plan.batch,
        "model": plan.model,
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


def run_overhead_section(plans: Plans, log) -> dict[str, Any]:
    """Experiment 5: framework overhead per step and to the first step."""
    log("overhead: raw loop, Trainer, Lightning (fresh processes, then one process)")
    fresh, inprocess = plans["overhead"], plans["overhead_inprocess"]
    return run_overhead(fresh.steps, fresh.warmup, fresh.repeats, fresh.timeout_s, inprocess.steps, inprocess.repeats)


def run_gpt2(plans: Plans, log) -> dict[str, Any]:
    """The GPT-2 data-parallel study (benchmarks/gpt2_study.py)."""
    return run_gpt2_study(plans["gpt2"], log)


_RUNNERS = {
    "ddp": run_ddp,
    "device": run_device,
    "curves": run_curves,
    "overhead": run_overhead_section,
    "strategies": run_strategies,
    "gpt2": run_gpt2,
    "lab": run_lab_section,
}


# -------------------------------------------------------------------- main
def run_suite(mode: str, sections: tuple[str, ...], out: Path | None, log=print) -> dict[str, Any]:
    """Run `sections` of the suite in `mode` ("full", "quick", "smoke"); return the results (and write them to
    `out`)."""
    plans = PLANS[mode]
    start = time.perf_counter()
    results: dict[str, Any] = {
        "suite": "syncline benchmarks (the DDP paper's experiments at CPU scale)",
        "mode": mode,
        "command": "python -m benchmarks"
        + {"full": "", "quick": " --quick", "smoke": " --smoke"}[mode]
        + ("" if sections == SECTIONS else f" --sections {','.join(sections)}"),
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**machine(), "load_average_start": load_average()},
        "plan": {job: asdict(plan) for job, plan in plans.items()},
        "sections": {},
    }
    for section in sections:
        section_start = time.perf_counter()
        load_before = load_average()
        results["sections"][section] = _RUNNERS[section](plans, log)
        results["sections"][section]["_timing"] = {
            "wall_s": round(time.perf_counter() - section_start, 1),
            "load_average_start": load_before,
            "load_average_end": load_average(),
        }
        log(f"{section}: {results['sections'][section]['_timing']['wall_s']} s")
    results["machine"]["load_average_end"] = load_average()
    results["wall_s"] = round(time.perf_counter() - start, 1)
    results["headline"] = headlines(results)
    if out is not None:
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
        "--out",
        type=Path,
        help="also write every figure as JSON here (the committed run: benchmarks/results/suite.json, which --report "
        "writes)",
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
    # The committed results change only when asked: with --out, or with --report, whose page quotes them.
    out = args.out or (RESULTS / "suite.json" if args.report else None)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    results = run_suite(name, sections, out, log)
    log(f"done in {results['wall_s']} s" + (f"; wrote {out}" if out else ""))
    print(json.dumps(results["headline"], indent=1))
    if args.report:
        for path in plot_all(results, FIGURES):
            log(f"wrote {path}")
        PAGE.write_text(fill(PAGE.read_text(), results))
        log(f"filled the tables of {PAGE}; its prose quotes numbers too: reread it")
