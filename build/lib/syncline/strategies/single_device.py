"""One process, one device: the strategy every other one reduces to when world size is 1."""

from __future__ import annotations

import torch

from syncline.strategies.strategy import Strategy

__all__ = ["SingleDevice", "default_device"]


def default_device() -> torch.device:
    """Return the first CUDA device when there is one, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class SingleDevice(Strategy):
    """Train in this process on one device, with no gradient synchronization.

    Args:
        device: where to compute, for example ``"cpu"`` or ``"cuda:0"``; None picks the first CUDA
            device when there is one, else the CPU.
    """

    name = "single"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self._device = torch.device(device) if device is not None else default_device()

    @property
    def root_device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return f"SingleDevice(device={str(self._device)!r})"
