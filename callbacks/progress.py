"""`ProgressBar`: tqdm bars on a terminal, plain periodic lines otherwise; rank 0 only."""

from __future__ import annotations

import math
import sys
from time import monotonic
from typing import TYPE_CHECKING, Any

from torch import Tensor
from tqdm import tqdm

from syncline.callbacks.callback import Callback
from syncline.options import check_int
from syncline.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["ProgressBar"]

#: Seconds between bar redraws (tqdm's own default `mininterval`).
REFRESH_SECONDS = 0.1
#: Plain lines per training epoch when stderr is not a terminal and the epoch length is known.
LINES_PER_EPOCH = 10
#: Batches between plain lines when the epoch length is unknown.
UNKNOWN_LENGTH_EVERY = 50


class ProgressBar(Callback):
    """Show training progress: epoch, batch and the metrics logged with ``prog_bar=True`` (else the loss).

    On a terminal this draws tqdm bars; otherwise (a log file, CI) it prints a plain line every
    `print_every_n_steps` batches and at the end of each epoch and validation. Only global rank 0
    shows anything.

    The per-batch cost is one comparison: metrics are read (a host sync for tensors) and formatted only
    when the bar is redrawn, at most every `REFRESH_SECONDS`, or when a line is printed.

    Args:
        refresh_rate: consider redrawing the bar every this many batches; 0 disables all output.
        print_every_n_steps: batches between plain lines when stderr is not a terminal; None for about
            `LINES_PER_EPOCH` lines per epoch (every `UNKNOWN_LENGTH_EVERY` when the length is unknown).
    """

    #: Counts, times or logs; never reads the weights.
    reads_parameters = False

    def __init__(self, refresh_rate: int = 1, print_every_n_steps: int | None = None) -> None:
        check_int("ProgressBar", "refresh_rate", refresh_rate, 0, meaning="0 disables all output")
        check_int("ProgressBar", "print_every_n_steps", print_every_n_steps, 1, none_ok=True)
        self.refresh_rate = refresh_rate
        self.print_every_n_steps = print_every_n_steps
        self._enabled = False
        self._terminal = False
        self._bar: tqdm | None = None
        self._eval_bar: tqdm | None = None
        # Training: batch count at which to look again (inf: never), epoch length, and what was shown.
        self._next: float = math.inf
        self._total: float = math.inf
        self._every = 1
        self._due = 0.0
        self._loss: float | None = None
        self._epoch_start = (0, 0.0)
        # Evaluation: batches seen, batch count at which to look again, and a name for lines.
        self._eval_n = 0
        self._eval_next: float = math.inf
        self._eval_due = 0.0
        self._eval_name = ""
        #: Progress-bar metrics as evaluation began; what the run logs replaces these objects.
        self._before_eval: dict[str, Any] = {}

    # -------------------------------------------------------------- lifecycle
    def setup(self, trainer: Trainer, task: Task, stage: str) -> None:
        """Enable output on global rank 0 only, as bars on a terminal, else as lines."""
        self._enabled = trainer.is_global_zero and self.refresh_rate > 0
        self._terminal = sys.stderr.isatty()

    def teardown(self, trainer: Trainer, task: Task, stage: str) -> None:
        """Close any bar left open (also after an exception)."""
        for bar in (self._eval_bar, self._bar):
            if bar is not None:
                bar.close()
        self._bar = self._eval_bar = None
        self._next = self._eval_next = math.inf

    # --------------------------------------------------------------- training
    def on_train_epoch_start(self, trainer: Trainer, task: Task) -> None:
        """Open this epoch's bar (or start counting towards its first line)."""
        if not self._enabled:
            return
        start = trainer.state.batch_idx  # nonzero when resuming mid-epoch
        self._total = trainer.num_training_batches
        self._loss = None
        self._epoch_start = (start, monotonic())
        if self._terminal:
            self._every = self.refresh_rate
            self._bar = tqdm(
                total=None if self._total == math.inf else int(self._total),
                initial=start,
                desc=f"Epoch {trainer.current_epoch}",
                file=sys.stderr,
                dynamic_ncols=True,
                # This callback decides when to redraw; tqdm then draws whenever it is asked.
                mininterval=0,
                miniters=1,
            )
        else:
            self._every = self.print_every_n_steps or (
                UNKNOWN_LENGTH_EVERY if self._total == math.inf else max(1, math.ceil(self._total / LINES_PER_EPOCH))
            )
        self._due = 0.0
        self._next = min(start + self._every, self._total)

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Count the batch; redraw or print only when due (hot path: one comparison otherwise)."""
        if batch_idx + 1 >= self._next:
            self._train_progress(trainer, batch_idx + 1, outputs)

    def _train_progress(self, trainer: Trainer, n: int, outputs: Any) -> None:
        last = n >= self._total
        self._next = min(n + self._every, self._total)
        now = monotonic()
        if self._terminal and now < self._due and not last:
            return  # drawn less than REFRESH_SECONDS ago; the last batch's loss is always read
        self._due = now + REFRESH_SECONDS
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self._loss = loss.item()  # host sync: only when shown
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(trainer), refresh=False)
            self._bar.update(n - self._bar.n)
        elif not last:  # the epoch-end line reports the last batch, with the validation metrics
            self._print_train_line(trainer, n, now)

    def on_train_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Show the epoch's final numbers, validation metrics included, and close its bar."""
        if not self._enabled:
            return
        n = trainer.state.batch_idx
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(trainer), refresh=False)
            self._bar.update(n - self._bar.n)
            self._bar.close()
            self._bar = None
        else:
            self._print_train_line(trainer, n, monotonic())
        self._next = math.inf

    def _print_train_line(self, trainer: Trainer, n: int, now: float) -> None:
        start, started_at = self._epoch_start
        total = "?" if self._total == math.inf else int(self._total)
        rate = (n - start) / (now - started_at) if now > started_at else 0.0
        parts = [f"Epoch {trainer.current_epoch} [{n}/{total}]", self._postfix(trainer), f"({rate:.1f} it/s)"]
        rank_zero_info(" ".join(part for part in parts if part))

    def _postfix(self, trainer: Trainer) -> str:
        # The step's loss only when the task shows nothing of its own: a task that logs its loss with
        # prog_bar=True would otherwise see it twice ("loss=2.727 train_loss=2.727").
        values = {"loss": self._loss} if self._loss is not None and not trainer.progress_bar_metrics else {}
        values.update(trainer.progress_bar_metrics)
        return " ".join(f"{name}={_format(value)}" for name, value in values.items())

    # ------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer: Trainer, task: Task) -> None:
        """Open a validation bar (the sanity check's too); lines are printed only at its end."""
        total = sum(trainer.num_eval_batches)
        self._eval_start(trainer, "Sanity Checking" if trainer.sanity_checking else "Validation", total)

    def on_validation_batch_end(
        self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Count the batch; redraw only when due."""
        self._eval_n += 1
        if self._eval_n >= self._eval_next:
            self._eval_progress()

    def on_validation_end(self, trainer: Trainer, task: Task) -> None:
        """Close the validation bar, or print its line (not for the sanity check)."""
        self._eval_end(trainer, quiet=trainer.sanity_checking)

    def on_test_start(self, trainer: Trainer, task: Task) -> None:
        """Open the test bar."""
        self._eval_start(trainer, "Testing", sum(trainer.num_eval_batches))

    def on_test_batch_end(
        self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Count the batch; redraw only when due."""
        self._eval_n += 1
        if self._eval_n >= self._eval_next:
            self._eval_progress()

    def on_test_end(self, trainer: Trainer, task: Task) -> None:
        """Close the test bar, or print its line."""
        self._eval_end(trainer, quiet=False)

    def on_predict_start(self, trainer: Trainer, task: Task) -> None:
        """Open the predict bar."""
        self._eval_start(trainer, "Predicting", sum(trainer.num_eval_batches))

    def on_predict_batch_end(
        self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Count the batch; redraw only when due."""
        self._eval_n += 1
        if self._eval_n >= self._eval_next:
            self._eval_progress()

    def on_predict_end(self, trainer: Trainer, task: Task) -> None:
        """Close the predict bar, or print its line."""
        self._eval_end(trainer, quiet=True)

    def _eval_start(self, trainer: Trainer, name: str, total: int | float | None) -> None:
        self._eval_n, self._eval_name = 0, name
        if not self._enabled:
            return
        self._before_eval = dict(trainer.progress_bar_metrics)
        if self._terminal:
            finite = total is not None and total != math.inf
            self._eval_bar = tqdm(
                total=int(total) if finite else None,
                desc=name,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
                mininterval=0,
                miniters=1,
            )
            self._eval_due = 0.0
            self._eval_next = self.refresh_rate

    def _eval_progress(self) -> None:
        self._eval_next = self._eval_n + self.refresh_rate
        now = monotonic()
        if now >= self._eval_due and self._eval_bar is not None:
            self._eval_due = now + REFRESH_SECONDS
            self._eval_bar.update(self._eval_n - self._eval_bar.n)

    def _eval_end(self, trainer: Trainer, quiet: bool) -> None:
        self._eval_next = math.inf
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None
        elif self._enabled and not quiet:
            # Only what this run logged: the dict also holds the training metrics.
            logged = {k: v for k, v in trainer.progress_bar_metrics.items() if self._before_eval.get(k) is not v}
            metrics = " ".join(f"{k}={_format(v)}" for k, v in logged.items())
            rank_zero_info(f"{self._eval_name} [{self._eval_n} batches] {metrics}".rstrip())
        if self._bar is not None:
            # Put the validation metrics on the training bar right away.
            self._bar.set_postfix_str(self._postfix(trainer))


def _format(value: Any) -> str:
    number = value.item() if isinstance(value, Tensor) else value  # host sync: only when shown
    return f"{number:.4g}" if isinstance(number, float) else str(number)
