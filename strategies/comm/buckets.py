"""Gradient buckets: which parameters share a flat buffer, and where each gradient lives in it.

`assign_buckets` is the pure layout rule (the DDP paper's bucketing); `Bucket` and `Slot` are what
the reducer keeps per bucket and per parameter once the buffers exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.hooks import GradBucket

__all__ = ["Bucket", "Slot", "assign_buckets"]


@dataclass(eq=False)
class Bucket:
    """A bucket and its per-step state."""

    grad: GradBucket
    param_indices: list[int]
    future: Future[Tensor] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.grad.buffer.numel() * self.grad.buffer.element_size()


@dataclass(eq=False)
class Slot:
    """Where one parameter's gradient lives: its bucket and its view into the bucket's buffer."""

    bucket: int
    view: Tensor


def assign_buckets(
    params: Sequence[Tensor],
    order: Sequence[int],
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
) -> list[list[int]]:
    """Group parameter indices into buckets, walking `order` and never splitting a parameter.

    Parameters of different dtype or device go to different buckets. A bucket closes before it would
    exceed its cap, so it holds at most `bucket_cap_bytes` unless a single parameter is larger, in
    which case that parameter gets a bucket of its own. The first bucket of each dtype and device is
    capped at `first_bucket_cap_bytes`.

    Returns:
        Lists of indices into `params`, ordered by when their first parameter appears in `order`.
    """
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    buckets: list[list[int]] = []
    for index in order:
        param = params[index]
        key = (param.dtype, param.device)
        nbytes = param.numel() * param.element_size()
        cap = first_bucket_cap_bytes if closed_count.get(key, 0) == 0 else bucket_cap_bytes
        bucket = open_buckets.setdefault(key, [])
        if bucket and open_bytes[key] + nbytes > cap:
            buckets.append(bucket)
            closed_count[key] = closed_count.get(key, 0) + 1
            bucket = open_buckets[key] = []
        if not bucket:
            open_bytes[key] = 0
        bucket.append(index)
        open_bytes[key] += nbytes
    buckets.extend(bucket for bucket in open_buckets.values() if bucket)
    position = {index: pos for pos, index in enumerate(order)}
    buckets.sort(key=lambda bucket: position[bucket[0]])
    return buckets
