"""Let a rank whose data ran out keep matching the others' collectives (Join, as in torch's DDP `join()`).

A joined rank has no batch, but the ranks that still have one launch their step's collectives and
would wait forever for it. A strategy that can shadow them implements this mixin: the loop calls
`shadow_forward` where the others run `training_step` and `shadow_backward` where they run a
synchronized `backward`. The joined rank contributes zero gradients, and the average stays divided by
the whole world size (torch's DDP default, `divide_by_initial_world_size=True`): a joined rank counts as
a replica whose gradient is zero. It then steps its optimizer on the same averaged gradients, so its
replica stays equal to the others' without a final broadcast.
"""

from __future__ import annotations

__all__ = ["Joinable"]


class Joinable:
    """Mixin for strategies whose per-step collectives a rank without data can shadow."""

    def shadow_forward(self) -> None:
        """Launch the collectives the others' `training_step` launches (e.g. a buffer broadcast)."""

    def shadow_backward(self) -> None:
        """Take part in the others' synchronized backward with zero gradients, and end with their average."""
        raise NotImplementedError
