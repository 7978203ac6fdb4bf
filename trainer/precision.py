"""Numeric precision of the forward and backward: full fp32, bf16 autocast, or fp16 autocast + scaling.

With fp16 and several processes, the loss scaler's verdict must be the same on every rank: a step is
skipped everywhere or nowhere, and every rank's scale moves alike. Gradients averaged by an all-reduce
carry one rank's inf to every rank, but local steps (local SGD, decentralized, asynchronous averaging,
QAdam after its warm-up) and compressed gradients need not. So after `unscale_` has looked at this
rank's gradients, the strategy's `any_rank_found_inf` combines every rank's flag (one all-reduce (max)
of one number) before `scaler.step` reads it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

if TYPE_CHECKING:
    from syncline.strategies.strategy import Strategy

__all__ = ["PRECISIONS", "Precision", "fp16_autocast_available"]

#: Accepted spellings (Lightning's, its older short ones included), each mapped to its canonical name.
PRECISIONS: dict[str, str] = {
    "32": "32",
    "32-true": "32",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
    "16-mixed": "16-mixed",
    "16": "16-mixed",
}


class Precision:
    """Run the forward under autocast and scale the fp16 loss, as the precision setting asks.

    Args:
        precision: "32", "bf16-mixed" or "16-mixed" (int 32 and "32-true" also mean fp32).
        device: the device the task computes on; some precisions need CUDA.
        strategy: the run's strategy, whose `any_rank_found_inf` makes the loss scaler's verdict the
            same on every rank; None for one process.

    Raises:
        ValueError: the precision is unknown or this device cannot run it.
    """

    def __init__(self, precision: str | int, device: torch.device, strategy: Strategy | None = None) -> None:
        name = PRECISIONS.get(str(precision))
        if name is None:
            raise ValueError(f"Unknown precision {precision!r}. Valid values: {', '.join(sorted(set(PRECISIONS)))}.")
        if name == "16-mixed" and not fp16_autocast_available(device.type):
            raise ValueError(
                f"precision='16-mixed' needs float16 autocast on {device.type}, which this torch "
                f"({torch.__version__}) does not offer. Use precision='bf16-mixed' (no loss scaling needed)."
            )
        if name == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                "precision='bf16-mixed' needs a GPU with bfloat16 support (Ampere or newer); "
                "use precision='16-mixed' on this GPU."
            )
        self.name = name
        self.device = device
        self.strategy = strategy
        self.scaler = torch.amp.GradScaler(device.type) if name == "16-mixed" else None
        self._dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
        #: Whether the forward runs under autocast (`autocast` returns a context that does nothing otherwise).
        self.autocasts = self._dtype is not None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Return the context the forward runs in."""
        if self._dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self._dtype)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Scale the loss so fp16 gradients do not underflow (identity otherwise)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale, and agree across ranks on whether any was inf or NaN.

        Call once per optimizer step, before clipping or inspection and before `step`.
        """
        if self.scaler is None or self._unscaled(optimizer):
            return  # clip_gradients in a manual step unscaled them already; the step must not do it twice
        self.scaler.unscale_(optimizer)
        if self.strategy is None or self.strategy.world_size == 1:
            return
        # GradScaler keeps unscale_'s verdict per device in its per-optimizer state, where step() reads
        # it; torch's own ShardedGradScaler (FSDP) reduces the same tensors across ranks.
        found = self.scaler._found_inf_per_device(optimizer)
        local = torch.stack([flag.to(self.device) for flag in found.values()]).amax() if found else None
        if local is None:
            local = torch.zeros((), device=self.device)
        # Collective (inside): every rank learns whether any rank's gradients overflowed.
        anywhere = self.strategy.any_rank_found_inf(local.reshape(1).float())
        for flag in found.values():
            flag.copy_(anywhere.reshape(()).to(flag.device))

    def _unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `unscale_` ran for `optimizer` since the scaler's last update."""
        assert self.scaler is not None
        state = self.scaler._per_optimizer_states.get(id(optimizer))
        return state is not None and state["stage"] is OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        """Return the function that takes the optimizer step (skipping it on fp16 overflow).

        The function calls ``optimizer.step()`` when it runs (not a bound method taken now), so a
        strategy that replaces the update for one step (`strategies.strategy.replace_step`) still goes
        through the loss scaler: skipped on overflow, the scale updated either way. The loop makes it once per
        fit (a partial, not a closure: the Trainer holding it is pickled to start spawned workers).
        """
        if self.scaler is None:
            return functools.partial(_step, optimizer)
        return functools.partial(_scaled_step, self.scaler, optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Return the loss scaler's state (empty without one)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss scaler's state."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


#: The forward's context without autocast (a nullcontext is reusable, so one serves every step).
_NO_AUTOCAST = contextlib.nullcontext()


def fp16_autocast_available(device_type: str) -> bool:
    """Whether `torch.autocast(device_type, dtype=torch.float16)` really runs in float16 here.

    torch builds that lack it warn and disable autocast instead of raising; the probe reads the result.
    """
    if device_type == "cuda":
        return True
    if not torch.amp.is_autocast_available(device_type):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device_type, dtype=torch.float16):
            return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _scaled_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    scaler.step(optimizer)
    scaler.update()
