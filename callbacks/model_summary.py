"""`ModelSummary`: print the task's layers and parameter counts when fit starts, as Lightning does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from syncline.callbacks.callback import Callback
from syncline.model_summary import ModelSummary as Summary
from syncline.model_summary import check_max_depth
from syncline.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["ModelSummary"]


class ModelSummary(Callback):
    """Print the task's summary (`syncline.model_summary.ModelSummary`) on rank 0 when fit starts.

    The Trainer adds one (``max_depth=1``: the task's top-level modules) unless `enable_model_summary=False`
    or the callbacks hold one already.

    Args:
        max_depth: nesting depth of the layers listed; 0 prints nothing, -1 every module.
    """

    reads_parameters = False

    def __init__(self, max_depth: int = 1) -> None:
        check_max_depth(max_depth)
        self._max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, task: Task) -> None:
        """Print the summary (rank 0)."""
        if self._max_depth == 0 or not trainer.is_global_zero:
            return
        rank_zero_info(str(Summary(task, self._max_depth)))
