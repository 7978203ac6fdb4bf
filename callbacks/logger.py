"""The `Logger` base class: where logged metrics and hyperparameters are written."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["DummyLogger", "Logger"]


class Logger(ABC):
    """Write metrics somewhere. The Trainer calls these on global rank 0 only.

    A logger's files live under `log_dir`; checkpoints default to ``log_dir/checkpoints``.
    """

    @property
    @abstractmethod
    def log_dir(self) -> str:
        """Directory of this run's files."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record scalar `metrics` at optimizer step `step`."""

    def log_hyperparams(self, params: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Record the run's hyperparameters."""

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Record the model's graph (loggers that can draw one)."""

    def save(self) -> None:
        """Write what is buffered (hyperparameters, rows) to disk."""

    def finalize(self, status: str) -> None:
        """Flush and close; `status` is "success", "failed" or "interrupted"."""

    def state_dict(self) -> dict[str, Any]:
        """Return what a resumed run needs to continue writing to the same place."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, before anything is written."""


class DummyLogger(Logger):
    """Write nothing: what `Trainer(fast_dev_run=...)` puts in place of the loggers, as Lightning does.

    Args:
        log_dir: what `log_dir` reports (the Trainer's `default_root_dir`); nothing is written there.
    """

    def __init__(self, log_dir: str) -> None:
        self._log_dir = log_dir

    @property
    def log_dir(self) -> str:
        """The directory reported to callbacks; nothing is written there."""
        return self._log_dir

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Drop `metrics`."""
