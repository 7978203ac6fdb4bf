"""Numeric precision of the forward and backward: full fp32, bf16 autocast, or fp16 autocast + scaling."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["PRECISIONS", "Precision"]

#: Accepted spellings, each mapped to its canonical name.
PRECISIONS: dict[str, str] = {
    "32": "32",
    "32-true": "32",
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "16-mixed",
}


class Precision:
    """Run the forward under autocast and scale the fp16 loss, as the precision setting asks.

    Args:
        precision: "32", "bf16-mixed" or "16-mixed" (int 32 and "32-true" also mean fp32).
        device: the device the task computes on; some precisions need CUDA.

    Raises:
        ValueError: the precision is unknown or this device cannot run it.
    """

    def __init__(self, precision: str | int, device: torch.device) -> None:
        name = PRECISIONS.get(str(precision))
        if name is None:
            raise ValueError(f"Unknown precision {precision!r}. Valid values: {', '.join(sorted(set(PRECISIONS)))}.")
        if name == "16-mixed" and device.type != "cuda":
            raise ValueError(
                f"precision='16-mixed' needs a CUDA device (this run is on {device.type}): fp16 autocast "
                "with loss scaling is a GPU technique. Use precision='bf16-mixed' on the CPU."
            )
        if name == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                "precision='bf16-mixed' needs a GPU with bfloat16 support (Ampere or newer); "
                "use precision='16-mixed' on this GPU."
            )
        self.name = name
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if name == "16-mixed" else None
        self._dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Return the context the forward runs in."""
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._dtype)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Scale the loss so fp16 gradients do not underflow (identity otherwise)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale before clipping or inspection."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        """Return the function that takes the optimizer step (skipping it on fp16 overflow)."""
        if self.scaler is None:
            return optimizer.step
        scaler = self.scaler

        def scaled_step() -> None:
            scaler.step(optimizer)
            scaler.update()

        return scaled_step

    def state_dict(self) -> dict[str, Any]:
        """Return the loss scaler's state (empty without one)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss scaler's state."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
