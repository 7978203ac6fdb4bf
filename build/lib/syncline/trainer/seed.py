"""Seeding and deterministic mode."""

from __future__ import annotations

import os
import random

import torch

__all__ = ["seed_everything", "set_deterministic"]


def seed_everything(seed: int) -> int:
    """Seed python, numpy (if installed) and torch on every device.

    DataLoader workers need nothing more: each worker seeds python, numpy and torch from a base seed
    that the loader draws from torch's generator, so they follow from this seed too. The seed is also
    exported as ``SYNCLINE_SEED`` so processes started later see it.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    os.environ["SYNCLINE_SEED"] = str(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed


def set_deterministic(enabled: bool) -> None:
    """Ask torch for deterministic kernels (errors on ops that have none) when `enabled`."""
    if not enabled:
        return
    # cuBLAS needs a fixed workspace to be deterministic; must be set before the first cuBLAS call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
