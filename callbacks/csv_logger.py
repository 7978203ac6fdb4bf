"""CSVLogger (placeholder until the full implementation lands)."""

from __future__ import annotations

from callbacks.callback import Callback

__all__ = ["CSVLogger"]


class CSVLogger(Callback):
    """Placeholder."""
