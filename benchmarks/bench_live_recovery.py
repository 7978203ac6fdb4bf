"""Seconds one worker's death costs: `recovery="live"` against `recovery="checkpoint"` (restart from last.ckpt).

Each repeat runs four fits of a paced task (every step sleeps `--step-s`, so the figures are about the
recovery, not the model) on `--devices` local workers: for each recovery mode, one clean fit and one in
which the worker with rank 1 SIGKILLs itself at step `--kill-at`. The checkpoint mode saves ``last.ckpt``
every `--checkpoint-every` steps and restarts every worker once (`max_restarts=1`), resuming from it; the
live mode keeps the survivors training and admits one replacement. Seconds lost = wall time of the fit
with the death minus that of the clean fit of the same mode, run back to back; medians over `--repeats`.

Where torchft imports (`pip install 'syncline[ft]'`), a third mode runs the same workload and death on torchft's
fault-tolerant DDP (`benchmarks/ft_reference.py`): a reference for what its lighthouse and per-step quorum lose;
elsewhere the script says in one line that it skipped it.

    python -m benchmarks live-recovery [--devices 3] [--batches 30] [--step-s 0.1] [--kill-at 12]
                                       [--checkpoint-every 10] [--repeats 3] [--ft-heartbeat-timeout-ms 5000]
                                       [--out f.json]

On the lab's nodes (one launcher per node, torchrun) the same comparison needs the multi-node launch path,
which live recovery does not have yet; this script measures one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncline.trainer import Task

from .common import machine

__all__ = ["add_arguments", "command"]


class PacedTask(Task):
    """A small MLP whose every step sleeps `step_s`; rank 1 SIGKILLs itself once, at step `kill_at`."""

    def __init__(self, batches: int, devices: int, step_s: float, kill_at: int, marker_dir: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.samples = batches * devices * 4
        self.step_s, self.kill_at, self.marker_dir = step_s, kill_at, marker_dir

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 8, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        marker = Path(self.marker_dir, "killed")
        if self.kill_at >= 0 and self.global_rank == 1 and self.global_step == self.kill_at and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.step_s)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(args: argparse.Namespace, recovery: str, kill: bool) -> float:
    """Wall seconds of one fit (the launch included)."""
    from syncline.callbacks import ModelCheckpoint
    from syncline.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="syncline-bench-live-") as root:
        task = PacedTask(args.batches, args.devices, args.step_s, args.kill_at if kill else -1, root)
        callbacks = []
        if recovery == "checkpoint":
            callbacks = [ModelCheckpoint(every_n_train_steps=args.checkpoint_every, save_last=True, save_top_k=0)]
        trainer = Trainer(
            max_epochs=1,
            devices=args.devices,
            accelerator="cpu",
            recovery=recovery,
            max_restarts=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=recovery == "checkpoint",
            callbacks=callbacks,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )
        start = time.perf_counter()
        trainer.fit(task)
        return time.perf_counter() - start


def _torchft_fit(args: argparse.Namespace, kill: bool) -> dict[str, Any]:
    """One fit of the same workload on torchft's fault-tolerant DDP (`benchmarks/ft_reference.py`)."""
    from .ft_reference import fit

    kill_at = args.kill_at if kill else -1
    return fit(args.devices, args.batches, args.step_s, kill_at, heartbeat_timeout_ms=args.ft_heartbeat_timeout_ms)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--batches", type=int, default=30, help="batches per worker in the epoch")
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ft-heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="torchft's lighthouse: how long a silent replica counts as alive (torchft's default: 5000)",
    )
    parser.add_argument("--out", default=None)


def command(args: argparse.Namespace) -> None:
    """Run the fits (interleaved by mode, so both see the same load) and print (or write) the JSON."""
    from . import ft_reference

    modes = ["live", "checkpoint"]
    skipped = ft_reference.missing()
    if skipped:
        print(skipped)
    else:
        modes.append("torchft")
    lost: dict[str, list[float]] = {mode: [] for mode in modes}
    clean: dict[str, list[float]] = {mode: [] for mode in modes}
    torchft_runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for mode in modes:
            if mode == "torchft":
                fits = [_torchft_fit(args, kill) for kill in (False, True)]
                torchft_runs.append({"clean": fits[0], "killed": fits[1]})
                undisturbed, killed = fits[0]["wall_s"], fits[1]["wall_s"]
            else:
                undisturbed, killed = _fit(args, mode, kill=False), _fit(args, mode, kill=True)
            clean[mode].append(undisturbed)
            lost[mode].append(killed - undisturbed)
    report = {
        "machine": machine(),
        "devices": args.devices,
        "batches_per_worker": args.batches,
        "step_s": args.step_s,
        "kill_at_step": args.kill_at,
        "checkpoint_every": args.checkpoint_every,
        "repeats": args.repeats,
        "median_clean_fit_s": {mode: round(statistics.median(v), 2) for mode, v in clean.items()},
        "median_seconds_lost_per_failure": {mode: round(statistics.median(v), 2) for mode, v in lost.items()},
        "seconds_lost_per_failure": {mode: [round(x, 2) for x in v] for mode, v in lost.items()},
    }
    if torchft_runs:
        # Training seconds alone (first committed step to last), which leave out the replicas' imports and exits.
        train_lost = [run["killed"]["train_s"] - run["clean"]["train_s"] for run in torchft_runs]
        report["torchft"] = {
            "heartbeat_timeout_ms": args.ft_heartbeat_timeout_ms,
            "median_train_seconds_lost_per_failure": round(statistics.median(train_lost), 2),
            "replacement_start_to_train_s": [run["killed"]["replacement_start_to_train_s"] for run in torchft_runs],
            "replicas_agree": all(run[fit]["replicas_agree"] for run in torchft_runs for fit in run),
        }
    else:
        report["torchft"] = skipped
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
