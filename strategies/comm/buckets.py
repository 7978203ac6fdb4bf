"""Gradient buckets: which parameters share a flat buffer, and where each gradient lives in it.

`assign_buckets` is the pure layout rule (the DDP paper's bucketing); `Bucket` and `Slot` are what
the reducer keeps per bucket and per parameter once the buffers exist; `GradientBuckets` holds the
buffers and the gradients' views into them, which the reducer fills, reduces and hands back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.hooks import GradBucket
from syncline.strategies.comm.reducer_errors import sparse_gradient_message

__all__ = ["Bucket", "GradientBuckets", "Slot", "assign_buckets"]


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

    def take(self, result: Tensor) -> None:
        """Leave the collective's `result` in the buffer (a comm hook may reduce in place or return a new tensor)."""
        self.future = None  # done with it: its collective's resources go now, not next step
        buffer = self.grad.buffer
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)


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


class GradientBuckets:
    """Where the gradients of the reducer's dense parameters live: one flat buffer per bucket, a view per parameter.

    The reducer decides *when* a bucket is reduced; this holds *where* each gradient is: it lays the buffers
    out (`relayout`, with `assign_buckets` and the caps), moves a gradient that is not a view into its slot
    (`fill`), hands the averages back to `.grad` (`write_back`) and resets gradients cheaply (`zero_grad`).

    Args:
        params: the parameters, in the reducer's order.
        names: their qualified names (for errors and the buckets' per-parameter state).
        is_sparse: per parameter, whether its gradient is sparse (then it has no slot).
        as_view: make each `param.grad` a view into its bucket (`gradient_as_bucket_view`).
        rank: this process's rank, for error messages.
        cap_bytes: the most bytes of gradients in one bucket; `first_cap_bytes` that of the first bucket.

    Attributes:
        buckets: the buckets, in launch order.
        slots: per parameter, its bucket and view (None for a sparse gradient).
        views: the views alone (None for sparse gradients), and `bucket_of` each one's bucket (-1), as flat
            lists for the reducer's per-step loops.
        has_grad: per parameter, whether `.grad` holds a value (a gradient, or the user's) since the last
            `zero_grad`; a zero bucket view attached for speed does not count. Changed in place only.
    """

    def __init__(
        self,
        params: list[Tensor],
        names: list[str],
        is_sparse: list[bool],
        as_view: bool,
        rank: int,
        cap_bytes: int,
        first_cap_bytes: int,
    ) -> None:
        self.params, self.names, self.is_sparse, self.as_view, self.rank = params, names, is_sparse, as_view, rank
        self.cap_bytes, self.first_cap_bytes = cap_bytes, first_cap_bytes
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self.buckets: list[Bucket] = []
        self.slots: list[Slot | None] = []
        self.views: list[Tensor | None] = []
        self.bucket_of: list[int] = []
        self.has_grad = [p.grad is not None for p in params]

    def relayout(self, order: list[int], *, attach_missing: bool = False) -> bool:
        """Lay the dense parameters' buckets out in `order` with the caps; build new buffers only if that changes them.

        Returns:
            Whether the buffers were built anew.
        """
        dense = [index for index in order if not self.is_sparse[index]]
        layout = assign_buckets(self.params, dense, self.cap_bytes, self.first_cap_bytes)
        if self.buckets and layout == [bucket.param_indices for bucket in self.buckets]:
            return False
        self.build(layout, attach_missing=attach_missing)
        return True

    def build(self, layout: list[list[int]], *, attach_missing: bool) -> None:
        """Allocate one flat buffer per bucket of `layout` (lists of parameter indices) and move the gradients in.

        Args:
            layout: the buckets, in launch order (`assign_buckets`).
            attach_missing: in view mode, give parameters without a gradient a zero view; at
                construction that saves a copy on the first step, while at a rebuild a missing
                gradient must stay missing.
        """
        slots: list[Slot | None] = [None] * len(self.params)
        buckets = []
        for bucket_index, indices in enumerate(layout):
            first = self.params[indices[0]]
            offsets = []
            total = 0
            for index in indices:
                offsets.append(total)
                total += self.params[index].numel()
            buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
            for index, offset in zip(indices, offsets):
                param = self.params[index]
                view = buffer[offset : offset + param.numel()].view(param.shape)
                slots[index] = Slot(bucket=bucket_index, view=view)
                with torch.no_grad():
                    if param.grad is not None:
                        view.copy_(param.grad)
                if self.as_view and (param.grad is not None or attach_missing):
                    param.grad = view
            params = [self.params[i] for i in indices]
            names = [self.names[i] for i in indices]
            buckets.append(Bucket(GradBucket(bucket_index, buffer, params, offsets, names), list(indices)))
        assert all((slot is None) == sparse for slot, sparse in zip(slots, self.is_sparse)), (
            "every dense parameter belongs to exactly one bucket"
        )
        self.buckets = buckets
        self.slots = slots
        self.views = [None if slot is None else slot.view for slot in slots]
        self.bucket_of = [-1 if slot is None else slot.bucket for slot in slots]

    def fill(self, index: int) -> None:
        """Put a gradient that is not (yet) a bucket view into its slot: copy it, or zeros for None."""
        slot = self.slots[index]
        assert slot is not None
        param = self.params[index]
        grad = param.grad
        if grad is None:
            # Unused so far: contribute zeros, and leave .grad alone unless some rank used it.
            slot.view.zero_()
            return
        if grad.layout != torch.strided:
            raise TypeError(sparse_gradient_message(self.rank, self.names[index], grad.layout))
        slot.view.copy_(grad)
        if self.as_view:
            # The user replaced .grad (e.g. set it to None); point it back into the bucket.
            param.grad = slot.view

    def write_back(self, globally_used: list[bool] | None, candidates: Iterable[int]) -> None:
        """Make each used parameter of `candidates` hold its bucket's average; leave unused ones untouched."""
        for index in candidates:
            param = self.params[index]
            slot = self.slots[index]
            if slot is None or (globally_used is not None and not globally_used[index]):
                continue
            view = slot.view
            grad = param.grad
            self.has_grad[index] = True
            if self.as_view:
                if grad is None:
                    param.grad = view
            elif grad is None:
                param.grad = view.clone()
            else:
                grad.copy_(view)

    def drop_unused(self, globally_used: list[bool], candidates: Iterable[int]) -> None:
        """Set `.grad` to None for parameters no rank used and that held no gradient, as torch leaves them."""
        for index in candidates:
            if not globally_used[index] and not self.has_grad[index]:
                self.params[index].grad = None

    def zero_grad(self, params: Sequence[Tensor]) -> None:
        """Reset the gradients of `params` as `optimizer.zero_grad()` (set to None) would, but cheaply.

        Bucket views are zeroed in place and stay attached, so the next backward accumulates into them
        without a copy; a parameter that then receives no gradient on any rank ends the next
        synchronized backward with `.grad` None, exactly as if it had been set to None here.
        Parameters outside the buckets, and gradients that are not views, are set to None.
        """
        if not self.as_view:
            for param in params:
                param.grad = None
            return
        wanted = {id(param) for param in params}
        if wanted.issuperset(self.index_of):
            # Every parameter of the reducer is reset (the usual case): one memset per bucket instead
            # of one per parameter, and one pass that only detaches what is not a view.
            for bucket in self.buckets:
                bucket.grad.buffer.zero_()
            self.has_grad[:] = [False] * len(self.params)
            for param, view in zip(self.params, self.views):
                if param.grad is not view:
                    param.grad = None  # a gradient the user put there, or a sparse one
            if len(wanted) > len(self.params):
                for param in params:
                    if id(param) not in self.index_of:
                        param.grad = None
            return
        for param in params:
            index = self.index_of.get(id(param))
            if index is None:
                param.grad = None
                continue
            self.has_grad[index] = False
            slot = self.slots[index]
            if slot is None or param.grad is not slot.view:
                param.grad = None  # a gradient the user put there: the next backward copies into the view
            else:
                slot.view.zero_()
