"""One way to count communication, shared by every strategy: `comm/bytes` and `comm/total_bytes`.

A strategy holds one `CommCounter` (`Strategy.comm_counter`) and adds to it the size of every tensor
it hands to a collective for gradient or model synchronization (the payload this rank passes in, not
what the backend moves on the wire: an all-gather of `n` bytes counts `n`, an all-reduce of `n` bytes
counts `n`). The optimizer step closes the step, so `comm/bytes` is what the last optimizer step cost,
accumulation window included, and `comm/total_bytes` everything since setup. Compression ratios are then
read straight off the logs: ``comm/bytes(strategy) / comm/bytes(bucketed_ddp)``.

Setup (the broadcast of rank 0's weights) and metric reductions are not synchronization of a step and
are not counted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

__all__ = ["CommCounter", "CommStats", "count_bytes"]


class CommCounter:
    """Bytes handed to collectives: in the last closed optimizer step, and since setup.

    Attributes:
        step_bytes: bytes of the last closed step (what `comm/bytes` reports).
        total_bytes: bytes since the counter was made (what `comm/total_bytes` reports).
        open_bytes: bytes since the last closed step, not yet part of `step_bytes`.
    """

    def __init__(self) -> None:
        self.step_bytes = 0
        self.total_bytes = 0
        self.open_bytes = 0
        # A communication thread (`comm/comm_thread.py`) counts while the main thread does.
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """Count `nbytes` handed to a collective in the current step (from any thread)."""
        with self._lock:
            self.open_bytes += int(nbytes)
            self.total_bytes += int(nbytes)

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def absorb(self, other: CommCounter) -> None:
        """Count in the current step everything `other` counted (a transfer counted apart, joined when it lands)."""
        self.add(other.total_bytes)

    def add_tensors(self, *tensors: Tensor) -> None:
        """Count the sizes of `tensors`, each handed to a collective."""
        for tensor in tensors:
            self.add(tensor.numel() * tensor.element_size())

    def close_step(self) -> None:
        """End an optimizer step: what was counted since the last close becomes `step_bytes`."""
        self.step_bytes = self.open_bytes
        self.open_bytes = 0

    def reset(self) -> None:
        """Start counting from zero (a new run), keeping this object (collectives may hold it)."""
        self.step_bytes = self.total_bytes = self.open_bytes = 0

    def state_dict(self) -> dict[str, int]:
        """Return the counters, for a checkpoint (so a resumed run logs the same totals)."""
        return {"step_bytes": self.step_bytes, "total_bytes": self.total_bytes, "open_bytes": self.open_bytes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters saved by `state_dict`."""
        self.step_bytes, self.total_bytes = int(state["step_bytes"]), int(state["total_bytes"])
        self.open_bytes = int(state.get("open_bytes", 0))

    def as_dict(self) -> dict[str, float]:
        """Return ``{"comm/bytes": ..., "comm/total_bytes": ...}`` as the loop logs them."""
        return {"comm/bytes": float(self.step_bytes), "comm/total_bytes": float(self.total_bytes)}


def count_bytes(counter: CommCounter | None, *tensors: Tensor) -> None:
    """Count `tensors` as handed to a collective in `counter` (a hook's state may hold None: count nothing)."""
    if counter is not None:
        counter.add_tensors(*tensors)


@dataclass
class CommStats:
    """Communication of the last synchronized backward.

    Attributes:
        collectives: collectives launched (one per bucket, plus the used-parameter map).
        bytes: bytes handed to collectives by the comm hook (what it sends, compressed or not) and by
            the used-parameter all-reduce.
        exposed_ms: time the end of backward spent waiting for communication.
        buckets: number of buckets.
        skipped_backwards: backwards without synchronization since the previous synchronized one.
    """

    collectives: int = 0
    bytes: int = 0
    exposed_ms: float = 0.0
    buckets: int = 0
    skipped_backwards: int = 0

    def as_dict(self) -> dict[str, float]:
        """Return the counters under `comm/<name>` keys, as the loop logs them."""
        return {f"comm/{f.name}": float(getattr(self, f.name)) for f in fields(self)}
