"""Flat buffers by dtype: many tensors as one contiguous tensor per dtype and device, and back.

A collective over many small tensors costs one launch each; the strategies that send many tensors at once
(a broadcast of the parameters, an all-reduce of the models, fused gradients, PowerSGD's factors) send one
flat copy per dtype and device instead, and copy the result back into the tensors.

    for tensors, flat in flatten_by_dtype(params):   # one group per (dtype, device)
        dist.all_reduce(flat)                        # one collective per group
        unflatten_into(tensors, flat)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["flatten", "flatten_by_dtype", "group_by_dtype", "unflatten", "read_range", "unflatten_into", "write_range"]


def group_by_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """Group `tensors` by (dtype, device), in order within a group; groups in the order they first appear."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(groups.values())


def flatten(tensors: Iterable[Tensor]) -> Tensor:
    """Return one new flat tensor holding `tensors` one after the other (all of one dtype and device)."""
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def unflatten(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Cut `flat` into views shaped as the tensors of `like` (the inverse of `flatten`, without a copy)."""
    return [piece.view_as(tensor) for piece, tensor in zip(flat.split([t.numel() for t in like]), like)]


def unflatten_into(tensors: list[Tensor], flat: Tensor) -> None:
    """Copy `flat` back into `tensors` (the inverse of `flatten`)."""
    with torch.no_grad():
        for tensor, value in zip(tensors, unflatten(flat, tensors)):
            tensor.copy_(value)


def flatten_by_dtype(tensors: Iterable[Tensor]) -> list[tuple[list[Tensor], Tensor]]:
    """Return, per (dtype, device), the tensors and one flat copy of them (what one collective sends)."""
    return [(group, flatten(group)) for group in group_by_dtype(tensors)]


@torch.no_grad()
def read_range(tensors: list[Tensor], start: int, end: int) -> Tensor:
    """Return a copy of elements [start, end) of the flat concatenation of `tensors`, without flattening the rest."""
    parts, offset = [], 0
    for tensor in tensors:
        first, last = max(start, offset), min(end, offset + tensor.numel())
        if first < last:
            parts.append(tensor.detach().view(-1)[first - offset : last - offset])
        offset += tensor.numel()
    return torch.cat(parts) if parts else tensors[0].detach().new_empty(0)


@torch.no_grad()
def write_range(tensors: list[Tensor], start: int, end: int, values: Tensor) -> None:
    """Write `values` into elements [start, end) of the flat concatenation of `tensors` (a range's `unflatten_into`)."""
    offset = 0
    for tensor in tensors:
        first, last = max(start, offset), min(end, offset + tensor.numel())
        if first < last:
            tensor.view(-1)[first - offset : last - offset].copy_(values[first - start : last - start])
        offset += tensor.numel()
