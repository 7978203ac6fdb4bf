"""The training loop: epochs of micro-batches, accumulation windows, optimizer steps, validation."""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.callbacks.callback import Callback
from syncline.strategies.comm.join import Joinable
from syncline.trainer.data import epoch_batches
from syncline.trainer.nonfinite import NonfiniteLossGuard
from syncline.trainer.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from syncline.trainer.state import capture_rng, restore_rng
from syncline.trainer.uneven import JOINED, agreed_batches, needs_agreement

if TYPE_CHECKING:
    from syncline.trainer.trainer import Trainer

__all__ = ["FitLoop"]


class FitLoop:
    """Run `Trainer.fit`'s epochs. Holds nothing that the trainer's state does not already say."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.state = trainer.state
        self.task = trainer.task
        self.strategy = trainer.strategy
        self.precision = trainer.precision
        self.fire = trainer.dispatcher.fire
        self.accumulate = trainer.accumulate_grad_batches
        if trainer.optim is None:
            raise RuntimeError("FitLoop needs the task's optimizers: call configure_optimizers first.")
        self.optim = trainer.optim
        self.parameters = [p for p in self.task.parameters() if p.requires_grad]
        self.nonfinite = NonfiniteLossGuard(trainer.nonfinite_loss, self.strategy)
        #: RNG state of the checkpoint being resumed, applied at the point in the loop it was taken.
        self.resume_rng: dict[str, Any] | None = None

    # ------------------------------------------------------------------ epochs
    def run(self) -> None:
        """Train until max_epochs, max_steps or a stop request."""
        state = self.state
        if state.epoch_finished:
            state.start_epoch()
        self.fire(Callback.on_train_start)
        if state.batches_done:
            # Resumed from a checkpoint taken after the epoch's last batch (at its final validation or
            # its epoch-end hooks): do what was still ahead of it, and nothing it had already done.
            self.task.train()
            self._apply_resume_rng()
            self.end_epoch()
            if not self._done():
                state.start_epoch()
        while not self._done():
            self.run_epoch()
            if self._done():
                break
            state.start_epoch()
        self.trainer.preemption.finish()
        self.fire(Callback.on_train_end)

    def _done(self) -> bool:
        trainer, state = self.trainer, self.state
        if state.should_stop:
            return True
        if trainer.max_steps != -1 and state.global_step >= trainer.max_steps:
            return True
        return trainer.max_epochs is not None and state.current_epoch >= trainer.max_epochs

    def run_epoch(self) -> None:
        """Run one training epoch, its validations and its end-of-epoch events."""
        trainer, state, task = self.trainer, self.state, self.task
        task.train()
        self.fire(Callback.on_train_epoch_start)
        num_batches = trainer.num_training_batches
        exhausted = True
        for batch_idx, batch, is_last in self._batches(num_batches):
            stepped = self.run_batch(batch, batch_idx, is_last)
            if not is_last and trainer.validation_due(batch_idx, is_last=False):
                self.validate_after(batch_idx)
            exhausted = is_last
            if stepped:
                self.stop_if_preempted()
            if state.should_stop or (trainer.max_steps != -1 and state.global_step >= trainer.max_steps):
                break
        # An epoch cut short by max_steps is not finished: it gets its final validation but no epoch-end
        # events, and a resume with a larger max_steps continues it with its remaining batches, as an
        # uninterrupted run would. A stop request (early stopping) ends the epoch.
        # The epoch's last step is logged whatever log_every_n_steps says, and under this epoch's number.
        trainer.flush_step_logs(force=True)
        if exhausted or state.should_stop:
            state.batches_done = True
            self.end_epoch()
        elif state.batch_idx - 1 != state.validated_after and trainer.validation_due(state.batch_idx - 1, is_last=True):
            # Not twice: max_steps can end the epoch right after a validation within it.
            self.validate_after(state.batch_idx - 1)

    def end_epoch(self) -> None:
        """Finish an epoch whose batches are done: final validation, epoch-end hooks, epoch schedulers.

        Each part is marked done in the state before its hooks run, so a checkpoint saved from those hooks
        resumes after it; the parts still ahead of a checkpoint run when it is resumed.
        """
        trainer, state = self.trainer, self.state
        last = state.batch_idx - 1
        if last != state.validated_after and trainer.validation_due(last, is_last=True):
            self.validate_after(last)
        if not state.epoch_hooks_done:
            self.fire_epoch_end()
        self.optim_step_schedulers("epoch", state.current_epoch + 1)
        state.epoch_finished = True

    def validate_after(self, batch_idx: int) -> None:
        """Validate after training batch `batch_idx`; a checkpoint saved by validation's hooks says so."""
        self.state.validated_after = batch_idx
        self.trainer.run_validation()

    def fire_epoch_end(self) -> None:
        """Let the task log, resolve the epoch's aggregates, then let the callbacks see them."""
        trainer = self.trainer
        trainer.dispatcher.fire_task(Callback.on_train_epoch_end)
        trainer.log_metrics(trainer.results.epoch_end())
        # Marked before the callbacks run: ModelCheckpoint saves last, once every other callback has seen
        # the epoch's end, so a resume from its checkpoint must not fire these hooks again.
        self.state.epoch_hooks_done = True
        trainer.dispatcher.fire_callbacks(Callback.on_train_epoch_end)

    def optim_step_schedulers(self, interval: str, count: int) -> None:
        """Step the schedulers due at this step or epoch."""
        self.optim.step_schedulers(interval, count, self.trainer.callback_metrics)

    def _batches(self, num_batches: int | float) -> Iterator[tuple[int, Any, bool]]:
        """Return (batch_idx, batch, is_last) for this epoch, replaying the data order on a resume."""
        state, loader = self.state, self.trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(state.current_epoch)
        skip = state.batch_idx
        if skip:
            # Resume mid-epoch: recreate the iterator from the RNG it was first made with and drop the
            # batches already trained on; the RNG of the checkpoint's moment is applied after that.
            restore_rng(state.epoch_start_rng)
        else:
            self._apply_resume_rng()
            state.epoch_start_rng = capture_rng()
        batches = epoch_batches(loader, num_batches, skip)
        if num_batches == math.inf:
            flagged = _flag_last(batches, start=skip)
        else:
            last = int(num_batches) - 1
            flagged = ((i, batch, i == last) for i, batch in enumerate(batches, start=skip))
        self._apply_resume_rng()
        if needs_agreement(loader, self.strategy, self.trainer.uneven_inputs):
            join = self.trainer.uneven_inputs == "join"
            return agreed_batches(flagged, self.strategy, state.current_epoch, join=join)
        return flagged

    def _apply_resume_rng(self) -> None:
        if self.resume_rng is not None:
            restore_rng(self.resume_rng)
            self.resume_rng = None

    # ----------------------------------------------------------------- batches
    def run_batch(self, batch: Any, batch_idx: int, is_last: bool) -> bool:
        """Forward, backward (synchronized at the end of an accumulation window), and maybe a step.

        Returns:
            Whether an optimizer step was taken.
        """
        trainer, task, strategy = self.trainer, self.task, self.strategy
        if batch is JOINED:
            # Accumulation is 1 under join: every other rank's batch ends a window, so this one does too.
            self.shadow_batch(batch_idx)
            return True
        batch = strategy.batch_to_device(batch)
        trainer.results.new_batch(batch)
        self.fire(Callback.on_train_batch_start, batch, batch_idx)
        window_end = is_last or (batch_idx + 1) % self.accumulate == 0
        strategy.sync_next_backward = window_end
        with self.precision.autocast():
            outputs = strategy.training_step(task, batch, batch_idx)
        loss = self._loss_of(outputs)
        if self.accumulate > 1:
            # Average over the window's micro-batches so k steps of size b equal one of size k*b.
            loss = loss / self.accumulate
        self.nonfinite.observe(loss)
        if window_end and not self.nonfinite.window_is_finite(self.state.global_step, batch_idx):
            # Every rank skips alike: no synchronized backward, no step, the window's gradients dropped.
            strategy.zero_grad(self.optim.optimizer)
        else:
            self.fire(Callback.on_before_backward, loss)
            strategy.backward(self.precision.scale_loss(loss), sync=window_end)
            self.fire(Callback.on_after_backward)
            if window_end:
                self.optimizer_step()
        # Counted before the batch-end hooks, so a checkpoint taken there resumes after this batch.
        self.state.batch_idx = batch_idx + 1
        self.fire(Callback.on_train_batch_end, outputs, batch, batch_idx)
        if window_end:
            trainer.flush_step_logs()
        return window_end

    def stop_if_preempted(self) -> None:
        """At a step boundary: if any rank was signalled, write last.ckpt on every rank and stop.

        Raises:
            TrainingPreempted: after the checkpoint is written.
        """
        # Collective (with several processes): every rank learns whether any rank was signalled a step ago.
        signum = self.trainer.preemption.should_stop(self.strategy)
        if not signum:
            return
        path = self.trainer.save_preemption_checkpoint()  # collective
        raise TrainingPreempted(
            f"Stopped by {signal.Signals(signum).name} after step {self.state.global_step}; saved {path}. "
            f'Resume with ckpt_path="last" (exit status {PREEMPTED_EXIT_CODE}).'
        )

    def shadow_batch(self, batch_idx: int) -> None:
        """On a rank whose data ran out, match the collectives of the others' step, then step alike."""
        strategy = self.strategy
        assert isinstance(strategy, Joinable)
        strategy.shadow_forward()
        # Collective (in the check): this rank's window had no loss, so it contributes no flag.
        if self.nonfinite.window_is_finite(self.state.global_step, batch_idx):
            strategy.shadow_backward()
            self.optimizer_step()
        else:
            strategy.zero_grad(self.optim.optimizer)
        self.state.batch_idx = batch_idx + 1

    def _loss_of(self, outputs: Any) -> Tensor:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor):
            name = type(self.task).__name__
            raise TypeError(
                f"{name}.training_step returned {type(outputs).__name__}; return the loss as a scalar "
                "tensor, or a dict with a 'loss' tensor."
            )
        if loss.numel() != 1:
            raise ValueError(
                f"{type(self.task).__name__}.training_step returned a loss of shape {tuple(loss.shape)}; "
                "the loss must be a scalar (reduce it, e.g. with .mean())."
            )
        return loss

    def optimizer_step(self) -> None:
        """Clip, step, count, reset gradients and step per-step schedulers."""
        trainer, state, strategy = self.trainer, self.state, self.strategy
        optimizer = self.optim.optimizer
        self.precision.unscale(optimizer)
        self.fire(Callback.on_before_optimizer_step, optimizer)
        if trainer.gradient_clip_val is not None:
            strategy.clip_gradients(self.parameters, trainer.gradient_clip_val)
        strategy.optimizer_step(optimizer, self.precision.step(optimizer))
        state.global_step += 1
        self.fire(Callback.on_before_zero_grad, optimizer)
        strategy.zero_grad(optimizer)
        if self.optim.schedulers:
            self.optim_step_schedulers("step", state.global_step)

    # -------------------------------------------------------------- checkpoints
    def accumulated_grads(self) -> list[Tensor | None] | None:
        """Gradients of an open accumulation window (None when the window is closed)."""
        if self.state.batch_idx % self.accumulate == 0 or self.state.batches_done:
            return None
        return [None if p.grad is None else p.grad.detach().clone() for p in self.parameters]

    def restore_accumulated_grads(self, grads: list[Tensor | None] | None) -> None:
        """Put back the gradients of an accumulation window that a checkpoint interrupted."""
        if grads is None:
            return
        if len(grads) != len(self.parameters):
            raise ValueError("The checkpoint's accumulated gradients do not match the task's parameters.")
        if any(grad is not None and not torch.isfinite(grad).all() for grad in grads):
            # The window's non-finite loss came before the checkpoint: its verdict must survive the resume.
            self.nonfinite.observe(torch.tensor(float("nan")))
        with torch.no_grad():
            for param, grad in zip(self.parameters, grads):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad.to(param.device)
                else:
                    # In place: a strategy's gradients may be views into its communication buffers.
                    param.grad.copy_(grad)


_END = object()


def _flag_last(batches: Iterator[Any], start: int) -> Iterator[tuple[int, Any, bool]]:
    """Yield (index, batch, is_last) from an iterator of unknown length by looking one batch ahead.

    The first batch is fetched now, not on the first `next()`, as the original run had fetched it
    before any checkpoint taken in this epoch.
    """
    return _flag_last_from(next(batches, _END), batches, start)


def _flag_last_from(current: Any, batches: Iterator[Any], index: int) -> Iterator[tuple[int, Any, bool]]:
    while current is not _END:
        upcoming = next(batches, _END)
        yield index, current, upcoming is _END
        current, index = upcoming, index + 1
