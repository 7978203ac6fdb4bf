"""`TensorBoardLogger`: scalars and hyperparameters as TensorBoard event files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from syncline.callbacks.versioned_logger import VersionedLogger
from syncline.rank_zero import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(VersionedLogger):
    """Write metrics to ``save_dir/name/version_N`` for TensorBoard, as Lightning's logger does.

    The `SummaryWriter` is created on the first write. A run resumed from a checkpoint keeps the
    checkpoint's version and opens the writer with ``purge_step`` just after the last step the
    checkpoint's run had written, so TensorBoard hides what the crashed run logged after the checkpoint
    and keeps every point before it.

    Args:
        save_dir: root directory of all runs.
        name: experiment name, a subdirectory of `save_dir` (None or "": the versions go in `save_dir`).
        version: run number; None picks the next free one.
        log_graph: let `log_graph` add the model's graph (with ``example_input_array`` or the input given).
        default_hp_metric: log a placeholder ``hp_metric`` of -1 with the hyperparameters, so the
            HPARAMS tab has a metric column before you log a real one under that name.
        prefix: put before every metric's name, joined by "-".
        sub_dir: a subdirectory of the version directory for the event files.
        **kwargs: passed to torch's `SummaryWriter` (``max_queue``, ``flush_secs``, ...).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = False,
        prefix: str = "",
        sub_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        # Import tensorboard now rather than at the first logged step: an import in the middle of
        # training leaves tens of thousands of young objects whose promotion later sets off a full
        # garbage collection (a pause of ~200 ms measured on the tiny-MLP benchmark).
        import torch.utils.tensorboard  # noqa: F401

        super().__init__(save_dir, name, version, sub_dir)
        self.default_hp_metric = default_hp_metric
        self._log_graph = log_graph
        self._prefix = prefix
        self._writer_options = kwargs
        self._writer: SummaryWriter | None = None
        self._purged = False
        self._epoch_step = -1
        #: The highest step written so far, and the one a checkpoint being resumed had written.
        self._last_step = -1
        self._resumed_after: int | None = None

    @property
    def experiment(self) -> SummaryWriter:
        """The `SummaryWriter`, created on first use (rank 0 only)."""
        return self._open_writer(purge_step=None)

    def _open_writer(self, purge_step: int | None) -> SummaryWriter:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # A purge step applies only to the first writer of a resumed run; later ones append. What the
            # checkpoint's run wrote up to its last step stays: the resumed run may first log at that step.
            if self._resumed_after is not None and self._resumed_after >= 0 and purge_step is not None:
                purge_step = self._resumed_after + 1
            purge = purge_step if self.resuming and not self._purged else None
            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge, **self._writer_options)
            self._started = self._purged = True
        return self._writer

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Add one scalar per metric at `step` (None: the step after the last one written)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        if step is None:
            step = self._last_step + 1
        writer = self._open_writer(purge_step=step)
        self._last_step = max(self._last_step, step)
        values = []
        for name, value in metrics.items():
            if name == "epoch":
                # The Trainer adds the epoch to every group of metrics; a step that logs several groups
                # (training, validation, epoch aggregates) gets one event, not one per group.
                if self._epoch_step == step:
                    continue
                self._epoch_step = step
            values.extend(scalar(f"{self._prefix}-{name}" if self._prefix else name, value).value)
        if values:
            # One event for the whole group (a Summary holds many values, as TensorBoard's merged summaries
            # do): one record and one hand-off to the writer's thread instead of one per scalar.
            writer.file_writer.add_summary(Summary(value=values), step)

    def state_dict(self) -> dict[str, Any]:
        """Return the version and the last step written (what a resumed run keeps of this run's events)."""
        return {**super().state_dict(), "last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's version, purging only what was written after its last step."""
        super().load_state_dict(state)
        if self.resuming and "last_step" in state:
            self._resumed_after = self._last_step = int(state["last_step"])
            # The checkpoint's run wrote the epoch at its last step already.
            self._epoch_step = self._resumed_after

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Any, metrics: dict[str, float] | None = None) -> None:
        """Save `params` (a dict or an `argparse.Namespace`) to ``hparams.yaml`` and as an HPARAMS-tab session of
        this run, with `metrics` (e.g. ``{"hp_metric": ...}``) as its values."""
        params = vars(params) if hasattr(params, "__dict__") and not isinstance(params, Mapping) else params
        if not params:
            return
        self.save_hparams_file(dict(params))
        if self.resuming:
            # The run that created this directory wrote the session already; writing now would open the
            # writer before the first resumed step is known, and that step is the purge step.
            return
        from torch.utils.tensorboard.summary import hparams

        if metrics is None:
            metrics = {"hp_metric": -1.0} if self.default_hp_metric else {}
        experiment, start, end = hparams(_flatten(params), metrics)
        # The plugin's summaries go to this run's own event file, not a sub-run as `add_hparams` would.
        file_writer = self.experiment.file_writer
        for summary in (experiment, start, end):
            file_writer.add_summary(summary)
        for name, value in metrics.items():
            self.experiment.add_scalar(name, value, 0)

    @rank_zero_only
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Add `model`'s graph, traced on `input_array` (default: its ``example_input_array``), when the logger
        was built with ``log_graph=True``."""
        if not self._log_graph:
            return
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        if input_array is None:
            rank_zero_warn(
                "Could not log the computational graph: neither `input_array` nor the model's `example_input_array` "
                "is set."
            )
            return
        tracing = getattr(model, "_jit_is_scripting", None)
        if tracing is not None:
            model._jit_is_scripting = True  # the tracer reads every property, `trainer` included
        try:
            self.experiment.add_graph(model, input_array)
        finally:
            if tracing is not None:
                model._jit_is_scripting = tracing

    @rank_zero_only
    def save(self) -> None:
        """Write ``hparams.yaml`` if the run has a directory and the file is missing (the events are flushed
        by the writer's own schedule and at `finalize`)."""
        # The Trainer calls this at every logging step: no file system call unless there is something to write.
        if self.hparams and not self._hparams_written and os.path.isdir(self.log_dir):
            if not os.path.isfile(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)):
                self.save_hparams_file({})
            self._hparams_written = True

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Return nested `params` as one level, keys joined by "/", values as numbers, bools or strings."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
