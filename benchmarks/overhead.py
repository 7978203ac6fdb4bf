"""Experiment 5: framework overhead. syncline's Trainer, the hand-written loop, and pytorch-lightning.

The workload is `bench_trainer.py`'s: an MLP 32-64-64-1, batch 32, Adam, the loss logged every step with
a progress bar (on both frameworks' default loggers), one thread. Two measurements:

- Fresh processes (`python -m benchmarks overhead --loop NAME ...`), the three loops interleaved (raw,
  trainer, lightning, then rotated): the time from process start to the end of the first optimizer step,
  which includes importing the framework, as a user sees it.
- One process (`--interleave raw,trainer,lightning --repeats R`) that runs the three loops R times in a
  rotated order: the steady time per step after `warmup` steps, and its ratio to the raw loop. Per-step
  speed on this VM differs from one process to the next by up to 1.8x, so only loops timed in the same
  process are compared.

pytorch-lightning is the optional `bench` extra (`pip install -e ".[bench]"`); without it the Lightning
loop is reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import LAUNCHED_AT, run_child

__all__ = ["LOOPS", "lightning_available", "run_overhead"]

LOOPS = ("raw", "trainer", "lightning")


def lightning_available() -> bool:
    """Whether pytorch-lightning (the `bench` extra) is installed."""
    return importlib.util.find_spec("pytorch_lightning") is not None


class _Clock:
    """The wall time of the first step's end, and the perf counter at the end of warm-up and of the run."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.first_step_wall = 0.0
        self.start = 0.0
        self.end = 0.0

    def batch_end(self, batch_idx: int) -> None:
        if batch_idx == 0:
            self.first_step_wall = time.time()
        if batch_idx == self.warmup - 1:
            self.start = time.perf_counter()

    def train_end(self) -> None:
        self.end = time.perf_counter()


# ------------------------------------------------------------------ loops
def _raw(steps: int, clock: _Clock, root: Path) -> None:
    import torch
    from torch import nn
    from tqdm import tqdm

    from .workloads import make_mlp, mlp_loader

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for batch_idx, (x, y) in enumerate(tqdm(mlp_loader(steps), file=sys.stderr)):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.batch_end(batch_idx)
    clock.train_end()


def _trainer(steps: int, clock: _Clock, root: Path) -> None:
    import torch

    from syncline.callbacks import Callback
    from syncline.trainer import Trainer

    from .bench_trainer import MLPTask
    from .workloads import mlp_loader

    class Timer(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            clock.batch_end(batch_idx)

        def on_train_end(self, trainer, task):
            clock.train_end()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = Trainer(
        max_epochs=1,
        callbacks=[Timer()],
        default_root_dir=root,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
    )
    trainer.fit(MLPTask(), mlp_loader(steps))


def _lightning(steps: int, clock: _Clock, root: Path) -> None:
    import pytorch_lightning as pl
    import torch

    from .workloads import MLPSteps, mlp_loader

    class MLPModule(MLPSteps, pl.LightningModule):
        """bench_trainer.py's MLPTask, as a LightningModule."""

    class Timer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.batch_end(batch_idx)

        def on_train_end(self, trainer, pl_module):
            clock.train_end()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        callbacks=[Timer()],
        default_root_dir=root,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
    )
    trainer.fit(MLPModule(), mlp_loader(steps))


def _measure(loop: str, steps: int, warmup: int) -> dict[str, Any]:
    """Run `loop` once in this process; return its steady time per step and its time from launch to step 1."""
    clock = _Clock(warmup)
    run = {"raw": _raw, "trainer": _trainer, "lightning": _lightning}[loop]
    # Every loop draws a progress bar; none pays for a terminal.
    with (
        tempfile.TemporaryDirectory(prefix="syncline-overhead-") as root,
        open(os.devnull, "w") as devnull,
        contextlib.redirect_stdout(devnull),
        contextlib.redirect_stderr(devnull),
    ):
        run(steps, clock, Path(root))
    launched = float(os.environ.get(LAUNCHED_AT, "nan"))
    return {
        "loop": loop,
        "steps": steps,
        "warmup": warmup,
        "step_s": (clock.end - clock.start) / (steps - warmup),
        "first_step_s": clock.first_step_wall - launched,
    }


def _interleave(loops: list[str], steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Run every loop `repeats` times in this process, in an order rotated each round; the first round is dropped.

    One process for all loops: this VM puts each new process in a faster or a slower regime for its whole
    life (the same raw loop had medians of 569-1015 us in six fresh processes), which would otherwise be
    compared along with the loops. The dropped round pays for imports and first allocations.
    """
    step_s: dict[str, list[float]] = {loop: [] for loop in loops}
    for repeat in range(repeats + 1):
        shift = repeat % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            measured = _measure(loop, steps, warmup)["step_s"]
            if repeat:
                step_s[loop].append(measured)
    return {"steps": steps, "warmup": warmup, "repeats": repeats, "step_s": step_s}


# ---------------------------------------------------------------- parent
def _spread(values: list[float], scale: float, digits: int) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values) * scale, digits),
        "min": round(min(values) * scale, digits),
        "max": round(max(values) * scale, digits),
        "all": [round(v * scale, digits) for v in values],
    }


def run_overhead(
    steps: int, warmup: int, repeats: int, timeout: float, inprocess_steps: int, inprocess_repeats: int
) -> dict[str, Any]:
    """Measure every loop in fresh processes (`repeats` each, interleaved) and in one process; summarize.

    The fresh processes give the time from process start to the first step, as a user meets it; the
    steady time per step, and the ratios to the raw loop, come from the single process that runs the loops
    `inprocess_repeats` times, interleaved. The fresh processes' steady times are kept beside them.
    """
    loops = [loop for loop in LOOPS if loop != "lightning" or lightning_available()]
    fresh: dict[str, list[dict]] = {loop: [] for loop in loops}
    for repeat in range(repeats):
        shift = repeat % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            fresh[loop].append(
                run_child("overhead", ["--loop", loop, "--steps", str(steps), "--warmup", str(warmup)], timeout)
            )
    inprocess = run_child(
        "overhead",
        ["--interleave", ",".join(loops), "--steps", str(inprocess_steps), "--warmup", str(warmup)]
        + ["--repeats", str(inprocess_repeats)],
        timeout,
    )["step_s"]
    result: dict[str, Any] = {
        "workload": "bench_trainer.py MLP 32-64-64-1, batch 32, Adam, loss logged every step, progress bar, 1 thread",
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "inprocess_steps": inprocess_steps,
        "inprocess_repeats": inprocess_repeats,
        "loops": {},
    }
    if "lightning" not in loops:
        result["lightning_skipped"] = "pytorch-lightning is not installed (pip install -e '.[bench]')"
    else:
        import pytorch_lightning

        result["lightning_version"] = pytorch_lightning.__version__
    for loop in loops:
        result["loops"][loop] = {
            "step_us": _spread(inprocess[loop], 1e6, 2),
            "fresh_process_step_us": _spread([r["step_s"] for r in fresh[loop]], 1e6, 2),
            "first_step_s": _spread([r["first_step_s"] for r in fresh[loop]], 1.0, 3),
        }
    raw = result["loops"]["raw"]
    for loop in loops[1:]:
        entry = result["loops"][loop]
        entry["step_ratio_over_raw"] = round(entry["step_us"]["median"] / raw["step_us"]["median"], 3)
        # Paired: the runs of one round ran back to back in the same process.
        paired = [a / b for a, b in zip(inprocess[loop], inprocess["raw"])]
        entry["paired_step_ratio"] = {
            "median": round(statistics.median(paired), 3),
            "min": round(min(paired), 3),
            "max": round(max(paired), 3),
        }
        entry["fresh_process_step_ratio_over_raw"] = round(
            entry["fresh_process_step_us"]["median"] / raw["fresh_process_step_us"]["median"], 3
        )
        entry["first_step_extra_s"] = round(entry["first_step_s"]["median"] - raw["first_step_s"]["median"], 3)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--loop", choices=LOOPS, help="run this loop once")
    what.add_argument("--interleave", help="comma-separated loops to run --repeats times each, interleaved")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    if args.loop:
        result = _measure(args.loop, args.steps, args.warmup)
    else:
        result = _interleave(args.interleave.split(","), args.steps, args.warmup, args.repeats)
    args.out.write_text(json.dumps(result))
