"""Experiments 4 (loss curves) and 6 (strategy comparison): the default example, CharGPT, through the Trainer.

Each run is a fresh process (`python -m benchmarks example-run --config JSON --out FILE`), started by
`run_example` with a timeout. Inside it the Trainer trains `examples/char_gpt.py`'s CharGPT for one epoch
of a fixed number of micro-batches, with the strategy, world size and accumulation of the config, then
validates once. A callback on rank 0 records when each micro-batch ended and its loss; the Trainer sends
rank 0's callback state back to the launching process, as it does for every callback.

- Skip-sync curves: BucketedDDP on two ranks, synchronizing every k micro-batches
  (`accumulate_grad_batches=k`), the same micro-batches for every k; warm-up covers the same number of
  samples (`warmup_steps // k` optimizer steps), so the runs differ only in how often they synchronize.
- Strategy comparison: single (one process), bucketed_ddp and native_ddp (two processes), one thread per
  process, the same global batch and the same number of steps, so the losses are comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from syncline.callbacks import Callback

from .common import LAUNCHED_AT, QUIET_TRAINER, add_child_arguments, run_child, run_child_command, summary

__all__ = ["BatchRecorder", "run_example"]


class BatchRecorder(Callback):
    """Record, on rank 0, the time and loss of every training micro-batch and the epoch's start."""

    reads_parameters = False  # times and counts only: a step in flight stays in flight

    def __init__(self) -> None:
        self.start = 0.0
        self.ends: list[float] = []
        self.losses: list[float] = []

    def on_train_epoch_start(self, trainer, task):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))  # host sync: a CPU scalar, once per micro-batch

    def state_dict(self):
        return {"start": self.start, "ends": self.ends, "losses": self.losses}

    def load_state_dict(self, state_dict):
        self.start, self.ends, self.losses = state_dict["start"], state_dict["ends"], state_dict["losses"]


def _train(config: dict[str, Any]) -> dict[str, Any]:
    """Train CharGPT as `config` says; return timings, the loss curve and the final validation metrics."""
    from syncline.examples.char_gpt import CharGPT
    from syncline.strategies.bucketed_ddp import BucketedDDP
    from syncline.strategies.native_ddp import NativeDDP
    from syncline.trainer import Trainer
    from syncline.trainer.seed import seed_everything

    devices, k = config["devices"], config["accumulate"]
    if devices == 1:
        torch.set_num_threads(config["threads"])
        strategy: Any = "single"
    else:
        # The launcher gives each of the `devices` workers cores // devices threads (one here).
        strategy = {"bucketed_ddp": BucketedDDP, "native_ddp": NativeDDP}[config["strategy"]](
            backend="gloo", timeout=config["timeout"]
        )
    model = dict(config["model"])
    model["warmup_steps"] = max(1, model["warmup_steps"] // k)
    seed_everything(0)
    task = CharGPT(**model)
    recorder = BatchRecorder()
    trainer = Trainer(
        max_epochs=1,
        limit_train_batches=config["microbatches"],
        limit_val_batches=config["val_batches"],
        accumulate_grad_batches=k,
        strategy=strategy,
        devices=devices,
        callbacks=[recorder],
        **QUIET_TRAINER,
        seed=0,
    )
    start = time.perf_counter()
    trainer.fit(task)
    fit_s = time.perf_counter() - start
    if len(recorder.losses) != config["microbatches"]:
        raise RuntimeError(
            f"The epoch had {len(recorder.losses)} micro-batches per rank, not {config['microbatches']}: "
            "raise max_chars or lower microbatches."
        )
    step_s = [b - a for a, b in zip([recorder.start, *recorder.ends[:-1]], recorder.ends)]
    return {
        "config": config,
        "parameters": sum(p.numel() for p in task.parameters()),
        "fit_s": round(fit_s, 3),
        "epoch_s": round(recorder.ends[-1] - recorder.start, 4),
        # The first micro-batch carries one-time costs (lazy imports, first allocations, torch's bucket
        # rebuild); the steady epoch is the other micro-batches' time scaled to the whole epoch.
        "first_microbatch_s": round(step_s[0], 4),
        "steady_epoch_s": round((recorder.ends[-1] - recorder.ends[0]) * len(step_s) / max(1, len(step_s) - 1), 4),
        "microbatch": summary(step_s[1:] or step_s),
        "losses": [round(x, 4) for x in recorder.losses],
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_ppl": float(trainer.callback_metrics["val_ppl"]),
        "process_s": round(time.time() - float(os.environ.get(LAUNCHED_AT, time.time())), 3),
    }


def run_example(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one CharGPT training in a fresh process; return what `_train` measured."""
    return run_child("example-run", ["--config", json.dumps(config)], timeout)


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over repeats of one configuration's epoch time and validation loss."""

    def spread(key: str) -> dict[str, Any]:
        values = [r[key] for r in runs]
        return {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
            "all": values,
        }

    return {
        "epoch_s": spread("epoch_s"),
        "steady_epoch_s": spread("steady_epoch_s"),
        "first_microbatch_s": spread("first_microbatch_s"),
        "microbatch_median_ms": round(statistics.median(r["microbatch"]["median_ms"] for r in runs), 3),
        "val_loss": {"median": round(statistics.median(r["val_loss"] for r in runs), 4)},
        "val_loss_all": [round(r["val_loss"], 4) for r in runs],
        "process_s_median": round(statistics.median(r["process_s"] for r in runs), 3),
        "losses": runs[0]["losses"],
        "parameters": runs[0]["parameters"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The child's options: ``--config JSON --out FILE``."""
    add_child_arguments(parser)


def command(args: argparse.Namespace) -> None:
    """Train CharGPT once and write what was measured as JSON (a child of the suite)."""
    run_child_command(_train, args)
