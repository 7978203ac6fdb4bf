"""`EquivalenceCheck`: prove that the first steps of a distributed run equal one process on the global batch.

A data-parallel strategy is exact when k processes, each on its shard of a batch, end every optimizer step
with the parameters one process reaches on the whole (global) batch. This callback records the global
batches of the first `steps` optimizer steps (every rank's micro-batch, gathered), trains a copy of the
task's initial state on them in this process with the same accumulation, clipping and precision, and
reports the largest parameter difference. Use it before a long run to prove a new strategy, task or data
pipeline exact; what it reports is what differs: per-rank BatchNorm statistics, dropout masks drawn per
rank, compressed communication.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.callbacks.callback import Callback
from syncline.rank_zero import rank_zero_info
from syncline.rng import isolated_rng

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["EquivalenceCheck", "EquivalenceError"]


class EquivalenceError(RuntimeError):
    """The distributed run moved away from one process on the global batch by more than the tolerance."""


class EquivalenceCheck(Callback):
    """Compare the first `steps` optimizer steps with single-process training on the global batch.

    The result is printed by rank 0 and stored as ``trainer.callback_metrics["equivalence/max_abs_diff"]``
    on every rank, and in `max_abs_diff` / `worst_parameter`.

    Args:
        steps: optimizer steps to compare (within the first epoch: the check ends at its end otherwise).
        tolerance: the largest absolute parameter difference still called equal.
        strict: raise `EquivalenceError` on every rank when the difference exceeds `tolerance`
            (otherwise only report it).
    """

    def __init__(self, steps: int = 3, tolerance: float = 1e-5, strict: bool = False) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"EquivalenceCheck steps must be an int >= 1, got {steps!r}.")
        if not tolerance >= 0:
            raise ValueError(f"EquivalenceCheck tolerance must be >= 0, got {tolerance!r}.")
        self.steps = steps
        self.tolerance = float(tolerance)
        self.strict = strict
        self.max_abs_diff: float | None = None
        self.worst_parameter: str | None = None
        self._reference: Task | None = None
        self._batches: list[Any] = []
        self._active = False

    def setup(self, trainer: Trainer, task: Task, stage: str) -> None:
        """Copy the task as it is before training (and before the strategy touches it): the reference."""
        if stage != "fit":
            return
        self._active, self._batches = True, []
        if trainer.is_global_zero:
            attached, task._trainer = task._trainer, None
            try:
                self._reference = copy.deepcopy(task)
            finally:
                task._trainer = attached

    def on_train_start(self, trainer: Trainer, task: Task) -> None:
        """A resumed run has no initial state to compare from: say so and stay out of the way."""
        if trainer.global_step > 0 and self._active:
            rank_zero_info("EquivalenceCheck: resumed at a later step, nothing to compare; skipped.")
            self._finish()

    def on_train_batch_start(self, trainer: Trainer, task: Task, batch: Any, batch_idx: int) -> None:
        """Record this micro-batch of every rank, joined into the global micro-batch."""
        if not self._active:
            return
        # Collective: every rank's micro-batch, so rank 0 can train on their union.
        shards = trainer.strategy.all_gather_object(_to_cpu(batch))
        if trainer.is_global_zero:
            self._batches.append(_concat(shards))

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the `steps`-th optimizer step, train the reference and compare."""
        if self._active and trainer.global_step >= self.steps:
            self._compare(trainer, task)

    def on_train_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """An epoch shorter than `steps`: compare what there is."""
        if self._active and trainer.global_step > 0:
            self._compare(trainer, task)

    # ---------------------------------------------------------------- helpers
    def _compare(self, trainer: Trainer, task: Task) -> None:
        result: tuple[float, str] | None = None
        if trainer.is_global_zero:
            reference = self._train_reference(trainer, trainer.global_step)
            expected = dict(reference.named_parameters())
            worst, name = 0.0, ""
            for param_name, param in task.named_parameters():
                diff = (param.detach() - expected[param_name].detach().to(param.device)).abs().max().item()
                if diff > worst or not name:
                    worst, name = diff, param_name
            result = (worst, name)
        # Collective: every rank learns the verdict, so a strict failure ends every rank alike.
        self.max_abs_diff, self.worst_parameter = trainer.strategy.broadcast_object(result)
        trainer.callback_metrics["equivalence/max_abs_diff"] = torch.tensor(self.max_abs_diff)
        steps = trainer.global_step
        verdict = "equal" if self.max_abs_diff <= self.tolerance else "NOT equal"
        message = (
            f"EquivalenceCheck: after {steps} optimizer step(s), {trainer.strategy.name or 'the strategy'} on "
            f"{trainer.world_size} process(es) and one process on the global batch are {verdict}: largest "
            f"parameter difference {self.max_abs_diff:.3g} ({self.worst_parameter}), tolerance {self.tolerance:g}."
        )
        rank_zero_info(message)
        self._finish()
        if self.strict and self.max_abs_diff > self.tolerance:
            raise EquivalenceError(message)

    def _train_reference(self, trainer: Trainer, steps: int) -> Task:
        """Train the copied task on the recorded global micro-batches, in this process only."""
        from syncline.strategies.single_device import SingleDevice

        assert self._reference is not None
        # The running Trainer's own class: a callback never imports the trainer.
        reference = type(trainer)(
            max_steps=steps,
            strategy=SingleDevice(trainer.strategy.root_device),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            precision=trainer.precision_name,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            use_distributed_sampler=False,
        )
        # The reference draws no numbers from the training run's random streams.
        with isolated_rng():
            reference.fit(self._reference, train_dataloaders=self._batches)
        return self._reference

    def _finish(self) -> None:
        self._active, self._batches, self._reference = False, [], None


def _to_cpu(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch.detach().cpu()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_cpu(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_cpu(v) for k, v in batch.items()}
    return batch


def _concat(shards: list[Any]) -> Any:
    """Join the ranks' micro-batches along the first dimension, keeping the batch's structure."""
    first = shards[0]
    if isinstance(first, Tensor):
        return torch.cat(shards)
    if isinstance(first, (list, tuple)):
        return type(first)(_concat(list(parts)) for parts in zip(*shards))
    if isinstance(first, dict):
        return {k: _concat([s[k] for s in shards]) for k in first}
    return first
