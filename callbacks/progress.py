"""ProgressBar (placeholder until the full callback lands)."""

from __future__ import annotations

from callbacks.callback import Callback

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """Show progress."""
