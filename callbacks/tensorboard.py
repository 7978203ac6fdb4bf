"""TensorBoardLogger (placeholder until the full logger lands)."""

from __future__ import annotations

import os
from typing import Any

from callbacks.logger import Logger

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(Logger):
    """Write TensorBoard events."""

    def __init__(self, save_dir: str, name: str = "logs", version: int | None = None) -> None:
        self.save_dir = save_dir
        self.name = name
        self.version = version or 0

    @property
    def log_dir(self) -> str:
        return os.path.join(self.save_dir, self.name, f"version_{self.version}")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass
