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

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from strategies.backward_sync import BackwardSyncControl
from strategies.comm_hooks import COMM_HOOKS, CommHook
from strategies.process_group import (
    default_backend,
    destroy_process_group,
    device_for_local_rank,
    init_process_group_from_env,
)
from strategies.reducer import Reducer
from strategies.strategy import ReduceOp, Strategy

if TYPE_CHECKING:
    from trainer.task import Task

__all__ = ["BucketedDDP", "broadcast_coalesced"]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class BucketedDDP(BackwardSyncControl, Strategy):
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
            the name of one in `COMM_HOOKS` ("allreduce", "fp16"); None is "allreduce".
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.
        overlap: launch each bucket as soon as its gradients are ready; False waits for the end of
            the backward (to measure what overlap buys).
        comm_state: the state object passed to a custom `comm_hook`; None gives the default hooks'
            `AllreduceState`.
    """

    name = "bucketed_ddp"

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool = True,
        comm_hook: CommHook | str | None = None,
        backend: str | None = None,
        timeout: float = 1800.0,
        overlap: bool = True,
        comm_state: Any = None,
    ) -> None:
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
        self.backend = backend
        self.timeout = timeout
        self.overlap = overlap
        self._created_group = False
        self._reducer: Reducer | None = None
        self._buffers: list[Tensor] = []
        self._buffers_stale = True
        self._outputs: list[Any] = []

    # ---------------------------------------------------------------- identity
    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.global_rank))

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))

    @property
    def root_device(self) -> torch.device:
        backend = dist.get_backend() if dist.is_initialized() else (self.backend or default_backend())
        return device_for_local_rank(self.local_rank, backend)

    @property
    def reducer(self) -> Reducer:
        """The reducer built by `setup`."""
        if self._reducer is None:
            raise RuntimeError("BucketedDDP.setup(task) has not been called yet.")
        return self._reducer

    # --------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        """Join the default process group from RANK, WORLD_SIZE, ... unless already in one."""
        self._created_group = init_process_group_from_env(self.backend, self.timeout)

    def setup(self, task: Task) -> None:
        """Move `task` to the device, check all ranks agree on it, copy rank 0's state, build the reducer.

        Raises:
            ValueError: the ranks' models differ in parameter names, shapes or dtypes.
        """
        task.to(self.root_device)
        self._check_same_parameters(task)
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
        )

    def teardown(self) -> None:
        """Remove the reducer's hooks; leave the process group if `setup_environment` joined it."""
        if self._reducer is not None:
            self._reducer.remove_hooks()
            self._reducer = None
        self._outputs = []
        if self._created_group:
            destroy_process_group()
            self._created_group = False

    # -------------------------------------------------------------- train step
    def training_step(self, task: Task, batch: Any, batch_idx: int) -> Any:
        """Refresh buffers from rank 0 if a synchronized step changed them, then run the forward."""
        if self.broadcast_buffers and self._buffers and self._buffers_stale:
            # Collective: every rank's forward sees rank 0's buffers, as torch's DDP does.
            broadcast_coalesced(self._buffers)
            self._buffers_stale = False
        output = task.training_step(batch, batch_idx)
        if self.find_unused_parameters:
            # Kept until `backward`, whose reducer walks their graph if that backward synchronizes.
            self._outputs.append(output)
        return output

    def backward(self, loss: Tensor, *, sync: bool) -> None:
        """Back-propagate `loss`; average gradients across ranks only when `sync` is true."""
        reducer = self.reducer
        sync = self._backward_syncs(sync)
        outputs, self._outputs = [*self._outputs, loss], []
        reducer.prepare_for_backward(sync=sync, outputs=outputs if self.find_unused_parameters else None)
        loss.backward()
        reducer.finalize_backward()
        if sync:
            self._buffers_stale = True

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero gradients; in place when they are bucket views, so the views stay attached."""
        optimizer.zero_grad(set_to_none=not self.gradient_as_bucket_view)

    # ------------------------------------------------------------- collectives
    def reduce(self, tensor: Tensor, op: ReduceOp = "mean") -> Tensor:
        """Return `tensor` reduced across ranks with `op`; the input is not modified."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"Unknown reduce op {op!r}. Valid: {', '.join(_REDUCE_OPS)}.")
        result = tensor.detach().clone()
        # Collective: all-reduce of a metric.
        dist.all_reduce(result, op=_REDUCE_OPS[op])
        return result / self.world_size if op == "mean" else result

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        # Collective: every rank's object, pickled.
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        # Collective: rank `src`'s object, pickled.
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        # Collective: wait for every rank.
        dist.barrier()

    # -------------------------------------------------------------- reporting
    def communication_stats(self) -> dict[str, float]:
        """Collectives, bytes and exposed wait of the last synchronized backward; empty before one."""
        if self._reducer is None or self._reducer.stats().buckets == 0:
            return {}
        return self._reducer.stats().as_dict()

    def __repr__(self) -> str:
        return (
            f"BucketedDDP(bucket_cap_mb={self.bucket_cap_mb}, first_bucket_mb={self.first_bucket_mb}, "
            f"find_unused_parameters={self.find_unused_parameters}, "
            f"gradient_as_bucket_view={self.gradient_as_bucket_view}, overlap={self.overlap})"
        )

    # ----------------------------------------------------------------- helpers
    def _check_same_parameters(self, task: Task) -> None:
        """Raise on every rank if any two ranks' parameters differ in name, shape, dtype or requires_grad."""
        mine = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in task.named_parameters()]
        everyone = self.all_gather_object(mine)
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs != everyone[0]:
                raise ValueError(
                    f"The model differs across ranks, so their gradients cannot be averaged: "
                    f"{_first_difference(everyone[0], theirs, rank)}. Build the same model on every rank."
                )


def broadcast_coalesced(tensors: list[Tensor], src: int = 0) -> None:
    """Overwrite `tensors` with rank `src`'s values, one broadcast per dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for group in groups.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            # Collective: one broadcast for all tensors of this dtype.
            dist.broadcast(flat, src=src)
            for tensor, value in zip(group, flat.split([t.numel() for t in group])):
                tensor.copy_(value.view_as(tensor))


def _first_difference(
    reference: list[tuple[str, tuple[int, ...], str, bool]],
    other: list[tuple[str, tuple[int, ...], str, bool]],
    rank: int,
) -> str:
    """Describe the first parameter in which rank `rank`'s model differs from rank 0's."""
    for mine, theirs in zip(reference, other):
        if mine != theirs:
            name, shape, dtype, grad = mine
            o_name, o_shape, o_dtype, o_grad = theirs
            if name != o_name:
                return f"parameter {name!r} on rank 0 is {o_name!r} on rank {rank}"
            return (
                f"parameter {name!r} is (shape={shape}, dtype={dtype}, requires_grad={grad}) on rank 0 "
                f"but (shape={o_shape}, dtype={o_dtype}, requires_grad={o_grad}) on rank {rank}"
            )
    common = min(len(reference), len(other))
    if len(reference) > common:
        return f"parameter {reference[common][0]!r} exists on rank 0 but not on rank {rank}"
    return f"parameter {other[common][0]!r} exists on rank {rank} but not on rank 0"
