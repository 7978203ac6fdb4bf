"""Data parallelism with syncline's own bucketed, overlapped reducer (Li et al., VLDB 2020).

One process per device; every process holds the whole model and trains on its shard of each batch.
`setup` checks that all ranks built the same model and copies rank 0's weights to the others; from
then on the `Reducer` averages gradients during the backward, so the replicas stay identical. The
loop drives it through the `Strategy` interface:

    strategy.setup_environment()                 # join the process group (from RANK, WORLD_SIZE, ...)
    strategy.setup(task)
    for each micro-batch:
        strategy.sync_next_backward = sync       # optional here; NativeDDP needs it
        output = strategy.training_step(task, batch, batch_idx)
        strategy.backward(loss, sync=sync)       # sync=False: no communication, gradients accumulate
        if sync: clip, strategy.optimizer_step(...), strategy.zero_grad(optimizer)
    strategy.teardown()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from syncline.options import check_number
from syncline.strategies.backward_sync import BackwardSyncControl
from syncline.strategies.comm_hooks import COMM_HOOKS, CommHook
from syncline.strategies.join import Joinable
from syncline.strategies.process_group import ProcessGroupStrategy, broadcast_coalesced
from syncline.strategies.reducer import Reducer
from syncline.strategies.sparse_gradients import sparse_gradient_parameters

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["BlockingHookDDP", "BucketedDDP"]

_CAP_MEANING = "MiB per bucket; 0 gives every parameter its own bucket"


class BucketedDDP(BackwardSyncControl, Joinable, ProcessGroupStrategy):
    """Average gradients across processes with bucketed all-reduces that overlap the backward.

    Args:
        bucket_cap_mb: the most MiB of gradients per bucket (one all-reduce each).
        first_bucket_mb: cap of the first bucket to be reduced, small so communication starts early.
        find_unused_parameters: tolerate parameters that a forward does not use, at the cost of a
            walk of the autograd graph and one extra small all-reduce per synchronized step.
        gradient_as_bucket_view: make `param.grad` a view into the bucket, saving a copy and memory.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before
            each forward that follows a synchronized step.
        comm_hook: per-bucket communication, a function `hook(state, bucket) -> Future[Tensor]` or
            the name of one in `COMM_HOOKS` ("allreduce", "fp16", "bf16"); None is "allreduce".
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.
        overlap: launch each bucket as soon as its gradients are ready; False waits for the end of
            the backward (to measure what overlap buys).
        comm_state: the state object passed to a custom `comm_hook`; None gives the default hooks'
            `AllreduceState`.
        static_graph: promise that every step uses the same parameters, as torch's DDP option of that
            name: unused parameters are then found once, in the first synchronized step, instead of
            walking the graph and all-reducing a used-parameter map every step.
    """

    name = "bucketed_ddp"
    #: Rebuild the buckets once in the observed gradient order (a subclass whose hook depends on the
    #: layout keeps the layout of construction instead).
    rebuild_buckets: bool = True

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool = True,
        comm_hook: CommHook | str | None = None,
        backend: str | None = None,
        timeout: float = 300.0,
        overlap: bool = True,
        comm_state: Any = None,
        static_graph: bool = False,
    ) -> None:
        # 0 is meaningful, as in torch's DDP: every parameter gets its own bucket.
        check_number("BucketedDDP", "bucket_cap_mb", bucket_cap_mb, minimum=0, meaning=_CAP_MEANING)
        check_number("BucketedDDP", "first_bucket_mb", first_bucket_mb, minimum=0, meaning=_CAP_MEANING)
        super().__init__(backend=backend, timeout=timeout)
        if isinstance(comm_hook, str):
            if comm_hook not in COMM_HOOKS:
                raise ValueError(f"Unknown comm_hook {comm_hook!r}. Valid: {', '.join(sorted(COMM_HOOKS))}.")
            comm_hook = COMM_HOOKS[comm_hook]
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.comm_hook = comm_hook
        self.comm_state = comm_state
        self.overlap = overlap
        self.static_graph = static_graph
        self._reducer: Reducer | None = None
        self._step_check: RemovableHandle | None = None
        self._buffers: list[Tensor] = []
        self._buffers_stale = True

    @property
    def reducer(self) -> Reducer:
        """The reducer built by `setup`."""
        if self._reducer is None:
            raise RuntimeError("BucketedDDP.setup(task) has not been called yet.")
        return self._reducer

    # --------------------------------------------------------------- lifecycle
    def setup(self, task: Task) -> None:
        """Move `task` to the device, check all ranks agree on it, copy rank 0's state, build the reducer.

        Raises:
            ValueError: the ranks' models differ in parameter names, shapes or dtypes, or a lazy module
                has not been initialized by a forward yet.
        """
        task.to(self.root_device)
        self.check_same_parameters(task)
        # Collective: start every replica from rank 0's parameters and buffers.
        broadcast_coalesced([*task.parameters(), *task.buffers()])
        self._buffers = list(task.buffers())
        self._buffers_stale = False
        self._reducer = Reducer(
            list(task.named_parameters()),
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            comm_hook=self.comm_hook,
            comm_state=self.comm_state,
            overlap=self.overlap,
            timeout=self.timeout,
            sparse_gradients=sparse_gradient_parameters(task),
            static_graph=self.static_graph,
            counter=self.comm_counter,
            rebuild_buckets=self.rebuild_buckets,
        )
        if self._step_check is None:
            # Every optimizer's step, including one in a hand-written loop, first checks that the
            # gradients it is about to apply were averaged.
            self._step_check = register_optimizer_step_pre_hook(self._check_before_step)

    def teardown(self) -> None:
        """Remove the reducer's hooks; the process group stays for later stages."""
        if self._reducer is not None:
            self._reducer.remove_hooks()
            self._reducer = None
        if self._step_check is not None:
            self._step_check.remove()
            self._step_check = None
        super().teardown()

    # -------------------------------------------------------------- train step
    def training_step(self, task: Task, batch: Any, batch_idx: int) -> Any:
        """Refresh buffers from rank 0 if a synchronized step changed them, then run the forward."""
        if self.broadcast_buffers and self._buffers and self._buffers_stale:
            # Collective: every rank's forward sees rank 0's buffers, as torch's DDP does (under join,
            # the highest rank's that still has data).
            broadcast_coalesced(self._buffers, src=self.buffer_source)
            self.comm_counter.add_tensors(*self._buffers)
            self._buffers_stale = False
        return task.training_step(batch, batch_idx)

    def backward(self, loss: Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Back-propagate `loss`; average gradients across ranks only when `sync` is true.

        With `find_unused_parameters`, a parameter is unused when the graph of `loss` does not reach
        it, whatever else the forward computed from it.
        """
        reducer = self.reducer
        sync = self._backward_syncs(sync)
        walk = self.find_unused_parameters or self.static_graph
        reducer.prepare_for_backward(sync=sync, loss=loss if walk else None)
        loss.backward(retain_graph=retain_graph)
        reducer.finalize_backward()
        if sync:
            self._buffers_stale = True

    def finish_join(self) -> None:
        """Give every rank the last joiner's buffers (the parameters are already equal)."""
        if self.broadcast_buffers and self._buffers:
            # Collective: the buffers of the rank that had data last, to every rank.
            broadcast_coalesced(self._buffers, src=self.buffer_source)
            self.comm_counter.add_tensors(*self._buffers)
            self._buffers_stale = False

    def shadow_forward(self) -> None:
        """Shadow `training_step`'s buffer broadcast on a rank whose data ran out."""
        if self.broadcast_buffers and self._buffers and self._buffers_stale:
            # Collective: the same broadcast the ranks with data run before their forward.
            broadcast_coalesced(self._buffers, src=self.buffer_source)
            self._buffers_stale = False

    def shadow_backward(self) -> None:
        """Shadow a synchronized backward with zero gradients on a rank whose data ran out."""
        # Collective: the step's bucket all-reduces (and used-parameter map), with zeros from this rank.
        self.reducer.shadow_backward()
        self._buffers_stale = True

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Reset gradients as `optimizer.zero_grad()` does (to None), keeping bucket views attached.

        A parameter that the next step does not use on any rank ends it with `.grad` None, so weight
        decay and momentum leave frozen and unused parameters where they are, as in one process.
        """
        self.reducer.zero_grad([p for group in optimizer.param_groups for p in group["params"]])

    def _check_before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Refuse a step on gradients that a bare `loss.backward()` left unaveraged (a global pre-hook)."""
        reducer = self._reducer
        # Inside `no_sync` a local step is deliberate.
        if reducer is not None and reducer.has_unsynced_gradients and not self._sync_disabled:
            reducer.check_synchronized([p for group in optimizer.param_groups for p in group["params"]])

    # -------------------------------------------------------------- reporting
    def communication_stats(self) -> dict[str, float]:
        """Bytes of the last optimizer step and since setup; collectives and exposed wait of the last sync."""
        reducer = self._reducer
        reducer_stats = {} if reducer is None or reducer.stats().buckets == 0 else reducer.stats().as_dict()
        # The strategy's counter has the last optimizer step's bytes, buffer broadcasts included.
        return {**reducer_stats, **self.comm_counter.as_dict()}

    def __repr__(self) -> str:
        return (
            f"BucketedDDP(bucket_cap_mb={self.bucket_cap_mb}, first_bucket_mb={self.first_bucket_mb}, "
            f"find_unused_parameters={self.find_unused_parameters}, "
            f"gradient_as_bucket_view={self.gradient_as_bucket_view}, overlap={self.overlap}, "
            f"static_graph={self.static_graph})"
        )


class BlockingHookDDP(BucketedDDP):
    """`BucketedDDP` whose comm hook compresses a bucket and blocks until it is averaged (ByteGrad, PowerSGD).

    Such a hook buys no overlap from a small first bucket, so every bucket gets `bucket_cap_mb`; and its
    per-parameter state is keyed by name, so `setup` gives the hook state a ``names`` map (id -> name).
    """

    supports_join = False  # a zero bucket still carries the joined rank's error-feedback memory

    def __init__(
        self,
        comm_hook: CommHook,
        comm_state: Any,
        bucket_cap_mb: float,
        find_unused_parameters: bool,
        backend: str | None,
        timeout: float,
    ) -> None:
        super().__init__(
            bucket_cap_mb=bucket_cap_mb,
            # The hook blocks until its bucket is averaged: a small first bucket would buy no overlap.
            first_bucket_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            comm_hook=comm_hook,
            comm_state=comm_state,
            backend=backend,
            timeout=timeout,
        )

    def setup(self, task: Task) -> None:
        """Build the reducer with the hook, and name every parameter for the hook's per-parameter state."""
        super().setup(task)
        self.comm_state.names = {id(param): name for name, param in task.named_parameters()}
