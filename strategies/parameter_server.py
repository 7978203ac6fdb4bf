"""A parameter server: one rank holds the optimizer, the others only compute gradients.

Algorithm (server rank s, world size W):

    every rank:   g_r = gradient of its micro-batches (accumulated without communication)
                  reduce  g = sum_r g_r / W  onto rank s, bucket by bucket, during the backward
    rank s:       clip g, step the optimizer (the only optimizer state in the job)
    every rank:   broadcast the updated parameters x from rank s

The reduction reuses the core's bucketed reducer with a comm hook that reduces to the server
instead of all-reducing, so it overlaps the backward and skips communication inside an accumulation
window exactly as data parallel does; the result is data parallel's update, computed once. Workers never
let their optimizer see a gradient, so it allocates no state (no momentum, no Adam moments).

With a loss scaler (``precision="16-mixed"``) every rank must skip the same steps: the server, which
alone holds the reduced gradients, tells the others after the backward whether any of them is inf or
NaN, and the workers' (otherwise meaningless) gradients are set to NaN or zero accordingly, so that each
rank's scaler finds what the server's finds.

With ``prefetch=True`` (BytePS's schedule, `comm/parameter_exchange.py`) the server steps the buckets one at a
time, front layers first, and broadcasts each as soon as it is stepped; the workers' next forward waits for each
layer's bucket alone. The weights, the optimizer state and the bytes equal the blocking broadcast's to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.options import OptionError, check_int
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.flat import flatten_by_dtype, unflatten_into
from syncline.strategies.comm.hooks import GradBucket
from syncline.strategies.comm.parameter_exchange import (
    ParameterExchange,
    PrefetchedParameters,
    front_first,
    step_in_buckets,
    steps_per_parameter,
)
from syncline.strategies.comm.process_group import broadcast_coalesced
from syncline.strategies.comm.transfers import all_reduce, all_to_all_in_pieces, broadcast, future_of
from syncline.strategies.reducer_strategy import ReducerStrategy

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["ParameterServer", "ReduceToServerState", "reduce_to_server_hook"]


@dataclass
class ReduceToServerState:
    """What `reduce_to_server_hook` needs: the group, the rank that receives the average, the counter."""

    server_rank: int = 0
    process_group: dist.ProcessGroup | None = None
    counter: CommCounter | None = None


def reduce_to_server_hook(state: ReduceToServerState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket onto the server rank: each worker sends it there (in pieces), the server sums.

    gloo's `reduce` moves data through every rank (the server sent 0.8x the bucket itself, measured); sending
    the bucket straight to the server leaves the server's upload to the parameter broadcast.

    Returns:
        A future whose value is `bucket.buffer`: the average on the server, scratch on the other ranks.
    """
    buffer = bucket.buffer
    world_size, rank = dist.get_world_size(state.process_group), dist.get_rank(state.process_group)
    server = state.server_rank
    # Divide before the sum so low-precision sums cannot overflow.
    buffer.div_(world_size)
    if rank != server:
        sends: list[Tensor | None] = [buffer if peer == server else None for peer in range(world_size)]
        # Collective (point to point, asynchronous): this worker's bucket to the server.
        works = all_to_all_in_pieces(
            sends, [None] * world_size, group=state.process_group, async_op=True, counter=state.counter
        )
        return future_of(works).then(lambda _: buffer)
    received = buffer.new_empty(world_size, buffer.numel())
    # Collective (point to point, asynchronous): every worker's bucket, on the server.
    works = all_to_all_in_pieces([None] * world_size, list(received), group=state.process_group, async_op=True)

    def add(_: Future[Any]) -> Tensor:
        received[rank].copy_(buffer)
        torch.sum(received, dim=0, out=buffer)
        return buffer

    return future_of(works).then(add)


class ParameterServer(PrefetchedParameters, ReducerStrategy):
    """Reduce gradients to one server rank, step there alone, broadcast the parameters back.

    Args:
        server_rank: the rank that holds the optimizer state and steps.
        bucket_cap_mb: the most MiB of gradients per bucket (one reduce each).
        find_unused_parameters: as in `BucketedDDP`.
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.
        prefetch: broadcast each bucket's parameters as soon as the server has stepped it, and let the next
            forward wait per layer (`comm/parameter_exchange.py`); bit-identical to the blocking broadcast. With a
            per-parameter optimizer (`steps_per_parameter`) the server steps bucket by bucket; with another, it
            takes the whole step first. Automatic optimization only: manual optimization is refused at setup.

    Raises:
        ValueError: at setup, when `server_rank` is not a rank of the job.
    """

    name = "parameter_server"
    fixed_cap_because = (
        "the time autotuning compares (the backward's) leaves out its parameter broadcast after the step, "
        "which the cap does not shape"
    )

    def __init__(
        self,
        server_rank: int = 0,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        backend: str | None = None,
        timeout: float = 300.0,
        prefetch: bool = False,
    ) -> None:
        check_int("ParameterServer", "server_rank", server_rank, 0, meaning="the rank that steps the optimizer")
        super().__init__(
            bucket_cap_mb,
            # As data parallel: a small first bucket starts communication early (never above the cap).
            first_bucket_mb=None,
            find_unused_parameters=find_unused_parameters,
            comm_hook=reduce_to_server_hook,
            comm_state=ReduceToServerState(server_rank),
            backend=backend,
            timeout=timeout,
        )
        self.server_rank = server_rank
        self.prefetch = prefetch
        self._params: list[Tensor] = []
        self._task: Task | None = None
        #: With `prefetch`, the broadcasts in flight (after setup).
        self.exchange: ParameterExchange | None = None
        self._sent: set[int] = set()
        self._groups: list[list[Tensor]] = []
        self._order: list[int] = []

    @property
    def is_server(self) -> bool:
        """Whether this rank holds the optimizer state and steps."""
        return self.global_rank == self.server_rank

    def check_world_size(self, world_size: int) -> None:
        """Check the server is a rank of a job of `world_size` processes."""
        if self.server_rank >= world_size:
            raise OptionError(
                f"ParameterServer(server_rank={self.server_rank}) needs at least {self.server_rank + 1} processes, "
                f"but the job has {world_size}; pick a server_rank below {world_size} (strategy.server_rank=0)."
            )

    def after_setup(self, task: Task) -> None:
        """Remember the parameters the server broadcasts; with `prefetch`, hook the forward to wait per layer."""
        self._params = [p for p in task.parameters() if p.requires_grad]
        self._task = task
        if self.prefetch:
            self.exchange = ParameterExchange(task)

    # -------------------------------------------------------------- train step
    def before_backward(self, sync: bool) -> None:
        """Before a backward that reduces the gradients onto the server.

        A manual optimization step may add a backward to gradients an earlier one reduced already: the server
        holds their average and the workers zeros, so the server multiplies its buffers by the world size
        first, which the reduction's division undoes (``(W * avg + g_server + sum of g_workers) / W``).

        Raises:
            RuntimeError: a backward of a manual step inside `no_sync`: the server could not tell its local
                gradients from reduced ones.
        """
        if self.manual_optimization and not self._backward_syncs(sync):
            raise RuntimeError(
                "ParameterServer reduces every backward of a manual optimization step: leave out "
                "strategy.no_sync() (accumulating by stepping every N batches needs no local accumulation)."
            )
        if self.manual_optimization and self.is_server:
            for bucket in self.reducer.buckets:
                bucket.buffer.mul_(self.world_size)

    def after_backward(self) -> None:
        """The gradients are reduced onto the server: make every rank agree on their finiteness."""
        self._agree_on_finiteness()

    def clip_gradients(self, parameters: list[Tensor], max_norm: float, algorithm: str = "norm") -> Tensor:
        """Clip on the server, which holds the averaged gradients; workers, which hold none, return 0."""
        if self.is_server:
            return super().clip_gradients(parameters, max_norm, algorithm)
        return torch.zeros((), device=self.root_device)

    def apply_update(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Step on the server alone; with `prefetch`, bucket by bucket, each broadcast as soon as it is stepped."""
        prefetching = self._start_prefetch()
        if self.is_server and prefetching and steps_per_parameter(optimizer):
            buckets = [(index, self._groups[index]) for index in self._order]
            step_in_buckets(optimizer, step, buckets, self._send)
        elif self.is_server:
            step()
        else:
            # The loss scaler (if any) has read the gradients already; with none left, the optimizer
            # changes nothing and allocates no state, while the scaler still skips or not as the server does.
            params = [p for group in optimizer.param_groups for p in group["params"]]
            grads = [p.grad for p in params]
            for param in params:
                param.grad = None
            step()
            for param, grad in zip(params, grads):
                param.grad = grad

    def after_optimizer_step(self) -> None:
        """Broadcast the server's updated parameters to every rank (with `prefetch`, the buckets not yet sent,
        without waiting)."""
        if self.exchange is None:
            # Collective: the server's updated parameters to every rank, one broadcast per dtype.
            broadcast_coalesced(self._params, src=self.server_rank, counter=self.comm_counter)
        else:
            # A worker's buckets, and the server's when its step was skipped (fp16) or taken whole.
            for index in self._order:
                if index not in self._sent:
                    self._send(index)

    def _start_prefetch(self) -> bool:
        """Before a step with `prefetch`: lay out the broadcasts as the buckets are now; False without prefetch."""
        self._sent = set()
        if self.exchange is None:
            return False
        wanted = {id(p) for p in self._params}
        reducer = self.reducer
        groups = [[p for p in bucket.parameters if id(p) in wanted] for bucket in reducer.buckets]
        placed = {id(p) for group in groups for p in group}
        # Parameters outside the buckets (sparse gradients) go in one more broadcast.
        groups.append([p for p in self._params if id(p) not in placed])
        self._groups = [group for group in groups if group]
        assert self._task is not None
        self._order = front_first(self._groups, self._task)
        self.exchange.set_layout(self._groups)
        return True

    def _send(self, index: int) -> None:
        """Launch the broadcast of bucket `index`'s parameters (the server's values, as they are now)."""
        assert self.exchange is not None
        self._sent.add(index)
        flats = flatten_by_dtype(self._groups[index])
        # Collective (asynchronous): this bucket's parameters from the server, one broadcast per dtype.
        works = [broadcast(flat, self.server_rank, self.comm_counter) for _, flat in flats]
        if self.is_server:
            self.exchange.launch(index, works, None)  # its parameters hold the values already
            return

        def write() -> None:
            for tensors, flat in flats:
                unflatten_into(tensors, flat)

        self.exchange.launch(index, works, write)

    def _agree_on_finiteness(self) -> None:
        """Make every rank's gradients inf/NaN-free exactly when the server's reduced ones are."""
        buffers = [bucket.buffer for bucket in self.reducer.buckets]
        if self.is_server:
            flag = torch.stack([torch.isfinite(buffer).all() for buffer in buffers]).all().logical_not().float()
        else:
            flag = torch.zeros((), device=self.root_device)
        flag = flag.reshape(1)
        # Collective: the server's verdict to every rank (the workers contribute 0).
        all_reduce(flag, self.comm_counter, op=dist.ReduceOp.MAX)
        if not self.is_server:
            # Host sync: the verdict decides what the workers' scratch gradients become.
            value = float("nan") if flag.item() else 0.0
            for buffer in buffers:
                buffer.fill_(value)

    # ------------------------------------------------------------ checkpoints
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Return the server's optimizer state on every rank (a collective when the server is not rank 0)."""
        if self.server_rank == 0:
            return optimizer.state_dict()
        # Collective: the server's state to rank 0, which writes the checkpoint.
        return self.broadcast_object(optimizer.state_dict() if self.is_server else None, src=self.server_rank)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Give the server the whole state; workers keep only the hyperparameters (learning rates...)."""
        optimizer.load_state_dict(state if self.is_server else {"state": {}, "param_groups": state["param_groups"]})

    def __repr__(self) -> str:
        prefetch = ", prefetch=True" if self.prefetch else ""
        return f"ParameterServer(server_rank={self.server_rank}, bucket_cap_mb={self.bucket_cap_mb}{prefetch})"
