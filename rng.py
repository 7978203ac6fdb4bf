"""The random number generators' states: captured, restored, and kept out of the training streams by validation.

A checkpoint keeps these states so a resumed run draws the same numbers (dropout, data order) as an
uninterrupted one; every floor that saves, launches or evaluates uses them.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional: torch runs without it
    np = None  # type: ignore[assignment]

__all__ = ["capture_rng", "isolated_rng", "restore_rng", "training_rng"]


def capture_rng() -> dict[str, Any]:
    """Return the RNG states of python, numpy (if installed), torch and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        # Stored as plain lists so checkpoints load with `weights_only=True`.
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore RNG states returned by `capture_rng`."""
    if not state:
        return
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


#: RNG states saved by the `isolated_rng` blocks in progress, outermost first.
_ISOLATED: list[dict[str, Any]] = []


class isolated_rng:
    """Run a block without moving the training RNG streams.

    Validation runs inside this, so whether and when it runs never changes the training run's random
    numbers (dropout, data order): resumed runs stay bit-exact, and adding validation does not
    change the trained weights.
    """

    def __enter__(self) -> None:
        self._state = capture_rng()
        _ISOLATED.append(self._state)

    def __exit__(self, *exc: object) -> None:
        _ISOLATED.pop()
        restore_rng(self._state)


def training_rng() -> dict[str, Any]:
    """Return the RNG states training continues from: the current ones, or, inside `isolated_rng`
    (a checkpoint taken during validation), those the outermost block will restore."""
    return _ISOLATED[0] if _ISOLATED else capture_rng()
