"""Buckets of a chosen set of tensors: what an algorithm averages besides gradients, through the same comm hooks.

What is synchronized is a choice of tensors, not a new reducer (BAGUA's `init_tensors`): QAdam averages Adam's
momentum, not the gradients, with the 8-bit hook ByteGrad runs on gradient buckets. `Reducer.average_tensors`
hands such a set here: the tensors are laid out in flat buckets of the reducer's cap (in the order given, one
dtype and device per bucket, a tensor never split), each bucket goes through the comm hook as a gradient bucket
would, and the averages are copied back into the tensors. Unlike gradients, nothing here overlaps a backward: the
caller has every tensor when it asks, so each bucket is launched and waited for in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from syncline.strategies.comm.buckets import assign_buckets
from syncline.strategies.comm.hooks import CommHook, GradBucket
from syncline.strategies.comm.reducer_errors import wait_for_future

__all__ = ["average_tensors"]


@torch.no_grad()
def average_tensors(
    named_tensors: Sequence[tuple[str, Tensor]],
    comm_hook: CommHook,
    comm_state: Any,
    *,
    cap_bytes: int,
    timeout: float,
    what: str = "tensor bucket",
) -> None:
    """Average `named_tensors` in place across the hook's group, one bucket of at most `cap_bytes` at a time.

    Args:
        named_tensors: (name, tensor) pairs; the names key the hook's per-tensor state (error feedback).
        comm_hook: ``hook(state, bucket) -> Future[Tensor]``, as for gradient buckets.
        comm_state: the state passed to `comm_hook` (it counts the bytes it sends).
        cap_bytes: the most bytes per bucket (a larger tensor gets a bucket of its own).
        timeout: seconds one bucket's collective may take before it fails with an error.
        what: how an error names the buckets.
    """
    names = [name for name, _ in named_tensors]
    tensors = [tensor for _, tensor in named_tensors]
    layout = assign_buckets(tensors, range(len(tensors)), cap_bytes, cap_bytes)
    for index, members in enumerate(layout):
        chosen = [tensors[i] for i in members]
        sizes = [tensor.numel() for tensor in chosen]
        offsets = [sum(sizes[:position]) for position in range(len(sizes))]
        buffer = torch.cat([tensor.reshape(-1) for tensor in chosen])
        bucket = GradBucket(index, buffer, chosen, offsets, [names[i] for i in members])  # type: ignore[arg-type]
        # Collective (inside the hook): this bucket's average across the group.
        result = wait_for_future(comm_hook(comm_state, bucket), timeout, f"{what} {index} ({buffer.nbytes} bytes)")
        for tensor, average in zip(chosen, result.split(sizes)):
            tensor.copy_(average.view_as(tensor))
