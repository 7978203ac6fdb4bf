"""The gradient reducer of data-parallel training (Li et al., *PyTorch Distributed*, VLDB 2020).

Every rank holds a full replica of the model and computes gradients on its own shard of the batch.
The reducer averages those gradients across ranks while the backward pass is still running:

1. **Buckets.** Parameters are grouped into flat buffers of at most `bucket_cap_mb` (the first one
   smaller, so communication starts early), in reverse registration order as a guess of the order in
   which gradients become ready. After the first synchronized backward the buckets are rebuilt once
   in the order rank 0 actually observed. `set_bucket_cap` lays them out again with another cap
   (bucket autotuning, `strategies/comm/bucket_autotune.py`), between synchronized backwards.
2. **Views.** With `gradient_as_bucket_view`, each `param.grad` *is* a view into its bucket, so
   autograd accumulates straight into the buffer and no copy is made per step.
3. **Overlap.** A post-accumulate-grad hook records each parameter as it arrives (a C `list.append`
   for most; one Python "trigger" per bucket processes the arrivals); when the last parameter of a
   bucket is ready and every earlier bucket has been launched, the bucket's comm hook starts an
   asynchronous all-reduce. Buckets launch in the same order on every rank.
4. **Finalize.** After `loss.backward()` returns, the reducer waits for the outstanding collectives
   (the exposed, non-overlapped part of communication) and writes the averages back.
5. **Skip sync.** A backward that does not synchronize leaves gradients to accumulate locally; the
   next synchronizing backward communicates the sum.
6. **Unused parameters.** With `find_unused_parameters`, the autograd graph of the loss about to be
   back-propagated is walked before the backward, and parameters it does not reach are marked ready
   up front so that no bucket waits for a gradient that will never come. Without it, such a parameter
   is an error. A parameter no rank used in a step ends it with `.grad` None, as in torch, so that
   weight decay and momentum leave it alone.
7. **Sparse gradients** (`nn.Embedding(sparse=True)`) stay out of the buckets: after the dense buckets,
   each is averaged with its own sparse all-reduce, as torch's reducer does, and stays sparse.

The reducer's public surface is `prepare_for_backward` (before `loss.backward()`) and
`finalize_backward` (after it); `BucketedDDP` calls both. `average_tensors` takes a chosen set of other tensors
through the same kind of buckets and hooks (QAdam's momentum). Deferred optimizer updates (`comm/deferred_update.py`)
hold the front layers' buckets back (`hold`), do not wait (`wait=False`) and take each average by `wait_bucket`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.utils.hooks import RemovableHandle

from syncline.strategies.comm.autograd_graph import grad_accumulators, parameters_reached
from syncline.strategies.comm.buckets import Bucket, GradientBuckets, Slot
from syncline.strategies.comm.collective_log import COLLECTIVES
from syncline.strategies.comm.counter import CommCounter, CommStats
from syncline.strategies.comm.events import CommEvents
from syncline.strategies.comm.flat import group_by_dtype
from syncline.strategies.comm.hooks import AllreduceState, CommHook, GradBucket, allreduce_hook
from syncline.strategies.comm.reducer_errors import (
    UnusedParametersError,
    check_thawed,
    ready_twice_message,
    unused_message,
    wait_for_future,
    wait_for_work,
)
from syncline.strategies.comm.sparse_gradients import average_sparse_gradients
from syncline.strategies.comm.tensor_buckets import average_tensors

__all__ = ["Reducer"]

_MB = 1024 * 1024


class Reducer:
    """Average the gradients of `named_parameters` across a process group, bucket by bucket.

    Args:
        named_parameters: (qualified name, parameter) pairs in registration order; parameters that
            do not require grad are ignored (and must not start requiring it later).
        process_group: the group to average over; None means the default group.
        bucket_cap_mb: the most megabytes (MiB) of gradients in one bucket.
        first_bucket_mb: the cap of the first bucket, small so that communication starts early.
        find_unused_parameters: walk the loss's autograd graph and do not wait for parameters it
            does not reach.
        gradient_as_bucket_view: make each `param.grad` a view into its bucket.
        comm_hook: the per-bucket communication; defaults to `allreduce_hook`.
        comm_state: the state passed to `comm_hook`; defaults to an `AllreduceState` of the group.
        overlap: launch a bucket as soon as it is ready; False launches every bucket only after the
            backward, which is useful to measure what overlap buys.
        timeout: seconds to wait for one bucket's collective before raising.
        sparse_gradients: the parameters whose gradients are sparse (those of `nn.Embedding` and
            `nn.EmbeddingBag` with `sparse=True`); each is reduced by a sparse all-reduce of its own.
        static_graph: promise that every step uses the same parameters: unused parameters are found
            (graph walk and used-parameter all-reduce) in the first synchronized backward only, and
            that answer is reused; implies `find_unused_parameters`.
        rebuild_buckets: rebuild the buckets once in the observed gradient order; False keeps the layout
            of construction (for hooks whose result depends on it, e.g. chunked quantization).
        counter: where the bytes handed to collectives are counted (the strategy's); a new one if None.
            A comm state with a `counter` attribute gets this counter and the hook counts what it sends;
            otherwise the reducer counts each bucket at its own size.
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
        timeout: float = 300.0,
        sparse_gradients: Sequence[Tensor] = (),
        static_graph: bool = False,
        rebuild_buckets: bool = True,
        counter: CommCounter | None = None,
    ) -> None:
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("The reducer needs at least one parameter that requires grad.")
        # Never reduced: a parameter that starts requiring grad later would silently differ across ranks.
        self._frozen_at_setup = [(name, p) for name, p in named_parameters if not p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        sparse_ids = {id(p) for p in sparse_gradients}
        self._sparse = [i for i, p in enumerate(self._params) if id(p) in sparse_ids]
        self._is_sparse = [id(p) in sparse_ids for p in self._params]
        self._device = self._params[0].device
        self._group = process_group
        self._rank = dist.get_rank(process_group)
        self._find_unused = find_unused_parameters or static_graph
        self._as_view = gradient_as_bucket_view
        self._hook = comm_hook if comm_hook is not None else allreduce_hook
        self._hook_name = getattr(self._hook, "__name__", type(self._hook).__name__)
        self._state = comm_state if comm_state is not None else AllreduceState(process_group)
        self.counter = counter if counter is not None else CommCounter()
        # A hook that knows what it compresses counts its own bytes; any other is counted by bucket size.
        self._hook_counts = hasattr(self._state, "counter")
        if self._hook_counts:
            self._state.counter = self.counter
        self._overlap = overlap
        self._timeout = timeout

        # The flat buffers and the gradients' views into them (None for sparse gradients).
        caps = int(bucket_cap_mb * _MB), int(first_bucket_mb * _MB)
        self._grads = GradientBuckets(self._params, self._names, self._is_sparse, self._as_view, self._rank, *caps)
        self._buckets: list[Bucket] = []
        self._slots: list[Slot | None] = []
        # Whether .grad holds a value since the last `zero_grad` (a zero view attached for speed does not count).
        self._has_grad = self._grads.has_grad
        # The order buckets are laid out in (rank 0's observed order after the rebuild), and this rank's
        # own order, which places the triggers; `set_bucket_cap` lays the buckets out again in them.
        self._order = self._local_order = list(reversed(range(len(self._params))))
        self._relayout(self._order, attach_missing=True)
        self._rebuilt = not rebuild_buckets
        #: Where bucket launches, completions and the exposed wait are recorded while a timeline listens
        #: (`strategies/comm/events.py`); None records nothing and costs one attribute test per bucket.
        self.events: CommEvents | None = None

        # Per-backward state, reset by `prepare_for_backward`.
        self._armed = False  # between prepare_for_backward and finalize_backward
        self._sync = False
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._launch_limit = 0  # buckets from here on launch only in finalize_backward (held back)
        self._ready_order: list[int] = []
        #: Per bucket, its parameters not yet ready in the current backward.
        self._pending = [0] * len(self._buckets)
        self._used_work: dist.Work | None = None
        self._used_map: Tensor | None = None
        # Parameters that received a gradient since the last synchronized backward.
        self._locally_used = [False] * len(self._params)
        # Parameters that received a gradient outside prepare/finalize (a bare `loss.backward()`)
        # since the last synchronized backward: never averaged unless a synchronized backward follows.
        self._unsynced: set[int] = set()
        # With a static graph: what the first synchronized backward found, reused ever after.
        self._static_graph = static_graph
        self._static_unreached: list[int] | None = None
        self._unreached: list[int] = []  # parameters the current backward's graph does not reach
        self._static_used: list[bool] | None = None

        self._stats = CommStats()
        self._step_stats = CommStats()
        self._skipped_backwards = 0
        #: Collectives launched over the reducer's lifetime.
        self.collectives_launched = 0
        #: Synchronized backwards started (the "step" that collective messages name, counted from 1).
        self.sync_steps = 0

        # Each parameter's AccumulateGrad node, held so that it stays the node every graph ends in:
        # the graph walk then recognizes a parameter by a dictionary look-up (as torch's DDP holds them).
        self._accumulators = grad_accumulators(self._params)
        # Parameters whose gradients autograd has accumulated and the reducer has not yet processed.
        self._arrivals: list[Tensor] = []
        self._handles: list[RemovableHandle] = []
        self._install_hooks(self._local_order)

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

    @property
    def bucket_cap_mb(self) -> float:
        """The cap (MiB) of every bucket but the first."""
        return self._grads.cap_bytes / _MB

    def gradient_group_bytes(self) -> list[int]:
        """Bytes of the dense gradients of each dtype and device (what one bucket could hold at most)."""
        dense = [param for param, sparse in zip(self._params, self._is_sparse) if not sparse]
        return [sum(p.numel() * p.element_size() for p in group) for group in group_by_dtype(dense)]

    def average_tensors(
        self, named_tensors: Sequence[tuple[str, Tensor]], comm_hook: CommHook, comm_state: Any
    ) -> None:
        """Average a chosen set of tensors (an optimizer's momentum, ...) in place, in buckets of this reducer's cap,
        each through `comm_hook` as a gradient bucket would go; the hook's state counts in this reducer's counter
        (`comm/tensor_buckets.py`)."""
        if hasattr(comm_state, "counter"):
            comm_state.counter = self.counter
        what = f"Rank {self._rank}: {getattr(comm_hook, '__name__', 'comm hook')} of tensor bucket"
        average_tensors(named_tensors, comm_hook, comm_state, cap_bytes=self._grads.cap_bytes, timeout=self._timeout,
                        what=what)  # fmt: skip

    def set_bucket_cap(self, bucket_cap_mb: float) -> None:
        """Lay the buckets out again with another cap, in the current order (bucket autotuning).

        Call it between synchronized backwards, at the same step on every rank: the gradients move into
        the new buffers as they are, so nothing that is averaged changes, only how it is grouped.
        """
        if self._armed:
            raise RuntimeError("Reducer.set_bucket_cap must be called between backwards, not during one.")
        self._grads.cap_bytes = int(bucket_cap_mb * _MB)
        if self._relayout(self._order):
            self._install_hooks(self._local_order)

    def stats(self) -> CommStats:
        """Return the communication counters of the last synchronized backward."""
        return self._stats

    def prepare_for_backward(self, *, sync: bool, loss: Any = None, hold: int = 0) -> None:
        """Arm the reducer for the coming `loss.backward()`.

        Args:
            sync: whether this backward averages gradients; False lets them accumulate locally.
            loss: the tensor about to be back-propagated (or tensors in any nesting of lists, tuples,
                dicts and dataclasses); required with `find_unused_parameters` when `sync` is true.
                Parameters its graph does not reach are unused in this backward.
            hold: launch the last `hold` buckets (the front layers, ready last) only in `finalize_backward`,
                front-most first, so that the next forward's first layers get their averages first. The
                launch order depends on the bucket index alone, so it is the same on every rank.

        Raises:
            RuntimeError: a parameter that did not require grad at construction requires it now.
        """
        # Gradients that arrived while nothing was armed came from a bare `loss.backward()`.
        self._absorb_arrivals(unsynced=True)
        self._armed = True
        self._sync = sync
        if not sync:
            self._skipped_backwards += 1
            return
        check_thawed(self._rank, self._frozen_at_setup)
        self.sync_steps += 1
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._launch_limit = len(self._buckets) - min(max(hold, 0), len(self._buckets))
        self._used_work = None
        self._pending = [len(bucket.param_indices) for bucket in self._buckets]
        self._ready_order = []
        self._step_stats = CommStats(
            buckets=len(self._buckets) + len(self._sparse), skipped_backwards=self._skipped_backwards
        )
        self._bytes_before = self.counter.total_bytes
        if self._find_unused:
            if self._static_unreached is not None:
                unreached = self._static_unreached
            else:
                if loss is None:
                    raise ValueError("find_unused_parameters=True needs the loss to walk its graph.")
                reached = parameters_reached(loss, self._accumulators, self._index_of)
                unreached = [index for index in range(len(self._params)) if index not in reached]
                if self._static_graph:
                    self._static_unreached = unreached
            self._unreached = unreached
            for index in unreached:
                self._mark_ready(index)
            if unreached and self._overlap:
                self._launch_ready_buckets()

    def finalize_backward(self, *, wait: bool = True) -> None:
        """Wait for the backward's collectives and write the averaged gradients back.

        Args:
            wait: False launches what is left (the held buckets, front-most first) and returns at once; each
                bucket's average is then taken by `wait_bucket` (deferred optimizer updates). Not with
                `find_unused_parameters`, a static graph or sparse gradients, whose write-back needs every bucket.

        Raises:
            UnusedParametersError: a parameter received no gradient and `find_unused_parameters` is off.
            CollectiveError: a bucket's collective failed or timed out.
        """
        self._armed = False
        if not self._sync:
            self._absorb_arrivals(unsynced=False)
            return
        self._sync = False
        self._skipped_backwards = 0
        self._unsynced.clear()
        self._process_arrivals()
        if not all(self._ready):
            missing = [(self._names[i], self._params[i]) for i, ready in enumerate(self._ready) if not ready]
            raise UnusedParametersError(unused_message(self._rank, missing))
        # Without overlap, everything launches now; with it, only the held buckets and the used-parameter map
        # can be left (the map when there is no dense bucket).
        self._launch_held_buckets()
        self._launch_limit = len(self._buckets)
        self._launch_ready_buckets()
        if not wait:
            if self._find_unused or self._sparse:
                raise ValueError("finalize_backward(wait=False) needs every parameter dense and used.")
            self._step_stats.bytes = self.counter.total_bytes - self._bytes_before
            self._stats = self._step_stats
            return
        start = time.perf_counter()
        for bucket in self._buckets:
            bucket.take(self._wait(bucket))
        globally_used = self._static_used
        if self._find_unused and globally_used is None:
            globally_used = self._wait_used_map()
            if self._static_graph:
                self._static_used = globally_used
        if self._sparse:
            self._reduce_sparse(globally_used)
        every = range(len(self._params))
        if globally_used is not None:
            # With views, a parameter that got its gradient here already points into its bucket; only
            # the ones the graph did not reach may need the average attached, or None.
            self._grads.write_back(globally_used, self._unreached if self._as_view else every)
            self._grads.drop_unused(globally_used, self._unreached)
        elif not self._as_view:
            self._grads.write_back(None, every)
        end = time.perf_counter()
        self._step_stats.exposed_ms = (end - start) * 1e3
        if self.events is not None:
            self.events.span("exposed wait", start, end)
        self._step_stats.bytes = self.counter.total_bytes - self._bytes_before
        self._stats = self._step_stats
        if self._find_unused:
            self._locally_used = [False] * len(self._params)
        if not self._rebuilt:
            self._rebuild_buckets()

    @property
    def launched_buckets(self) -> list[int]:
        """Indices of the buckets launched and not yet waited for (after `finalize_backward(wait=False)`)."""
        return [index for index, bucket in enumerate(self._buckets) if bucket.future is not None]

    def bucket_of(self, param: Tensor) -> int | None:
        """The index of the bucket holding `param`'s gradient (None: not reduced here, or sparse)."""
        index = self._index_of.get(id(param))
        return None if index is None or self._is_sparse[index] else self._bucket_of[index]

    def wait_bucket(self, index: int) -> None:
        """Wait for bucket `index`'s collective and leave its average in the gradients (views into the bucket)."""
        bucket = self._buckets[index]
        bucket.take(self._wait(bucket))

    def contribute_zeros(self) -> None:
        """Between `prepare_for_backward` and `finalize_backward` without a backward: every gradient not yet marked
        ready is zero (a joined rank's share), and the buckets launch as the other ranks' do."""
        for index, ready in enumerate(self._ready):
            slot = self._slots[index]
            if not ready and slot is not None:
                slot.view.zero_()
                self._mark_ready(index)
        self._launch_ready_buckets()

    def zero_grad(self, params: Sequence[Tensor]) -> None:
        """Reset the gradients of `params` as `optimizer.zero_grad()` (set to None) would, but cheaply.

        Bucket views stay attached and are zeroed; a parameter that then receives no gradient on any rank
        ends the next synchronized backward with `.grad` None (`GradientBuckets.zero_grad`).
        """
        self._grads.zero_grad(params)

    def mark_gradients_held(self, params: Sequence[Tensor]) -> None:
        """Record that `params` hold gradient values put there from outside a backward (a checkpoint's)."""
        for param in params:
            index = self._index_of.get(id(param))
            if index is not None:
                self._has_grad[index] = True

    @property
    def has_unsynced_gradients(self) -> bool:
        """Whether a backward the reducer did not prepare accumulated gradients since the last sync."""
        return bool(self._unsynced) or (not self._armed and bool(self._arrivals))

    def unsynced_parameters(self, params: Sequence[Tensor]) -> list[str]:
        """Names of `params` holding a gradient that a bare `loss.backward()` left unaveraged (sorted)."""
        if not self._armed:
            self._absorb_arrivals(unsynced=True)
        wanted = {id(param) for param in params}
        return sorted({self._names[i] for i in self._unsynced if id(self._params[i]) in wanted})

    def remove_hooks(self) -> None:
        """Detach the reducer from the parameters; gradients stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------- the hooks
    # Autograd runs a hook per parameter once its gradient is accumulated. A Python function there
    # costs microseconds per parameter, torch's C++ hooks a fraction of one; so most parameters' hook
    # is `self._arrivals.append`, a C function that only records the parameter. The parameter expected
    # to arrive last in each bucket (its "trigger") runs Python: it processes every arrival so far in
    # one loop and launches the buckets that are complete. If gradients arrive in another order than
    # expected, a complete bucket waits for a later trigger or for `finalize_backward`, never longer.
    def _install_hooks(self, order: list[int]) -> None:
        """Hook every parameter; the last of each bucket in `order`, and sparse ones, as triggers."""
        for handle in self._handles:
            handle.remove()
        position = {index: pos for pos, index in enumerate(order)}
        triggers = set(self._sparse)
        for bucket in self._buckets:
            triggers.add(max(bucket.param_indices, key=position.__getitem__))
        # torch hooks only tensors that require grad: a parameter frozen for now (`toggle_optimizer` in manual
        # optimization, when the buckets are rebuilt) is hooked thawed for the backwards that train it again.
        frozen = [param for param in self._params if not param.requires_grad]
        for param in frozen:
            param.requires_grad_(True)
        try:
            self._handles = [
                param.register_post_accumulate_grad_hook(self._on_trigger if i in triggers else self._arrivals.append)
                for i, param in enumerate(self._params)
            ]
        finally:
            for param in frozen:
                param.requires_grad_(False)

    def _on_trigger(self, param: Tensor) -> None:
        """Record `param`'s arrival, then process all arrivals and launch the buckets that are complete."""
        self._arrivals.append(param)
        if self._sync:
            self._process_arrivals()
            if self._overlap:
                self._launch_ready_buckets()
        elif not self._armed:
            self._absorb_arrivals(unsynced=True)  # keeps the list short in a loop that never syncs

    def _process_arrivals(self) -> None:
        """Mark every parameter that arrived since the last call ready and count it off its bucket."""
        arrivals = self._arrivals
        if not arrivals:
            return
        index_of, ready, views, pending = self._index_of, self._ready, self._views, self._pending
        bucket_of, has_grad = self._bucket_of, self._has_grad
        # With a static graph, the used map is known after the first synchronized backward.
        locally_used = self._locally_used if self._find_unused and self._static_used is None else None
        indices = [index_of[id(param)] for param in arrivals]
        for param, index in zip(arrivals, indices):
            if ready[index]:
                raise RuntimeError(ready_twice_message(self._rank, self._names[index]))
            ready[index] = True
            has_grad[index] = True
            view = views[index]
            if view is None:
                continue  # a sparse gradient: reduced on its own after the buckets
            if param.grad is not view:
                self._grads.fill(index)
            pending[bucket_of[index]] -= 1
        if locally_used is not None:
            for index in indices:
                locally_used[index] = True
        if not self._rebuilt:
            self._ready_order.extend(indices)
        arrivals.clear()

    def _absorb_arrivals(self, *, unsynced: bool) -> None:
        """Take note of gradients accumulated outside a synchronized backward, and forget the arrivals."""
        arrivals = self._arrivals
        if not arrivals:
            return
        indices = [self._index_of[id(param)] for param in arrivals]
        arrivals.clear()
        for index in indices:
            self._has_grad[index] = True
        if self._find_unused:
            for index in indices:
                self._locally_used[index] = True
        if unsynced:
            self._unsynced.update(indices)

    def _mark_ready(self, index: int) -> None:
        """Mark parameter `index` ready before its gradient arrives (it will not: it is unused)."""
        self._ready[index] = True
        slot = self._slots[index]
        if slot is not None:
            if self._params[index].grad is not slot.view:
                self._grads.fill(index)
            self._pending[slot.bucket] -= 1

    def _launch(self, bucket: Bucket) -> None:
        """Start `bucket`'s comm hook."""
        COLLECTIVES.record(f"{self._hook_name} of gradient bucket {bucket.grad.index} of step {self.sync_steps}")
        launched = time.perf_counter() if self.events is not None else 0.0
        # Collective: the comm hook starts the bucket's asynchronous all-reduce.
        bucket.future = self._hook(self._state, bucket.grad)
        if self.events is not None:
            self.events.bucket(bucket.grad.index, bucket.nbytes, launched, bucket.future)
        self._count_collective(0 if self._hook_counts else bucket.nbytes)

    def _launch_held_buckets(self) -> None:
        """At the end of a backward: launch every bucket still unlaunched, the held ones last-first (front-most first).

        The buckets before the held ones go first, in order, so every rank launches the same sequence.
        """
        self._launch_ready_buckets()
        buckets = self._buckets
        for index in range(len(buckets) - 1, self._next_bucket - 1, -1):
            self._launch(buckets[index])
        self._next_bucket = len(buckets)

    def _launch_ready_buckets(self) -> None:
        """Launch, in bucket order, every bucket from the next unlaunched one that is ready (up to the held ones)."""
        buckets, pending, limit = self._buckets, self._pending, self._launch_limit
        while self._next_bucket < limit and pending[self._next_bucket] == 0:
            self._launch(buckets[self._next_bucket])
            self._next_bucket += 1
        if (
            self._next_bucket == len(buckets)
            and self._find_unused
            and self._static_used is None
            and self._used_work is None
            and all(self._ready[index] for index in self._sparse)
        ):
            self._used_map = torch.tensor(self._locally_used, dtype=torch.int32, device=self._device)
            COLLECTIVES.record(f"all-reduce of the used-parameter map of step {self.sync_steps}")
            # Collective: count, per parameter, the ranks that used it since the last sync.
            self._used_work = dist.all_reduce(self._used_map, group=self._group, async_op=True)
            self._count_collective(self._used_map.numel() * self._used_map.element_size())

    def _count_collective(self, nbytes: int) -> None:
        self._step_stats.collectives += 1
        self.counter.add(nbytes)
        self.collectives_launched += 1

    # ----------------------------------------------------------- end of step
    def _wait(self, bucket: Bucket) -> Tensor:
        """Return the bucket's reduced buffer, waiting at most `timeout` seconds for it."""
        future = bucket.future
        assert future is not None, "finalize_backward waits only on launched buckets"
        what = f"Rank {self._rank}: {self._hook_name} of gradient bucket {bucket.grad.index} of step {self.sync_steps}"
        return wait_for_future(future, self._timeout, f"{what} ({bucket.nbytes} bytes)")

    def _wait_used_map(self) -> list[bool]:
        """Return, per parameter, whether any rank used it since the last synchronized backward."""
        assert self._used_work is not None and self._used_map is not None
        what = f"Rank {self._rank}: all-reduce of the used-parameter map of step {self.sync_steps}"
        wait_for_work(self._used_work, self._timeout, what)
        # Host sync: read the counts back to the CPU.
        return [count > 0 for count in self._used_map.tolist()]

    def _reduce_sparse(self, globally_used: list[bool] | None) -> None:
        """Average the sparse gradients; a parameter no rank used keeps its `.grad`, as dense ones do."""
        params = [self._params[index] for index in self._sparse]
        names = [self._names[index] for index in self._sparse]
        averaged = average_sparse_gradients(params, names, self._group, self._timeout)
        for index, param, grad in zip(self._sparse, params, averaged):
            self._count_collective(grad.values().numel() * grad.element_size())
            if globally_used is None or globally_used[index]:
                param.grad = grad
                self._has_grad[index] = True

    # -------------------------------------------------------- bucket layout
    def _relayout(self, order: list[int], *, attach_missing: bool = False) -> bool:
        """Lay the buckets out in `order` (`GradientBuckets.relayout`); return whether the buffers changed."""
        g = self._grads
        changed = g.relayout(order, attach_missing=attach_missing)
        self._buckets, self._slots, self._views, self._bucket_of = g.buckets, g.slots, g.views, g.bucket_of
        return changed

    def _rebuild_buckets(self) -> None:
        """Rebuild the buckets once, in the gradient order rank 0 observed, identically on every rank."""
        self._rebuilt = True
        seen = set(self._ready_order)
        local_order = self._ready_order + [i for i in reversed(range(len(self._params))) if i not in seen]
        order_tensor = torch.tensor(local_order, dtype=torch.int64, device=self._device)
        COLLECTIVES.record("broadcast of the rebuilt bucket order")
        # Collective: every rank adopts rank 0's order, so bucket i holds the same parameters everywhere.
        dist.broadcast(order_tensor, group=self._group, group_src=0)
        # Host sync: the order is needed on the CPU to lay out the buffers.
        order = order_tensor.tolist()
        self._order, self._local_order = order, local_order
        self._relayout(order)
        # Triggers follow this rank's own order: they decide only when, not what, this rank launches.
        self._install_hooks(local_order)
