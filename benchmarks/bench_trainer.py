"""Framework overhead: `Trainer.fit` against the same hand-written loop on a tiny MLP.

Both run in this process, interleaved (raw, trainer, raw, trainer, ...) so machine drift cancels, on
one thread. The workload: batch 32, 32 features, 3000 steps, `self.log("loss", prog_bar=True)` every step,
a progress bar on. Steady-state time per step is taken after a warm-up of 200 steps: the mean (the whole
run's time over its steps, logging steps included: the figure the target is set on) and, beside it, the
median of single steps, which another process's burst of work on a shared machine moves far less (it leaves
out the logging steps, one in 50, in all three loops alike).

Two hand-written loops: `raw`, a tqdm bar and nothing else; and `raw_logging`, a user's default run written
by hand: the bar shows the loss and a TensorBoard `SummaryWriter` gets it every 50 steps (the Trainer's
`log_every_n_steps`), which is what the Trainer's defaults (TensorBoard logger, progress bar) do. The Trainer
is compared with both; the target is the ratio to `raw_logging`.

    python -m benchmarks trainer            # 5 repeats, results on stdout
    python -m benchmarks trainer --repeats 9 --steps 3000 --out benchmarks/results/trainer_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from syncline.callbacks import Callback
from syncline.trainer import Task, Trainer

from .workloads import MLPSteps
from .workloads import make_mlp as make_model
from .workloads import mlp_loader as make_loader

WARMUP = 200
LOG_EVERY_N_STEPS = 50


class MLPTask(MLPSteps, Task):
    """The MLP as a syncline Task."""


class SteadyStateTimer(Callback):
    """Record the time at the end of every step from the warm-up's last on, and at the end of training."""

    reads_parameters = False  # times and counts only: a step in flight stays in flight

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if batch_idx >= WARMUP - 1:
            self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer, task):
        self.end = time.perf_counter()


def _per_step(stamps: list[float], end: float) -> tuple[float, float]:
    """Return the mean seconds per step from the first stamp to `end`, and the median single step."""
    steps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    return (end - stamps[0]) / len(steps), statistics.median(steps)


def run_raw(steps: int) -> tuple[float, float]:
    """Return steady-state seconds per step of the hand-written loop (mean, median)."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = make_loader(steps)
    stamps = []
    for batch_idx, (x, y) in enumerate(tqdm(loader, file=sys.stderr)):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if batch_idx >= WARMUP - 1:
            stamps.append(time.perf_counter())
    return _per_step(stamps, time.perf_counter())


def run_raw_logging(steps: int, root: Path) -> tuple[float, float]:
    """Return steady-state seconds per step (mean, median) of the hand-written loop that logs as the Trainer's
    defaults do."""
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = make_loader(steps)
    writer = SummaryWriter(str(root / "raw_logging"))
    stamps = []
    with tqdm(loader, file=sys.stderr) as bar:
        for batch_idx, (x, y) in enumerate(bar):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (batch_idx + 1) % LOG_EVERY_N_STEPS == 0:
                value = loss.item()
                writer.add_scalar("loss", value, batch_idx)
                bar.set_postfix(loss=f"{value:.3g}", refresh=False)
            if batch_idx >= WARMUP - 1:
                stamps.append(time.perf_counter())
    result = _per_step(stamps, time.perf_counter())
    writer.close()
    return result


def run_trainer(steps: int, root: Path) -> tuple[float, float]:
    """Return steady-state seconds per step of `Trainer.fit` (mean, median)."""
    torch.manual_seed(0)
    timer = SteadyStateTimer()
    trainer = Trainer(
        max_epochs=1,
        callbacks=[timer],
        default_root_dir=root,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=LOG_EVERY_N_STEPS,
    )
    trainer.fit(MLPTask(), make_loader(steps))
    return _per_step(timer.stamps, timer.end)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON file")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    torch.set_num_threads(1)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "syncline-bench-trainer"
    times: dict[str, list[float]] = {"raw": [], "raw_logging": [], "trainer": []}
    single_steps: dict[str, list[float]] = {name: [] for name in times}
    for repeat in range(args.repeats + 1):  # the first round warms up caches and imports, and is dropped
        # Progress output goes to a buffer: every loop draws a bar, none pays for a terminal.
        with contextlib.redirect_stderr(io.StringIO()):
            raw = run_raw(args.steps)
            raw_logging = run_raw_logging(args.steps, root)
            ours = run_trainer(args.steps, root)
        if repeat:
            for name, (mean, median) in zip(times, (raw, raw_logging, ours)):
                times[name].append(mean)
                single_steps[name].append(median)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["trainer"] / medians["raw"]
    ratio_logging = medians["trainer"] / medians["raw_logging"]
    ratios = [t / r for t, r in zip(times["trainer"], times["raw_logging"])]
    step_medians = {name: statistics.median(values) for name, values in single_steps.items()}
    step_ratios = [t / r for t, r in zip(single_steps["trainer"], single_steps["raw_logging"])]
    print(f"{'loop':<13}{'median us/step':>16}{'min':>10}{'max':>10}")
    for name, values in times.items():
        print(f"{name:<13}{medians[name] * 1e6:>16.1f}{min(values) * 1e6:>10.1f}{max(values) * 1e6:>10.1f}")
    print(f"Trainer / raw loop: {ratio:.3f}")
    print(
        f"Trainer / raw loop with TensorBoard and the bar's loss: {ratio_logging:.3f} "
        f"(per-repeat ratios {min(ratios):.3f} .. {max(ratios):.3f})"
    )
    print(
        f"Median single step: raw {step_medians['raw'] * 1e6:.1f} us, raw_logging "
        f"{step_medians['raw_logging'] * 1e6:.1f} us, trainer {step_medians['trainer'] * 1e6:.1f} us; Trainer / "
        f"raw_logging {statistics.median(step_ratios):.3f} "
        f"(per-repeat {min(step_ratios):.3f} .. {max(step_ratios):.3f})"
    )
    result = {
        "benchmark": "trainer_overhead",
        "workload": {"batch": 32, "features": 32, "steps": args.steps, "warmup": WARMUP, "threads": 1},
        "machine": {
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "seconds_per_step": times,
        "median_seconds_per_step": medians,
        "single_step_median_seconds": single_steps,
        "ratio_single_step_trainer_over_raw_logging": statistics.median(step_ratios),
        "ratio_trainer_over_raw": ratio,
        "ratio_trainer_over_raw_logging": ratio_logging,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
