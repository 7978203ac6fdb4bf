"""`EarlyStopping`: stop training when a monitored metric stops improving."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from syncline.callbacks.callback import Callback
from syncline.options import check_int, check_number
from syncline.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["EarlyStopping", "EarlyStoppingReason"]


class EarlyStoppingReason(Enum):
    """Why `EarlyStopping` stopped training (its `stopping_reason`), as Lightning names the reasons."""

    NOT_STOPPED = "not_stopped"
    STOPPING_THRESHOLD = "stopping_threshold"
    DIVERGENCE_THRESHOLD = "divergence_threshold"
    PATIENCE_EXHAUSTED = "patience_exhausted"
    NON_FINITE_METRIC = "non_finite_metric"


@dataclass
class _Decision:
    """The outcome of one check; decided on rank 0 and broadcast, so every rank stops together."""

    wait_count: int = 0
    best_score: float = math.inf
    reason: EarlyStoppingReason = EarlyStoppingReason.NOT_STOPPED
    message: str = ""
    error: Exception | None = None

    @property
    def should_stop(self) -> bool:
        """Whether this check stops training."""
        return self.reason is not EarlyStoppingReason.NOT_STOPPED


class EarlyStopping(Callback):
    """Stop `fit` once `monitor` has not improved for `patience` checks, as Lightning's callback does.

    A check runs at the end of each training epoch when validation runs once per epoch at its end (or not
    at all), otherwise after each validation (never the sanity check), as Lightning decides; never under
    `Trainer(fast_dev_run=...)`. After `fit`, `stopping_reason` (an `EarlyStoppingReason`) and
    `stopping_reason_message` say why it stopped.

    Args:
        monitor: key in `trainer.callback_metrics` to watch.
        patience: checks without improvement after which training stops.
        min_delta: how much `monitor` must beat the best value by to count as an improvement.
        mode: "min" or "max": whether a lower or a higher `monitor` is better.
        check_on_train_epoch_end: check at training epoch end (True) or after validation (False).
            None: at epoch end when validation runs only there (``val_check_interval=1.0``,
            ``check_val_every_n_epoch=1``) or not at all, otherwise after validation.
        verbose: print each improvement and the stop.
        check_finite: stop as soon as `monitor` is NaN or infinite.
        stopping_threshold: stop as soon as `monitor` is better than this (below it in "min" mode).
        divergence_threshold: stop as soon as `monitor` is worse than this (above it in "min" mode).
    """

    #: Reads metrics, never the weights.
    reads_parameters = False
    acts_on_monitor = True

    def __init__(
        self,
        monitor: str,
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "min",
        check_on_train_epoch_end: bool | None = None,
        verbose: bool = False,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}.")
        check_int("EarlyStopping", "patience", patience, 0, meaning="checks without improvement")
        check_number("EarlyStopping", "min_delta", min_delta, minimum=0, meaning="the least change that counts")
        check_number("EarlyStopping", "stopping_threshold", stopping_threshold, none_ok=True)
        check_number("EarlyStopping", "divergence_threshold", divergence_threshold, none_ok=True)
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.mode = mode
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose = verbose
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        #: Epoch at which training was stopped (0 if it was not).
        self.stopped_epoch = 0
        #: Why training was stopped, and the message saying so (None until it stops).
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None
        self._on_epoch_end = bool(check_on_train_epoch_end)

    @property
    def state_key(self) -> str:
        """Key of this callback's state, distinct for early stoppers on different metrics."""
        return f"{type(self).__qualname__}{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: Trainer, task: Task) -> None:
        """Decide where to check, now that the validation data is known."""
        if self.check_on_train_epoch_end is None:
            once_at_epoch_end = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
            self._on_epoch_end = once_at_epoch_end or not any(trainer.num_val_batches)
        else:
            self._on_epoch_end = self.check_on_train_epoch_end

    def on_validation_end(self, trainer: Trainer, task: Task) -> None:
        """Check after a validation run during fit."""
        if not self._on_epoch_end and not trainer.sanity_checking and trainer.state.fn == "fit":
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Check at the end of a training epoch, when configured to."""
        if self._on_epoch_end:
            self._check(trainer)

    # ------------------------------------------------------------------ logic
    def _check(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run:
            return  # as in Lightning: a debugging run never stops early
        decision = self._decide(trainer.callback_metrics) if trainer.is_global_zero else None
        # Collective: rank 0 decides, so no rank keeps training while another has stopped.
        decision = trainer.strategy.broadcast_object(decision)
        if decision.error is not None:
            raise decision.error
        self.wait_count, self.best_score = decision.wait_count, decision.best_score
        if decision.should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason, self.stopping_reason_message = decision.reason, decision.message
        if self.verbose and decision.message:
            rank_zero_info(decision.message)

    def _decide(self, metrics: dict[str, Any]) -> _Decision:
        """Return the new wait count and best score, and whether to stop (rank 0)."""
        if self.monitor not in metrics:
            return _Decision(
                error=KeyError(
                    f"EarlyStopping(monitor={self.monitor!r}) found no metric of that name. "
                    f"Logged metrics: {', '.join(sorted(metrics)) or 'none'}. "
                    f"Log it with self.log({self.monitor!r}, ...) or change `monitor`."
                )
            )
        current = float(metrics[self.monitor])  # host sync: once per check
        reason = EarlyStoppingReason
        if self.check_finite and not math.isfinite(current):
            message = f"EarlyStopping: {self.monitor} = {current} is not finite; stopping."
            return _Decision(self.wait_count, self.best_score, reason.NON_FINITE_METRIC, message)
        order = "<" if self.mode == "min" else ">"
        if self.stopping_threshold is not None and self._beyond(current, self.stopping_threshold):
            message = f"Stopping threshold reached: {self.monitor} = {current:.6g} {order} {self.stopping_threshold}."
            return _Decision(self.wait_count, self.best_score, reason.STOPPING_THRESHOLD, message)
        if self.divergence_threshold is not None and self._beyond(self.divergence_threshold, current):
            worse = ">" if self.mode == "min" else "<"
            value = f"{self.monitor} = {current:.6g} {worse} {self.divergence_threshold}"
            message = f"Divergence threshold reached: {value}."
            return _Decision(self.wait_count, self.best_score, reason.DIVERGENCE_THRESHOLD, message)
        if self._improves(current):
            message = f"EarlyStopping: {self.monitor} improved to {current:.6g}."
            return _Decision(0, current, reason.NOT_STOPPED, message)
        wait = self.wait_count + 1
        if wait >= self.patience:
            message = (
                f"EarlyStopping: {self.monitor} did not improve in the last {wait} checks "
                f"(best {self.best_score:.6g}); stopping."
            )
            return _Decision(wait, self.best_score, reason.PATIENCE_EXHAUSTED, message)
        return _Decision(wait, self.best_score)

    def _beyond(self, value: float, threshold: float) -> bool:
        """Whether `value` is strictly better than `threshold` in this mode."""
        return value < threshold if self.mode == "min" else value > threshold

    def _improves(self, current: float) -> bool:
        if self.mode == "min":
            return current < self.best_score - self.min_delta
        return current > self.best_score + self.min_delta

    # ------------------------------------------------------------- resuming
    def state_dict(self) -> dict[str, Any]:
        """Return the wait count, best score, stop epoch and stopping reason.

        The reason travels too, so that after a launched `fit` (``devices`` > 1) the process that launched it
        reads why rank 0 stopped.
        """
        return {
            "wait_count": self.wait_count,
            "best_score": self.best_score,
            "stopped_epoch": self.stopped_epoch,
            "patience": self.patience,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (the patience given now is kept)."""
        self.wait_count = state_dict["wait_count"]
        self.best_score = state_dict["best_score"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        self.stopping_reason = EarlyStoppingReason(state_dict.get("stopping_reason", "not_stopped"))
        self.stopping_reason_message = state_dict.get("stopping_reason_message")
