"""Let the loop tell a data-parallel strategy, before the forward, whether the next backward syncs.

The loop knows per micro-batch whether its backward ends an accumulation window. It says so twice:

    strategy.sync_next_backward = sync          # before the forward
    output = strategy.training_step(task, batch, batch_idx)
    strategy.backward(loss, sync=sync)          # the same value

torch's `DistributedDataParallel` decides in its *forward* whether the coming backward all-reduces, so
`NativeDDP` needs the first line; `BucketedDDP` decides in `backward` and needs only the last. Both
take the flag, so the loop is the same for either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BackwardSyncControl"]


class BackwardSyncControl:
    """Mixin for strategies whose gradient synchronization can be skipped per micro-batch."""

    #: Whether the backward after the next `training_step` synchronizes gradients.
    sync_next_backward: bool = True
    _sync_disabled: bool = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronization for every forward and backward inside the block.

        For hand-written loops: gradients accumulate locally, and the first synchronizing backward
        after the block communicates their sum.
        """
        previous = self._sync_disabled
        self._sync_disabled = True
        try:
            yield
        finally:
            self._sync_disabled = previous

    def _backward_syncs(self, sync: bool) -> bool:
        """Return whether a backward asked to `sync` really does, given `no_sync` blocks."""
        return sync and not self._sync_disabled
