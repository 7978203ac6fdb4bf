"""ModelCheckpoint (placeholder until the full callback lands)."""

from __future__ import annotations

from callbacks.callback import Callback

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(Callback):
    """Save checkpoints."""

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
