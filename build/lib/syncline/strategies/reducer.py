"""The gradient reducer of data-parallel training (Li et al., *PyTorch Distributed*, VLDB 2020).

Every rank holds a full replica of the model and computes gradients on its own shard of the batch.
The reducer averages those gradients across ranks while the backward pass is still running:

1. **Buckets.** Parameters are grouped into flat buffers of at most `bucket_cap_mb` (the first one
   smaller, so communication starts early), in reverse registration order as a guess of the order in
   which gradients become ready. After the first synchronized backward the buckets are rebuilt once
   in the order rank 0 actually observed.
2. **Views.** With `gradient_as_bucket_view`, each `param.grad` *is* a view into its bucket, so
   autograd accumulates straight into the buffer and no copy is made per step.
3. **Overlap.** A post-accumulate-grad hook marks a parameter ready; when the last parameter of a
   bucket is ready and every earlier bucket has been launched, the bucket's comm hook starts an
   asynchronous all-reduce. Buckets launch in the same order on every rank.
4. **Finalize.** After `loss.backward()` returns, the reducer waits for the outstanding collectives
   (the exposed, non-overlapped part of communication) and writes the averages back.
5. **Skip sync.** A backward that does not synchronize leaves gradients to accumulate locally; the
   next synchronizing backward communicates the sum.
6. **Unused parameters.** With `find_unused_parameters`, the autograd graph of the forward's outputs is
   walked before the backward, and parameters it does not reach are marked ready up front so that no
   bucket waits for a gradient that will never come. Without it, such a parameter is an error.

The reducer's public surface is `prepare_for_backward` (before `loss.backward()`) and
`finalize_backward` (after it); `BucketedDDP` calls both.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future
from torch.nn import Parameter

from syncline.strategies.comm_hooks import AllreduceState, CommHook, GradBucket, allreduce_hook

__all__ = [
    "CollectiveError",
    "CommStats",
    "Reducer",
    "UnusedParametersError",
    "assign_buckets",
]

_MB = 1024 * 1024


class UnusedParametersError(RuntimeError):
    """A synchronizing backward ended with parameters that never received a gradient."""


class CollectiveError(RuntimeError):
    """A bucket's collective failed or did not complete within the timeout."""


@dataclass
class CommStats:
    """Communication of the last synchronized backward.

    Attributes:
        collectives: collectives launched (one per bucket, plus the used-parameter map).
        bytes: bytes handed to the comm hook and to the used-parameter all-reduce.
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


@dataclass(eq=False)
class _Bucket:
    """A bucket and its per-step state."""

    grad: GradBucket
    param_indices: list[int]
    #: Parameters of this bucket not yet ready in the current backward.
    pending: int = 0
    future: Future[Tensor] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.grad.buffer.numel() * self.grad.buffer.element_size()


@dataclass(eq=False)
class _Slot:
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


class Reducer:
    """Average the gradients of `named_parameters` across a process group, bucket by bucket.

    Args:
        named_parameters: (qualified name, parameter) pairs in registration order; parameters that
            do not require grad are ignored.
        process_group: the group to average over; None means the default group.
        bucket_cap_mb: the most megabytes (MiB) of gradients in one bucket.
        first_bucket_mb: the cap of the first bucket, small so that communication starts early.
        find_unused_parameters: walk the forward's autograd graph and do not wait for parameters it
            does not reach.
        gradient_as_bucket_view: make each `param.grad` a view into its bucket.
        comm_hook: the per-bucket communication; defaults to `allreduce_hook`.
        comm_state: the state passed to `comm_hook`; defaults to an `AllreduceState` of the group.
        overlap: launch a bucket as soon as it is ready; False launches every bucket only after the
            backward, which is useful to measure what overlap buys.
        timeout: seconds to wait for one bucket's collective before raising.
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, Parameter]],
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        comm_hook: CommHook | None = None,
        comm_state: Any = None,
        overlap: bool = True,
        timeout: float = 1800.0,
    ) -> None:
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("The reducer needs at least one parameter that requires grad.")
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group = process_group
        self._rank = dist.get_rank(process_group)
        self._bucket_cap_bytes = int(bucket_cap_mb * _MB)
        self._first_bucket_cap_bytes = int(first_bucket_mb * _MB)
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self._hook = comm_hook if comm_hook is not None else allreduce_hook
        self._hook_name = getattr(self._hook, "__name__", type(self._hook).__name__)
        self._state = comm_state if comm_state is not None else AllreduceState(process_group)
        self._overlap = overlap
        self._timeout = timeout

        self._buckets: list[_Bucket] = []
        self._slots: list[_Slot] = []
        self._build_buckets(list(reversed(range(len(self._params)))), attach_missing=True)
        self._rebuilt = False

        # Per-backward state, reset by `prepare_for_backward`.
        self._sync = False
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._ready_order: list[int] = []
        self._used_work: dist.Work | None = None
        self._used_map: Tensor | None = None
        # Parameters that received a gradient since the last synchronized backward.
        self._locally_used = [False] * len(self._params)

        self._stats = CommStats()
        self._step_stats = CommStats()
        self._skipped_backwards = 0
        #: Collectives launched over the reducer's lifetime.
        self.collectives_launched = 0

        # functools.partial calls from C: one Python frame per gradient instead of two.
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(self._params)
        ]

    # ------------------------------------------------------------ public API
    @property
    def bucket_layout(self) -> list[list[str]]:
        """Qualified names of the parameters in each bucket, in launch order."""
        return [[self._names[i] for i in bucket.param_indices] for bucket in self._buckets]

    @property
    def buckets(self) -> list[GradBucket]:
        """The buckets as comm hooks see them, in launch order."""
        return [bucket.grad for bucket in self._buckets]

    @property
    def has_rebuilt_buckets(self) -> bool:
        """Whether the buckets follow the observed gradient order yet."""
        return self._rebuilt

    def stats(self) -> CommStats:
        """Return the communication counters of the last synchronized backward."""
        return self._stats

    def prepare_for_backward(self, *, sync: bool, outputs: Any = None) -> None:
        """Arm the reducer for the coming `loss.backward()`.

        Args:
            sync: whether this backward averages gradients; False lets them accumulate locally.
            outputs: what the forward returned (tensors in any nesting of lists, tuples, dicts and
                dataclasses); required with `find_unused_parameters` when `sync` is true.
        """
        self._sync = sync
        if not sync:
            self._skipped_backwards += 1
            return
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._used_work = None
        for bucket in self._buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.future = None
        self._ready_order = []
        self._step_stats = CommStats(buckets=len(self._buckets), skipped_backwards=self._skipped_backwards)
        if self._find_unused:
            if outputs is None:
                raise ValueError("find_unused_parameters=True needs the forward's outputs to walk the graph.")
            reached = self._parameters_reached(outputs)
            for index in range(len(self._params)):
                if index not in reached:
                    self._mark_ready(index)

    def finalize_backward(self) -> None:
        """Wait for the backward's collectives and write the averaged gradients back.

        Raises:
            UnusedParametersError: a parameter received no gradient and `find_unused_parameters` is off.
            CollectiveError: a bucket's collective failed or timed out.
        """
        if not self._sync:
            return
        self._sync = False
        self._skipped_backwards = 0
        if not all(self._ready):
            not_ready = [self._names[i] for i, ready in enumerate(self._ready) if not ready]
            raise UnusedParametersError(
                f"Rank {self._rank}: {len(not_ready)} parameter(s) received no gradient in this backward, "
                f"so their buckets could not be reduced: {', '.join(not_ready)}. If the model does not "
                "use every parameter in every forward, pass find_unused_parameters=True; otherwise make "
                "sure the loss depends on every parameter that requires grad."
            )
        if not self._overlap:
            self._launch_ready_buckets()
        start = time.perf_counter()
        for bucket in self._buckets:
            result = self._wait(bucket)
            buffer = bucket.grad.buffer
            if result.data_ptr() != buffer.data_ptr():
                buffer.copy_(result)
        if self._find_unused:
            self._write_back(self._wait_used_map())
        elif not self._as_view:
            self._write_back(None)
        self._step_stats.exposed_ms = (time.perf_counter() - start) * 1e3
        self._stats = self._step_stats
        if self._find_unused:
            self._locally_used = [False] * len(self._params)
        if not self._rebuilt:
            self._rebuild_buckets()

    def remove_hooks(self) -> None:
        """Detach the reducer from the parameters; gradients stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------- the hooks
    def _on_grad_ready(self, index: int, _param: Tensor) -> None:
        """Record that autograd has accumulated parameter `index`'s gradient (a post-accumulate hook)."""
        if self._find_unused:
            self._locally_used[index] = True
        if not self._sync:
            return
        if self._ready[index]:
            raise RuntimeError(
                f"Rank {self._rank}: parameter {self._names[index]} became ready twice in one backward. "
                "Either it received a gradient although the forward's graph did not reach it (was the "
                "loss computed from tensors other than training_step's outputs?), or it took part in "
                "several backward passes (reentrant checkpointing), which the reducer does not support."
            )
        if not self._rebuilt:
            self._ready_order.append(index)
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Put parameter `index`'s gradient in its bucket and launch every bucket that became ready."""
        self._ready[index] = True
        slot = self._slots[index]
        param = self._params[index]
        grad = param.grad
        if grad is None:
            # Unused so far: contribute zeros, and leave .grad alone unless some rank used it.
            slot.view.zero_()
        elif grad is not slot.view:
            slot.view.copy_(grad)
            if self._as_view:
                # The user replaced .grad (e.g. set it to None); point it back into the bucket.
                param.grad = slot.view
        bucket = self._buckets[slot.bucket]
        bucket.pending -= 1
        if bucket.pending == 0 and self._overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch, in bucket order, every bucket from the next unlaunched one that is ready."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            bucket = buckets[self._next_bucket]
            # Collective: the comm hook starts the bucket's asynchronous all-reduce.
            bucket.future = self._hook(self._state, bucket.grad)
            self._count_collective(bucket.nbytes)
            self._next_bucket += 1
        if self._next_bucket == len(buckets) and self._find_unused and self._used_work is None:
            self._used_map = torch.tensor(
                self._locally_used, dtype=torch.int32, device=self._buckets[0].grad.buffer.device
            )
            # Collective: count, per parameter, the ranks that used it since the last sync.
            self._used_work = dist.all_reduce(self._used_map, group=self._group, async_op=True)
            self._count_collective(self._used_map.numel() * self._used_map.element_size())

    def _count_collective(self, nbytes: int) -> None:
        self._step_stats.collectives += 1
        self._step_stats.bytes += nbytes
        self.collectives_launched += 1

    # ----------------------------------------------------------- end of step
    def _wait(self, bucket: _Bucket) -> Tensor:
        """Return the bucket's reduced buffer, waiting at most `timeout` seconds for it."""
        future = bucket.future
        assert future is not None, "finalize_backward waits only on launched buckets"
        what = f"Rank {self._rank}: {self._hook_name} of gradient bucket {bucket.grad.index}"
        if not future.done():
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            # Host sync: block until the bucket's collective has completed.
            if not done.wait(self._timeout):
                raise CollectiveError(
                    f"{what} ({bucket.nbytes} bytes) did not complete within {self._timeout:g} s; "
                    "another rank is probably stuck or launched different collectives."
                )
        try:
            return future.value()
        except RuntimeError as error:
            raise CollectiveError(f"{what} ({bucket.nbytes} bytes) failed: {error}") from error

    def _wait_used_map(self) -> list[bool]:
        """Return, per parameter, whether any rank used it since the last synchronized backward."""
        assert self._used_work is not None and self._used_map is not None
        try:
            # Host sync: wait for the used-map all-reduce.
            self._used_work.wait(timedelta(seconds=self._timeout))
        except RuntimeError as error:
            raise CollectiveError(f"Rank {self._rank}: all-reduce of the used-parameter map failed: {error}") from error
        # Host sync: read the counts back to the CPU.
        return [count > 0 for count in self._used_map.tolist()]

    def _write_back(self, globally_used: list[bool] | None) -> None:
        """Make every used parameter's `.grad` hold its bucket's average; leave unused ones untouched."""
        for index, param in enumerate(self._params):
            if globally_used is not None and not globally_used[index]:
                continue
            view = self._slots[index].view
            grad = param.grad
            if self._as_view:
                if grad is None:
                    param.grad = view
            elif grad is None:
                param.grad = view.clone()
            else:
                grad.copy_(view)

    # -------------------------------------------------------- bucket layout
    def _build_buckets(self, order: list[int], *, attach_missing: bool) -> None:
        """Allocate one flat buffer per bucket in `order` and move the gradients into it.

        Args:
            order: parameter indices in the order their gradients are expected to become ready.
            attach_missing: in view mode, give parameters without a gradient a zero view; at
                construction that saves a copy on the first step, while at a rebuild a missing
                gradient must stay missing.
        """
        layout = assign_buckets(self._params, order, self._bucket_cap_bytes, self._first_bucket_cap_bytes)
        slots: list[_Slot | None] = [None] * len(self._params)
        buckets = []
        for bucket_index, indices in enumerate(layout):
            first = self._params[indices[0]]
            offsets = []
            total = 0
            for index in indices:
                offsets.append(total)
                total += self._params[index].numel()
            buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
            for index, offset in zip(indices, offsets):
                param = self._params[index]
                view = buffer[offset : offset + param.numel()].view(param.shape)
                slots[index] = _Slot(bucket=bucket_index, view=view)
                with torch.no_grad():
                    if param.grad is not None:
                        view.copy_(param.grad)
                if self._as_view and (param.grad is not None or attach_missing):
                    param.grad = view
            params = [self._params[i] for i in indices]
            buckets.append(_Bucket(GradBucket(bucket_index, buffer, params, offsets), list(indices)))
        assert all(slot is not None for slot in slots), "every parameter belongs to exactly one bucket"
        self._buckets = buckets
        self._slots = slots  # type: ignore[assignment]

    def _rebuild_buckets(self) -> None:
        """Rebuild the buckets once, in the gradient order rank 0 observed, identically on every rank."""
        self._rebuilt = True
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in reversed(range(len(self._params))) if i not in seen]
        order_tensor = torch.tensor(order, dtype=torch.int64, device=self._buckets[0].grad.buffer.device)
        # Collective: every rank adopts rank 0's order, so bucket i holds the same parameters everywhere.
        dist.broadcast(order_tensor, group=self._group, group_src=0)
        # Host sync: the order is needed on the CPU to lay out the buffers.
        order = order_tensor.tolist()
        current = [bucket.param_indices for bucket in self._buckets]
        new = assign_buckets(self._params, order, self._bucket_cap_bytes, self._first_bucket_cap_bytes)
        if new != current:
            self._build_buckets(order, attach_missing=False)

    def _parameters_reached(self, outputs: Any) -> set[int]:
        """Return the indices of the parameters the autograd graph of `outputs` reaches."""
        reached: set[int] = set()
        stack = []
        for tensor in _iter_tensors(outputs):
            if tensor.grad_fn is not None:
                stack.append(tensor.grad_fn)
            elif id(tensor) in self._index_of:
                reached.add(self._index_of[id(tensor)])
        seen = set(stack)
        while stack:
            node = stack.pop()
            variable = getattr(node, "variable", None)  # set on AccumulateGrad nodes only
            if variable is not None and id(variable) in self._index_of:
                reached.add(self._index_of[id(variable)])
            for next_node, _ in node.next_functions:
                if next_node is not None and next_node not in seen:
                    seen.add(next_node)
                    stack.append(next_node)
        return reached


def _iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Yield every tensor inside lists, tuples, dicts and dataclasses of `obj`."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from _iter_tensors(getattr(obj, f.name))
