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

    #: False in subclasses whose collectives a joined rank cannot shadow with zeros (compressed
    #: gradients with error feedback, averaged parameters): they keep uneven_inputs="check".
    supports_join: bool = True

    #: The rank whose buffers a forward takes: the highest rank that still has data (the loop sets it
    #: in every round under join; a joined rank's buffers are stale), as torch's DDP join chooses.
    buffer_source: int = 0

    def enable_join(self) -> None:
        """Prepare, before `setup`, for ranks that join (`Trainer(uneven_inputs="join")`).

        Raises:
            ValueError: an option of the strategy rules joining out, named in the message.
        """

    def finish_join(self) -> None:
        """After the last round in which any rank had data: give every rank the last joiner's buffers.

        torch's `Join` ends the same way (its DDP hook's `post_hook`); parameters need nothing, since a
        joined rank stepped on the same averaged gradients.
        """

    def shadow_forward(self) -> None:
        """Launch the collectives the others' `training_step` launches (e.g. a buffer broadcast)."""

    def shadow_backward(self) -> None:
        """Take part in the others' synchronized backward with zero gradients, and end with their average."""
        raise NotImplementedError
