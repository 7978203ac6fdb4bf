"""Experiment 5: framework overhead. syncline's Trainer, the hand-written loop, and pytorch-lightning.

The workload is `bench_trainer.py`'s: an MLP 32-64-64-1, batch 32, Adam, the loss logged every step with
a progress bar (on both frameworks' default loggers), one thread. Each measurement is a fresh process
(`python -m benchmarks.overhead --loop NAME --steps N --out FILE`), so that the time from process start
to the end of the first optimizer step includes importing the framework, as a user sees it. Steady-state
time per step is measured in the same process after `warmup` steps. The parent runs the three loops
interleaved (raw, trainer, lightning, then rotated) so machine drift hits all alike.

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

from benchmarks.common import LAUNCHED_AT, run_child

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

    from benchmarks.workloads import make_mlp, mlp_loader

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

    from benchmarks.bench_trainer import MLPTask
    from benchmarks.workloads import mlp_loader
    from callbacks import Callback
    from trainer import Trainer

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
    from torch import nn

    from benchmarks.workloads import make_mlp, mlp_loader

    class MLPModule(pl.LightningModule):
        """bench_trainer.py's MLPTask, as a LightningModule."""

        def __init__(self) -> None:
            super().__init__()
            self.model = make_mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

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


# ---------------------------------------------------------------- parent
def run_overhead(steps: int, warmup: int, repeats: int, timeout: float) -> dict[str, Any]:
    """Run every loop `repeats` times, interleaved, each in a fresh process; summarize."""
    loops = [loop for loop in LOOPS if loop != "lightning" or lightning_available()]
    runs: dict[str, list[dict]] = {loop: [] for loop in loops}
    for repeat in range(repeats):
        shift = repeat % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            runs[loop].append(
                run_child(
                    "benchmarks.overhead", ["--loop", loop, "--steps", str(steps), "--warmup", str(warmup)], timeout
                )
            )
    result: dict[str, Any] = {
        "workload": "bench_trainer.py MLP 32-64-64-1, batch 32, Adam, loss logged every step, progress bar, 1 thread",
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "loops": {},
    }
    if "lightning" not in loops:
        result["lightning_skipped"] = "pytorch-lightning is not installed (pip install -e '.[bench]')"
    else:
        import pytorch_lightning

        result["lightning_version"] = pytorch_lightning.__version__
    for loop, items in runs.items():
        step = [r["step_s"] for r in items]
        first = [r["first_step_s"] for r in items]
        result["loops"][loop] = {
            "step_us": {
                "median": round(statistics.median(step) * 1e6, 2),
                "min": round(min(step) * 1e6, 2),
                "max": round(max(step) * 1e6, 2),
                "all": [round(s * 1e6, 2) for s in step],
            },
            "first_step_s": {
                "median": round(statistics.median(first), 3),
                "min": round(min(first), 3),
                "max": round(max(first), 3),
                "all": [round(s, 3) for s in first],
            },
        }
    raw = result["loops"]["raw"]
    for loop in loops[1:]:
        entry = result["loops"][loop]
        entry["step_ratio_over_raw"] = round(entry["step_us"]["median"] / raw["step_us"]["median"], 3)
        # Paired: the runs of one repeat ran back to back.
        paired = [a["step_s"] / b["step_s"] for a, b in zip(runs[loop], runs["raw"])]
        entry["paired_step_ratio"] = {"min": round(min(paired), 3), "max": round(max(paired), 3)}
        entry["first_step_extra_s"] = round(entry["first_step_s"]["median"] - raw["first_step_s"]["median"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="Time one training loop in this process; write JSON.")
    parser.add_argument("--loop", choices=LOOPS, required=True)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(_measure(args.loop, args.steps, args.warmup)))


if __name__ == "__main__":
    main()
