"""The training loop: the sanity check, epochs of micro-batches, accumulation windows, optimizer steps, validation."""

from __future__ import annotations

import functools
import gc
import itertools
import math
import signal
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.callbacks.callback import Callback
from syncline.rank_zero import rank_zero_info, rank_zero_warn
from syncline.rng import capture_rng, isolated_rng, restore_rng
from syncline.strategies.comm.join import Joinable
from syncline.strategies.strategy import Strategy, training_step_of
from syncline.trainer import persistence
from syncline.trainer.data import batch_mover, epoch_batches
from syncline.trainer.hooks import ModelHooks, overrides
from syncline.trainer.manual import TrainerOptimizer, take_step, train_batch_manually
from syncline.trainer.nonfinite import NonfiniteLossGuard
from syncline.trainer.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from syncline.trainer.uneven import JOINED, agreed_batches, needs_agreement

if TYPE_CHECKING:
    from syncline.trainer.optim import OptimizerSetup
    from syncline.trainer.trainer import Trainer

__all__ = ["FitLoop"]


class FitLoop:
    """Run `Trainer.fit`'s epochs: the sanity check, batches, validation when due, epoch ends, schedulers.

    Made with the Trainer; `setup` binds it to the task and optimizer of a fit. It holds nothing that the
    trainer's state does not already say, except where this batch stands between its step and its end.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.state = trainer.state
        self.fire = trainer.dispatcher.fire
        self.bind_step_hooks()
        self.accumulate = trainer.accumulate_grad_batches
        self.optim: OptimizerSetup | None = None
        #: The optimizers as `Task.optimizers()` gives them: their step goes through the Trainer.
        self.trainer_optimizers: list[TrainerOptimizer] = []
        self.parameters: list[Tensor] = []
        # Decided once per fit (`setup`), not per step: the task's optimization mode, and which of the step's
        # hooks it overrides (one left at its default is skipped, or replaced by what the default does).
        self.manual = False
        #: Whether an automatic step runs `configure_gradient_clipping` (overridden, or the Trainer clips).
        self.clips = False
        self._own_step = self._own_zero_grad = False
        #: The forward's autocast context (None: the forward runs as it is), and whether the loss is scaled.
        self.autocast: Callable[[], Any] | None = None
        self.scales_loss = False
        self._transfer: Any = None
        self._stepped_optimizer: torch.optim.Optimizer | None = None  # the one automatic optimization steps
        # The strategy's part of a step, decided once per fit (`setup`): a method the strategy leaves at the base's
        # is replaced by what the base does (the task's forward, autograd's backward, the optimizer's zero_grad).
        self._forward: Callable[[Any, int], Any] | None = None
        self._zero_grad: Callable[[], None] | None = None
        #: Whether a window's gradients are reset just before its first `training_step` rather than after it
        #: (Lightning's moment), because no hook can tell the difference (decided in `setup`).
        self._zero_before_forward = False
        self._plain_backward = False
        #: Whether an automatic step is the optimizer's step alone (no loss scaler, clipping, listener of
        #: ``on_before_optimizer_step``, own `optimizer_step` hook or strategy step): `take_step` is then skipped.
        self._plain_step = False
        #: Whether the fit has learning-rate schedulers (the loop checks after every step whether one is due).
        self._schedules_steps = False
        #: Per optimizer, the precision's step function (`Precision.step`), made once per fit, not per step.
        self.step_functions: dict[torch.optim.Optimizer, Callable[[], Any]] = {}
        #: Whether the loop validates within or after an epoch: there are validation batches (decided per epoch,
        #: when the loaders may have been reloaded).
        self._validates = False
        self.nonfinite = NonfiniteLossGuard(trainer.nonfinite_loss, trainer.strategy)
        #: The last window's loss, released when the next one exists (see `train_batch`).
        self._previous_loss: Tensor | None = None
        #: RNG state of the checkpoint being resumed, applied at the point in the loop it was taken.
        self.resume_rng: dict[str, Any] | None = None
        #: The strategy's comm/* counters for the loggers (nothing for a one-process strategy).
        self.communication_stats: Callable[[], dict[str, float]] = dict
        #: Asks for the fit's loaders again (`Trainer(reload_dataloaders_every_n_epochs=n)`), given the epochs run.
        self.reload_data: Callable[[int], None] | None = None
        #: The epoch this fit started (or resumed) at.
        self.first_epoch = 0
        #: Training batches between validations: a float for fractions of an epoch, so that e.g. 0.25
        #: validates after batches 110, 220, 330 and 439 of 439 rather than 109, 218, 327, 436 and 439.
        self.val_every: float | None = None
        #: Whether the batch in progress has taken its optimizer step (its logs then go to the step before).
        self.stepped = False
        #: Micro-batches of the open accumulation window that returned a loss (None skips one).
        self._window_losses = 0
        self._warned_none = False
        self._warned_min = False

    def bind_step_hooks(self) -> None:
        """Decide the hooks of every training step for the bound task and callbacks: each is what fires its
        listeners, or None when nothing listens (the callbacks and the task are fixed for a fit, so this is
        decided once, and a step pays for no lookup and no hook nobody overrides)."""
        caller = self.trainer.dispatcher.caller
        self.fire_batch_start = caller(Callback.on_train_batch_start)
        self.fire_before_zero_grad = caller(Callback.on_before_zero_grad)
        self.fire_before_backward = caller(Callback.on_before_backward)
        self.fire_after_backward = caller(Callback.on_after_backward)
        self.fire_before_optimizer_step = caller(Callback.on_before_optimizer_step)
        self.fire_batch_end = caller(Callback.on_train_batch_end)
        #: Whether a listener of ``on_train_batch_end`` may read the weights (a step in flight lands first).
        self.batch_end_reads_parameters = self.trainer.dispatcher.reads_parameters(Callback.on_train_batch_end)

    def setup(self, optim: OptimizerSetup) -> None:
        """Bind the loop to the optimizer of this fit and plan when validation runs."""
        trainer = self.trainer
        self.fire = trainer.dispatcher.fire
        self.bind_step_hooks()  # the task is bound now: its own overrides listen too
        self.optim = optim
        self.trainer_optimizers = [TrainerOptimizer(optimizer, trainer) for optimizer in optim.optimizers]
        task = trainer.task
        self.parameters = [p for p in task.parameters() if p.requires_grad]
        self.manual = not task.automatic_optimization
        self.clips = not self.manual and (
            bool(trainer.gradient_clip_val) or overrides(task, ModelHooks, "configure_gradient_clipping")
        )
        self._own_step = overrides(task, ModelHooks, "optimizer_step")
        self._own_zero_grad = overrides(task, ModelHooks, "optimizer_zero_grad")
        self._transfer = batch_mover(trainer)
        precision = trainer.precision
        self.autocast = precision.autocast if precision is not None and precision.autocasts else None
        self.scales_loss = precision is not None and precision.scaler is not None
        self._stepped_optimizer = optim.optimizer
        strategy = trainer.strategy
        if overrides(strategy, Strategy, "training_step"):
            self._forward = functools.partial(strategy.training_step, task)
        else:
            self._forward = training_step_of(task)
        if overrides(strategy, Strategy, "zero_grad"):
            self._zero_grad = functools.partial(strategy.zero_grad, optim.optimizer)
        else:
            self._zero_grad = functools.partial(optim.optimizer.zero_grad, set_to_none=True)
        # Lightning resets the gradients after `training_step`, right before the backward, so that
        # `on_before_zero_grad` and `optimizer_zero_grad` come after the step. When neither has a listener and the
        # strategy's own zero_grad and training_step are the base's, only the task's `training_step` could tell
        # the two moments apart (it would see `.grad` None rather than the previous window's): the reset then
        # comes before it, so that the old gradients are freed before the forward allocates its activations.
        # On the MLP of `python -m benchmarks trainer` that is ~10 us of a ~600 us step (the allocator hands the
        # forward memory that is still in cache).
        self._zero_before_forward = (
            self.fire_before_zero_grad is None
            and not self._own_zero_grad
            and not overrides(strategy, Strategy, "zero_grad")
            and not overrides(strategy, Strategy, "training_step")
        )
        self._plain_backward = not overrides(strategy, Strategy, "backward") and strategy.backward_hook is None
        self._plain_step = not (
            self._own_step
            or self.scales_loss
            or self.clips
            or self.fire_before_optimizer_step is not None
            or overrides(strategy, Strategy, "optimizer_step")
        )
        self._schedules_steps = bool(optim.schedulers)
        self.step_functions = {}
        if precision is not None:
            self.step_functions = {optimizer: precision.step(optimizer) for optimizer in optim.optimizers}
        self.nonfinite = NonfiniteLossGuard(trainer.nonfinite_loss, trainer.strategy)
        self.resume_rng = None
        # Decided once per fit: a one-process strategy communicates nothing and logs no comm/* values (as
        # Lightning logs none); a data-parallel one logs its counters, in a world of one too.
        self.communication_stats = trainer.strategy.communication_stats if trainer.strategy.multi_process else dict
        interval, batches = trainer.val_check_interval, trainer.num_training_batches
        if isinstance(interval, float):
            finite_fraction = interval < 1.0 and batches != math.inf
            self.val_every = max(1.0, batches * interval) if finite_fraction else None
        else:
            self.val_every = float(interval)

    # ------------------------------------------------------------------ epochs
    def train(self) -> None:
        """Run the sanity check, then train with the heap frozen and the preemption signal watched."""
        self.sanity_check()
        # What exists now (imports, the task, the data) lives through training: freeze it, so that the
        # garbage collector's full passes during training walk only objects made since, rather than
        # pausing the loop for the whole heap (100-200 ms each on a heap with torch imported).
        gc.collect()
        gc.freeze()
        self.trainer.preemption.install()
        try:
            self.run()
        finally:
            self._previous_loss = None
            self.trainer.preemption.uninstall()
            gc.unfreeze()

    def run(self) -> None:
        """Train until max_epochs, max_steps or a stop request; nothing at all without training batches."""
        state = self.state
        # A checkpoint taken at an epoch's end (by early stopping's validation, say) finishes that epoch first.
        if not self.trainer.num_training_batches or (self._done() and not state.batches_done):
            return
        self.first_epoch = state.current_epoch
        self.fire(Callback.on_train_start)
        if state.batches_done:
            # Resumed from a checkpoint taken after the epoch's last batch (at its final validation or
            # its epoch-end hooks): do what was still ahead of it, and nothing it had already done.
            self._apply_resume_rng()
            self.end_epoch()
        # Under recovery="live", epochs run through failures and admissions; nothing changes per step otherwise.
        run_epoch = self.run_epoch if self.trainer.live is None else self.trainer.live.epoch_runner(self)
        while not self._done():
            run_epoch()
        # A deferred optimizer step lands before anyone reads the trained weights.
        self.trainer.strategy.apply_pending_updates()
        self.trainer.preemption.finish()
        self.fire(Callback.on_train_end)

    def _done(self) -> bool:
        trainer, state = self.trainer, self.state
        if trainer.max_steps != -1 and state.global_step >= trainer.max_steps:
            return True
        if trainer.max_epochs not in (None, -1) and state.current_epoch >= trainer.max_epochs:
            return True
        return self._stop_requested()

    def _stop_requested(self) -> bool:
        """Whether a stop request (early stopping) ends training now: not before `min_epochs` epochs and
        `min_steps` steps, as in Lightning (the maxima still end it)."""
        trainer, state = self.trainer, self.state
        if not state.should_stop:
            return False
        if state.current_epoch >= (trainer.min_epochs or 0) and state.global_step >= (trainer.min_steps or 0):
            return True
        if not self._warned_min:
            self._warned_min = True
            rank_zero_info(
                f"Trainer was signaled to stop but the required min_epochs={trainer.min_epochs} or "
                f"min_steps={trainer.min_steps} has not been met. Training will continue..."
            )
        return False

    def run_epoch(self) -> None:
        """Run one training epoch, its validations and its end-of-epoch events."""
        trainer, state = self.trainer, self.state
        self.stepped = False
        if self.reload_data is not None and state.batch_idx == 0:
            self.reload_data(state.current_epoch - self.first_epoch)
        self._validates = any(trainer.num_val_batches)
        self.fire(Callback.on_train_epoch_start)
        exhausted = True
        for batch_idx, batch, is_last in self._batches(trainer.num_training_batches):
            self.run_batch(batch, batch_idx, is_last)
            exhausted = is_last
            if (state.should_stop and self._stop_requested()) or (
                trainer.max_steps != -1 and state.global_step >= trainer.max_steps
            ):
                break
        # Step values not due for the loggers by the epoch's end are not carried into the next epoch.
        trainer.results.pop_step_logs()
        # An epoch cut short by max_steps is not finished: it gets its final validation but no epoch-end
        # events, and a resume with a larger max_steps continues it with its remaining batches, as an
        # uninterrupted run would. A stop request (early stopping) ends the epoch.
        if exhausted or self._stop_requested():
            state.batches_done = True
            self.end_epoch()
        elif state.batch_idx - 1 != state.validated_after and self.validation_due(state.batch_idx - 1, is_last=True):
            # Not twice: max_steps can end the epoch right after a validation within it.
            self.validate_after(state.batch_idx - 1)

    def end_epoch(self) -> None:
        """Finish an epoch whose batches are done: final validation, epoch-end hooks, plateau schedulers.

        Each part is marked done in the state before its hooks run, so a checkpoint saved from those hooks
        resumes after it; the parts still ahead of a checkpoint run when it is resumed. The epoch counter
        advances last, as Lightning's does.
        """
        state = self.state
        last = state.batch_idx - 1
        if last != state.validated_after and self.validation_due(last, is_last=True):
            self.validate_after(last)
        if not state.epoch_hooks_done:
            self.fire_epoch_end()
        if self._all_batches_done():
            # The other epoch schedulers stepped with the epoch's last optimizer step (see `optimizer_step`).
            self.step_schedulers("epoch", state.current_epoch + 1, plateau=True)
        state.finish_epoch()
        self.stepped = False

    def _all_batches_done(self) -> bool:
        """Whether the epoch consumed all its batches (not cut short by a stop request)."""
        batches = self.trainer.num_training_batches
        return self.state.batch_idx >= batches if batches != math.inf else not self.state.should_stop

    def fire_epoch_end(self) -> None:
        """Resolve the epoch's aggregates, fire ``on_train_epoch_end`` in Lightning's order, log what they logged."""
        trainer, results = self.trainer, self.trainer.results
        results.epoch_end()
        self.land_before(Callback.on_train_epoch_end)
        trainer.dispatcher.fire_epoch_end(Callback.on_train_epoch_end, monitoring=False)
        results.epoch_end()
        trainer.log_metrics(results.pop_epoch_logs())
        # Marked before the monitoring callbacks: ModelCheckpoint saves there, once every other callback and
        # the task have seen the epoch's end, so a resume from its checkpoint must not fire these hooks again.
        self.state.epoch_hooks_done = True
        trainer.dispatcher.fire_epoch_end(Callback.on_train_epoch_end, monitoring=True)
        results.epoch_end()
        trainer.log_metrics(results.pop_epoch_logs())

    def step_schedulers(self, interval: str, count: int, plateau: bool) -> None:
        """Step the schedulers of `interval` due at `count`: the plateau ones, or the others (under manual
        optimization, none: the task steps its schedulers, as in Lightning)."""
        assert self.optim is not None
        if self.manual:
            return
        task = self.trainer.task
        self.optim.step_schedulers(interval, count, self.trainer.callback_metrics, plateau, task.lr_scheduler_step)

    # -------------------------------------------------------------- validation
    def validation_due(self, batch_idx: int, is_last: bool) -> bool:
        """Whether validation runs after training batch `batch_idx` of this epoch."""
        if not any(self.trainer.num_val_batches):
            return False
        every_n_epochs = self.trainer.check_val_every_n_epoch
        if every_n_epochs is None:
            # Lightning's check_val_every_n_epoch=None: an int interval counts batches across epochs.
            batch_idx += self.state.current_epoch * self.trainer.num_training_batches
        elif (self.state.current_epoch + 1) % every_n_epochs:
            return False  # not an epoch that validates, as Lightning's check_val_every_n_epoch
        if is_last and isinstance(self.trainer.val_check_interval, float):
            return True
        every = self.val_every
        # Due when this batch crosses a multiple of `every`.
        return every is not None and int((batch_idx + 1) / every) > int(batch_idx / every)

    def validate_after(self, batch_idx: int) -> None:
        """Validate after training batch `batch_idx`; a checkpoint saved by validation's hooks says so."""
        self.state.validated_after = batch_idx
        trainer = self.trainer
        trainer.strategy.apply_pending_updates()  # validate the weights of every step taken
        # Validating (how often, on how many batches, or not at all) never moves the training run's RNG.
        with isolated_rng():
            trainer.evaluation.run("validate", trainer.val_dataloaders, trainer.num_val_batches)

    def sanity_check(self) -> None:
        """Run `num_sanity_val_steps` validation batches (-1: all, within `limit_val_batches`); keep no metric."""
        trainer, state = self.trainer, self.state
        steps = trainer.num_sanity_val_steps
        if steps == 0 or not any(trainer.num_val_batches):
            return
        limits = [n if steps == -1 else min(steps, n) for n in trainer.num_val_batches]
        saved_metrics = dict(trainer.callback_metrics), dict(trainer.progress_bar_metrics)
        state.sanity_checking = True
        self.fire(Callback.on_sanity_check_start)
        with isolated_rng():
            trainer.evaluation.run("validate", trainer.val_dataloaders, limits)
        self.fire(Callback.on_sanity_check_end)
        state.sanity_checking = False
        # Sanity metrics come from a few batches of an untrained task: nobody should act on them.
        for current, saved in zip((trainer.callback_metrics, trainer.progress_bar_metrics), saved_metrics):
            current.clear()
            current.update(saved)

    def log_step(self) -> int:
        """The step under which values are logged now, as Lightning counts it: the steps taken before the
        current batch, so a batch's step values, its validation and an epoch's end share one step."""
        step = self.state.global_step
        return max(step - 1, 0) if self.stepped or self.state.batches_done else step

    # ------------------------------------------------------------------- data
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
            # Flags from a known length, zipped in C: the step pays for no Python generator.
            flags = itertools.chain(itertools.repeat(False, int(num_batches) - 1 - skip), (True,))
            flagged = zip(itertools.count(skip), batches, flags)
        self._apply_resume_rng()
        if needs_agreement(loader, self.trainer.strategy, self.trainer.uneven_inputs):
            join = self.trainer.uneven_inputs == "join"
            return agreed_batches(flagged, self.trainer.strategy, state.current_epoch, join=join)
        return flagged

    def _apply_resume_rng(self) -> None:
        if self.resume_rng is not None:
            restore_rng(self.resume_rng)
            self.resume_rng = None

    # ----------------------------------------------------------------- batches
    def run_batch(self, batch: Any, batch_idx: int, is_last: bool) -> None:
        """Train on one micro-batch, then validate, step plateau schedulers and check for preemption."""
        self.stepped = False
        self.trainer.is_last_batch = is_last
        if batch is JOINED:
            # Accumulation is 1 under join: every other rank's batch ends a window, so this one does too.
            self.shadow_batch(batch_idx)
        elif self.manual:
            train_batch_manually(self, batch, batch_idx)
        else:
            self.train_batch(batch, batch_idx, is_last)
        if not is_last and self._validates and self.validation_due(batch_idx, is_last=False):
            self.validate_after(batch_idx)
        if self.stepped:
            if self._schedules_steps:
                # After the batch's validation, as Lightning steps them: they may monitor a validation metric.
                self.step_schedulers("step", self.state.global_step, plateau=True)
            self.stop_if_preempted()

    def train_batch(self, batch: Any, batch_idx: int, is_last: bool) -> None:
        """Forward, backward (synchronized at the end of an accumulation window), and maybe a step."""
        trainer = self.trainer
        strategy, results = trainer.strategy, trainer.results
        batch = self._transfer(batch, 0)
        results.new_batch(batch)
        if self.fire_batch_start is not None:
            self.fire_batch_start(batch, batch_idx)
        window_end = is_last or (batch_idx + 1) % self.accumulate == 0
        strategy.sync_next_backward = window_end
        if self._zero_before_forward and batch_idx % self.accumulate == 0:
            self._zero_grad()  # see `setup`: what `reset_gradients` would do after training_step, when nothing can tell
        results.hook = "training_step"
        if self.autocast is None:
            outputs = self._forward(batch, batch_idx)
        else:
            with self.autocast():
                outputs = self._forward(batch, batch_idx)
        results.hook = ""
        # The common case (a scalar tensor) without a call; `_loss_of` sorts out the others.
        loss = outputs if type(outputs) is Tensor and outputs.ndim == 0 else self._loss_of(outputs)
        if batch_idx % self.accumulate == 0:
            self._window_losses = 0
            if not self._zero_before_forward:
                # A window's start resets whatever training_step returned (None too), as Lightning's does.
                self.reset_gradients(batch_idx)
        kept = True
        if loss is not None:
            # The previous loss (and what is left of its graph) is released now, after this forward, as a
            # hand-written loop's `loss = ...` releases it: the forward's tensors then take the same places in
            # the allocator's heap as there (1% of a step on the MLP of `python -m benchmarks trainer`).
            self._previous_loss = loss
            self._window_losses += 1
            kept = self.backward(loss, batch_idx, window_end)
            if not kept:
                self._previous_loss = None  # no backward freed its graph's tensors: not held for a step more
        if window_end and kept:
            # A window whose every training_step returned None still counts its step, as in Lightning
            # (whose optimizer step then has no gradient to apply).
            self.optimizer_step(is_last, batch_idx, apply=self._window_losses > 0)
        # Counted before the batch-end hooks, so a checkpoint taken there resumes after this batch.
        self.state.batch_idx = batch_idx + 1
        if self.fire_batch_end is not None:
            if self.batch_end_reads_parameters:
                strategy.apply_pending_updates()
            self.fire_batch_end(outputs, batch, batch_idx)
        if window_end and (self.state.global_step % trainer.log_every_n_steps == 0 or self.state.should_stop):
            self.flush_step_logs()  # a logging step

    def reset_gradients(self, batch_idx: int) -> None:
        """Reset the gradients at a window's start, after its first training_step, as Lightning orders the
        hooks: ``on_before_zero_grad``, then the task's ``optimizer_zero_grad``."""
        if self.fire_before_zero_grad is not None:
            self.fire_before_zero_grad(self._stepped_optimizer)
        if self._own_zero_grad:
            self.trainer.task.optimizer_zero_grad(self.state.current_epoch, batch_idx, self.trainer_optimizers[0])
        else:
            self._zero_grad()  # the strategy's, as the default hook's `optimizer.zero_grad()` is

    def backward(self, loss: Tensor, batch_idx: int, window_end: bool) -> bool:
        """Back-propagate the loss (averaged over the window), as Lightning orders the hooks.

        Returns:
            False when a non-finite loss (`nonfinite_loss="skip"`) dropped the window.
        """
        trainer = self.trainer
        if self.accumulate > 1:
            # Average over the window's micro-batches so k steps of size b equal one of size k*b.
            loss = loss / self.accumulate
        if not self.nonfinite.check(loss, window_end, self.state.global_step, batch_idx):
            # Every rank skips alike: no synchronized backward, no step, the window's gradients dropped.
            trainer.strategy.zero_grad(self._stepped_optimizer)
            return False
        if self.fire_before_backward is not None:
            self.fire_before_backward(loss)
        if self.scales_loss:
            loss = trainer.precision.scale_loss(loss)
        if self._plain_backward:
            loss.backward()  # what the base strategy's backward does
        else:
            trainer.strategy.backward(loss, sync=window_end)
        if self.fire_after_backward is not None:
            self.fire_after_backward()
        return True

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of this fit."""
        assert self.optim is not None
        return self.optim.optimizer

    def transfer(self, batch: Any) -> Any:
        """Move a training batch to the device through the batch-transfer hooks (those the task overrides)."""
        return self._transfer(batch, 0)

    def land_before(self, hook: Callable[..., None]) -> None:
        """Land a step in flight (`Strategy.apply_pending_updates`) if a listener of `hook` may read the weights."""
        if self.trainer.dispatcher.reads_parameters(hook):
            self.trainer.strategy.apply_pending_updates()

    def flush_step_logs(self) -> None:
        """Send the step values to the loggers (the caller decides that this is a logging step: every
        `log_every_n_steps` steps, or a stop)."""
        trainer = self.trainer
        logs = trainer.results.pop_step_logs()
        if logs:
            trainer.log_metrics({**logs, **self.communication_stats()})

    def stop_if_preempted(self) -> None:
        """At a step boundary: if any rank was signalled, write last.ckpt on every rank and stop.

        Raises:
            TrainingPreempted: after the checkpoint is written.
        """
        # Collective (with several processes): every rank learns whether any rank was signalled a step ago.
        signum = self.trainer.preemption.should_stop(self.trainer.strategy)
        if not signum:
            return
        path = persistence.save_last_checkpoint(self.trainer)  # collective
        stop = TrainingPreempted(
            f"Stopped by {signal.Signals(signum).name} after step {self.state.global_step}; saved {path}. "
            f'Resume with ckpt_path="last" (exit status {PREEMPTED_EXIT_CODE}).',
            announced=True,
        )
        # Said here, on rank 0 of the processes that trained, so that a plain script, which exits 75 on the
        # uncaught SystemExit without a word, says it as well as the command line.
        rank_zero_info(f"preempted: {stop}")
        raise stop

    def shadow_batch(self, batch_idx: int) -> None:
        """On a rank whose data ran out, match the collectives of the others' step, then step alike."""
        strategy = self.trainer.strategy
        assert isinstance(strategy, Joinable)
        strategy.shadow_forward()
        # Collective (in the check): this rank's window had no loss, so it contributes no flag.
        if self.nonfinite.window_is_finite(self.state.global_step, batch_idx):
            strategy.zero_grad(self.optimizer)
            strategy.shadow_backward()
            self.optimizer_step(is_last=False, batch_idx=batch_idx)
        else:
            strategy.zero_grad(self.optimizer)
        self.state.batch_idx = batch_idx + 1

    def _loss_of(self, outputs: Any) -> Tensor | None:
        """Return the loss `training_step` returned; None skips the batch's backward, as in Lightning."""
        loss = outputs.get("loss", outputs) if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor) and loss.numel() == 1:
            return loss
        name = type(self.trainer.task).__name__
        if loss is None:
            if self.trainer.world_size > 1:
                raise RuntimeError(
                    f"{name}.training_step returned None on rank {self.trainer.global_rank}: skipping a batch "
                    "is not possible with several processes (the others would wait in the gradient "
                    "synchronization). Return a loss on every rank, e.g. multiplied by 0."
                )
            if not self._warned_none:
                self._warned_none = True
                rank_zero_warn(f"{name}.training_step returned None: that batch is skipped (no backward).")
            return None
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"{name}.training_step returned {type(outputs).__name__}; return the loss as a scalar "
                "tensor, a dict with a 'loss' tensor, or None to skip the batch."
            )
        raise ValueError(
            f"{name}.training_step returned a loss of shape {tuple(loss.shape)}; "
            "the loss must be a scalar (reduce it, e.g. with .mean())."
        )

    def optimizer_step(self, is_last: bool, batch_idx: int, apply: bool = True) -> None:
        """Step through the task's `optimizer_step` hook (when `apply`; the Trainer's step unscales, fires
        ``on_before_optimizer_step`` and clips), count, and step the schedulers due at this step (and, on an
        epoch's last batch, its epoch schedulers, as Lightning does: the epoch-end validation and checkpoint
        see the new rate)."""
        trainer, state = self.trainer, self.state
        if apply and self._plain_step:
            # What `take_step` and the base strategy's step come to when the fit asks nothing else of them.
            self._stepped_optimizer.step()
            trainer.strategy.comm_counter.close_step()
        elif apply and self._own_step:
            # The window's forwards and backwards ran already: the closure has nothing left to run.
            trainer.task.optimizer_step(state.current_epoch, batch_idx, self.trainer_optimizers[0], _no_closure)
        elif apply:
            take_step(trainer, self._stepped_optimizer, None)  # what the default hook's step does
        state.global_step += 1
        self.stepped = True
        if self._schedules_steps:
            self.step_schedulers("step", state.global_step, plateau=False)
            if is_last:
                self.step_schedulers("epoch", state.current_epoch + 1, plateau=False)

    # -------------------------------------------------------------- checkpoints
    def accumulated_grads(self) -> list[Tensor | None] | None:
        """Gradients of an open accumulation window (None when the window is closed); under manual optimization,
        whatever gradients the task holds (it accumulates as it likes, e.g. stepping every N batches)."""
        if self.manual:
            if all(p.grad is None for p in self.parameters):
                return None
        elif self.state.batch_idx % self.accumulate == 0 or self.state.batches_done:
            return None
        return [None if p.grad is None else p.grad.detach().clone() for p in self.parameters]

    def restore_accumulated_grads(self, grads: list[Tensor | None] | None) -> None:
        """Put back the gradients of an accumulation window that a checkpoint interrupted."""
        if grads is None:
            return
        self._window_losses = 1  # the window had a loss before the checkpoint
        if len(grads) != len(self.parameters):
            raise ValueError("The checkpoint's accumulated gradients do not match the task's parameters.")
        if any(grad is not None and not torch.isfinite(grad).all() for grad in grads):
            # The window's non-finite loss came before the checkpoint: its verdict must survive the resume.
            self.nonfinite.observe(torch.tensor(float("nan")))
        self.trainer.strategy.restore_gradients(self.parameters, grads)


_END = object()


def _no_closure() -> None:
    """The closure `optimizer_step` hands to the task's hook: the forward and backward have run already."""


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
