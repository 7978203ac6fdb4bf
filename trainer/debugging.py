"""Lightning's debugging flags: `fast_dev_run` (a few batches of every stage) and `overfit_batches`.

The Trainer calls `apply_debugging_flags` once its loggers and callbacks exist; the flags then only change
the Trainer's other settings (limits, maxima, loggers), so the loops need no debugging path of their own.
ModelCheckpoint and EarlyStopping read `trainer.fast_dev_run` and do nothing while it is set, as in Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from syncline.callbacks.logger import DummyLogger
from syncline.options import OptionError
from syncline.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from syncline.trainer.trainer import Trainer

__all__ = ["apply_debugging_flags", "check_debugging_flags"]


def check_debugging_flags(fast_dev_run: Any, overfit_batches: Any) -> None:
    """Check both flags, each with one message naming it and what it may be.

    Raises:
        OptionError: `fast_dev_run` is not a bool or an int >= 0, or `overfit_batches` is neither an int >= 0
            nor a float in [0, 1].
    """
    if not isinstance(fast_dev_run, (bool, int)) or fast_dev_run < 0:
        raise OptionError(
            f"Trainer(fast_dev_run={fast_dev_run!r}): fast_dev_run must be a bool or an int >= 0 (the batches of "
            "each stage to run), as in Lightning."
        )
    valid_float = isinstance(overfit_batches, float) and 0.0 <= overfit_batches <= 1.0
    valid_int = isinstance(overfit_batches, int) and not isinstance(overfit_batches, bool) and overfit_batches >= 0
    if not (valid_float or valid_int):
        raise OptionError(
            f"Trainer(overfit_batches={overfit_batches!r}): overfit_batches must be an int >= 0 (batches) or a "
            "float in [0, 1] (a fraction of the training batches); 0 turns it off."
        )


def apply_debugging_flags(trainer: Trainer, fast_dev_run: bool | int, overfit_batches: int | float) -> None:
    """Set `trainer.fast_dev_run` and `trainer.overfit_batches`, and the settings they override, as Lightning does.

    `fast_dev_run=n` (True is 1) runs n batches of every stage: training stops after one epoch and n steps,
    validation runs at its end, there is no sanity check, and the loggers are replaced by one that writes
    nothing (ModelCheckpoint and EarlyStopping stand still). `overfit_batches` limits training and validation
    to that many batches (or that fraction), taken in order; it wins over `fast_dev_run` for those two.
    """
    # Lightning normalizes 1 to True, so `trainer.fast_dev_run` reads the same for the one-batch case.
    trainer.fast_dev_run = True if fast_dev_run == 1 else fast_dev_run
    trainer.overfit_batches = overfit_batches
    if fast_dev_run:
        batches = int(fast_dev_run)
        if not overfit_batches:
            trainer.limit_train_batches = trainer.limit_val_batches = batches
        trainer.limit_test_batches = trainer.limit_predict_batches = batches
        trainer.max_steps, trainer.max_epochs = batches, 1
        trainer.num_sanity_val_steps = 0
        trainer.val_check_interval, trainer.check_val_every_n_epoch = 1.0, 1
        trainer.loggers = [DummyLogger(trainer.default_root_dir)] if trainer.loggers else []
        rank_zero_info(
            f"Running in `fast_dev_run` mode: will run the requested loop using {batches} batch(es). "
            "Logging and checkpointing is suppressed."
        )
    if overfit_batches:
        trainer.limit_train_batches = trainer.limit_val_batches = overfit_batches
