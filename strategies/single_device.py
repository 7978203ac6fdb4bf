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
        self._chosen = device is not None
        self._device = torch.device(device) if device is not None else default_device()

    def use_accelerator(self, device_type: str) -> None:
        if not self._chosen:
            self._device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
        super().use_accelerator(device_type)

    @property
    def root_device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return f"SingleDevice(device={str(self._device)!r})"
