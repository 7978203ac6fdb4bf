"""One run of the GPT-2 study: CharGPT through the Trainer with one strategy and precision, in a fresh process.

`python -m benchmarks gpt2-train --config JSON --out FILE`, started by `benchmarks.gpt2_study` with a
timeout. The Trainer trains `examples/char_gpt.py`'s CharGPT for `steps` optimizer steps of one global
batch (all of it in one process for `single`, split over two ranks otherwise), validating every
`val_every` steps on the first `val_batches` batches of the validation text (the same windows whatever
the world size). Two callbacks measure:

- `StepRecorder` (`syncline.lab.step_recorder`, rank 0): when each step ended, how long each validation took
  (so that steps can be timed without them) and each validation loss, and the strategy's `communication_stats()`
  after every step (`comm/bytes` of the last one is reported).
- `MemoryProbe` (every rank): the largest bytes (`numel * element_size`, each tensor once) of the
  parameters' gradients after any backward, and of the parameters and the optimizer's state tensors at
  the end of any optimizer step (before gradients are reset); their sum is the peak the three reach
  together during a step. At the end of training, the process's peak RSS (`resource.getrusage`). The
  ranks' figures are all-gathered to rank 0 once, after the last step. Communication buffers outside
  `.grad` (torch DDP's bucket copies, fusion buffers) are in the RSS only.

The Trainer hands rank 0's callback state back to this process, which writes it as JSON.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
from torch import Tensor

from syncline.callbacks import Callback
from syncline.lab.step_recorder import StepRecorder, step_times

from .common import QUIET_TRAINER, add_child_arguments, run_child_command

__all__ = ["MemoryProbe", "tensor_bytes"]


def tensor_bytes(tensors: list[Tensor]) -> int:
    """Bytes of `tensors`, counting a tensor that appears twice once."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


class MemoryProbe(Callback):
    """Record each rank's largest parameter, gradient and optimizer-state bytes, and its peak RSS."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {"params": 0, "grads": 0, "optimizer_state": 0, "total": 0}
        self.ranks: list[dict[str, Any]] = []

    def on_after_backward(self, trainer, task):
        # Gradients are counted after the backward: a parameter server's workers drop their `.grad`
        # before the optimizer step (their gradient buckets stay allocated in the reducer).
        grads = tensor_bytes([p.grad for p in task.parameters() if p.grad is not None])
        self.peak["grads"] = max(self.peak["grads"], grads)

    def on_before_zero_grad(self, trainer, task, optimizer):
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        self.peak["params"] = max(self.peak["params"], tensor_bytes(list(task.parameters())))
        self.peak["optimizer_state"] = max(self.peak["optimizer_state"], tensor_bytes(state))
        self.peak["total"] = self.peak["params"] + self.peak["grads"] + self.peak["optimizer_state"]

    def on_train_end(self, trainer, task):
        # ru_maxrss is in KiB on Linux.
        mine = {**self.peak, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        # Collective (object all-gather on the default group), once per run: every rank's figures to rank 0.
        self.ranks = trainer.strategy.all_gather_object(mine) if trainer.world_size > 1 else [mine]

    def state_dict(self):
        return {"ranks": self.ranks}

    def load_state_dict(self, state_dict):
        self.ranks = state_dict["ranks"]


def _strategy(name: str, devices: int, timeout: float) -> Any:
    from syncline.strategies.registry import STRATEGIES

    if devices == 1:
        return name
    return STRATEGIES[name](backend="gloo", timeout=timeout)


def train(config: dict[str, Any]) -> dict[str, Any]:
    """Train CharGPT as `config` says; return step times, validations, memory per rank and bytes per step."""
    from syncline.examples.char_gpt import CharGPT
    from syncline.trainer import Trainer
    from syncline.trainer.seed import seed_everything

    devices = config["devices"]
    if devices == 1:
        # The launcher gives each of two ranks one thread; the single process gets the same one core.
        torch.set_num_threads(config["threads"])
    seed_everything(0)
    task = CharGPT(**{**config["model"], "batch_size": config["global_batch"] // devices})
    recorder, memory = StepRecorder(), MemoryProbe()
    trainer = Trainer(
        max_steps=config["steps"],
        val_check_interval=config["val_every"],
        limit_val_batches=config["val_batches"],
        strategy=_strategy(config["strategy"], devices, config["timeout"]),
        devices=devices,
        precision=config["precision"],
        callbacks=[recorder, memory],
        **QUIET_TRAINER,
        seed=0,
    )
    start = time.perf_counter()
    trainer.fit(task)
    fit_s = time.perf_counter() - start
    if len(recorder.step_ends) != config["steps"]:
        raise RuntimeError(f"Trained {len(recorder.step_ends)} steps, not {config['steps']}: raise max_chars.")
    return {
        "config": config,
        "parameters": sum(p.numel() for p in task.parameters()),
        "fit_s": round(fit_s, 3),
        **step_times(recorder.start, recorder.step_ends, recorder.validations),
        "validations": [{"step": s, "val_s": round(t, 3), "val_loss": round(v, 4)} for s, t, v in recorder.validations],
        "comm_bytes_per_step": recorder.comm.get("comm/bytes", 0.0),
        "comm_total_bytes": recorder.comm.get("comm/total_bytes", 0.0),
        "memory_per_rank": memory.ranks,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The child's options: ``--config JSON --out FILE``."""
    add_child_arguments(parser)


def command(args: argparse.Namespace) -> None:
    """Train CharGPT once for the GPT-2 study; write what was measured (a child of the study)."""
    run_child_command(train, args)
