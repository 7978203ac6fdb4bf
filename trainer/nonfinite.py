"""A NaN or inf loss on any rank: every rank stops, or skips the optimizer step, alike and at the same step.

Each rank folds its micro-batches' losses into one flag on the device as they come (no host sync), and
at the end of an accumulation window, before the synchronized backward, the ranks exchange their flags
in one all-reduce of `world_size` numbers. Every rank thus sees the same verdict, and the message names
the ranks and the step. With "skip" the window's backward never runs (its gradients never reach a
collective, so a strategy's state such as error-feedback memory stays clean), its gradients are
dropped, and no optimizer step is taken: the replicas stay equal.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from syncline.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from syncline.strategies.strategy import Strategy

__all__ = ["NONFINITE_LOSS", "NonfiniteLossError", "NonfiniteLossGuard"]

#: What `Trainer(nonfinite_loss=...)` accepts.
NONFINITE_LOSS = ("raise", "skip")


class NonfiniteLossError(FloatingPointError):
    """Some rank's loss was NaN or inf; raised on every rank at the same step."""

    #: The ranks whose loss was not finite (a launch names them, not the rank whose error came first).
    ranks: tuple[int, ...] = ()


class NonfiniteLossGuard:
    """Check an accumulation window's losses on every rank once, at the window's end."""

    def __init__(self, mode: str, strategy: Strategy) -> None:
        self.mode = mode
        self.strategy = strategy
        #: The losses of the window so far (references only: nothing is computed until the window ends).
        self._losses: list[Tensor] = []
        #: Windows skipped so far in this process (with "skip").
        self.skipped = 0
        #: One process, whatever happens during the fit (a multi-process strategy may run a world of one for a
        #: while): the verdict is this process's own, with nothing to agree on.
        self._alone = not strategy.multi_process

    def observe(self, loss: Tensor) -> None:
        """Remember `loss` for the check at the window's end (no op, no host sync)."""
        self._losses.append(loss)

    def check(self, loss: Tensor, window_end: bool, step: int, batch_idx: int) -> bool:
        """Observe `loss`; at the end of its window return `window_is_finite` (True before the end).

        Raises:
            NonfiniteLossError: as `window_is_finite`.
        """
        # Host sync: the verdict decides what runs next. A window of one loss in one process: one read.
        if window_end and self._alone and not self._losses and math.isfinite(loss.item()):
            return True
        self._losses.append(loss)
        return not window_end or self.window_is_finite(step, batch_idx)

    def window_is_finite(self, step: int, batch_idx: int) -> bool:
        """Return whether every rank's losses of the window were finite; the same answer on every rank.

        Raises:
            NonfiniteLossError: some rank's were not and the mode is "raise" (on every rank alike).
        """
        losses, self._losses = self._losses, []
        world = self.strategy.world_size
        if world == 1:
            # Host sync: the verdict decides what runs next. One read per loss, nothing to agree on.
            if len(losses) == 1:  # the common case (no accumulation): no generator per step
                if math.isfinite(losses[0].item()):
                    return True
            elif all(math.isfinite(loss.item()) for loss in losses):
                return True
            bad_ranks = [0]
        else:
            rank = self.strategy.global_rank
            device = losses[0].device if losses else self.strategy.root_device
            flags = torch.zeros(world, device=device)
            if losses:
                bad = ~torch.isfinite(torch.stack([loss.detach().reshape(()) for loss in losses])).all()
                flags[rank] = bad.to(flags.dtype)
            # Collective: one all-reduce of world_size flags per optimizer step.
            flags = self.strategy.reduce(flags, "sum")
            # Host sync: the verdict decides what every rank runs next.
            bad_ranks = [r for r, flag in enumerate(flags.tolist()) if flag]
        if not bad_ranks:
            return True
        where = f"rank{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))}"
        message = (
            f"The training loss was NaN or inf on {where} of {world} at global_step {step} "
            f"(the accumulation window ending at batch {batch_idx})"
        )
        if self.mode == "raise":
            error = NonfiniteLossError(
                f"{message}; every rank stopped here, before the step. Check the data and the learning rate, "
                'use precision="bf16-mixed" or gradient clipping, or pass Trainer(nonfinite_loss="skip") to '
                "skip such steps."
            )
            error.ranks = tuple(bad_ranks)
            raise error
        self.skipped += 1
        rank_zero_warn(f"{message}; the step was skipped on every rank (nonfinite_loss='skip').")
        return False
