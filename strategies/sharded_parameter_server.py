"""A sharded parameter server: every rank serves one slice of the parameters (ZeRO stage 1, Rajbhandari et al. 2020).

Algorithm (world size W, rank r; every gradient bucket b of n_b elements cut into W chunks of
c_b = ceil(n_b / W), chunk r belonging to rank r):

    every rank:   g_r = gradient of its micro-batches (accumulated without communication)
                  reduce-scatter  g[b, chunk r] = sum_r' g_r'[b, chunk r] / W, bucket by bucket, during the backward
    rank r:       clip with the global norm  ||g|| = sqrt(all-reduce of the shards' squared norms)
                  step the optimizer on its chunks only (1/W of the optimizer state)
    every rank:   all-gather the updated chunks into every parameter

The reduce-scatter is a comm hook of the bucketed reducer, so it overlaps the backward and skips
communication inside an accumulation window as data parallel does. The buckets keep the layout of
construction, so each rank serves the same slice of every parameter for the whole run.

The user's optimizer object stays the one the Trainer and the LR schedulers hold: its param groups keep
their hyperparameters, and their parameters become this rank's slices (flat views that share storage with
the parameters, whose `.grad` are views into the reduced buckets). Its state then covers 1/W of the
parameters. This is exact for optimizers whose update is elementwise (SGD, Adam, AdamW, RMSprop, ...),
which are the ones accepted. Checkpoints hold the whole state as one ordinary `optimizer.state_dict()`,
gathered on save and sliced again on load, so a run resumes on any number of processes. The optimizer
stays sharded after `fit` (a checkpoint saved then is still whole); `optimizer.state_dict()` itself
describes this rank's slices only.

With a loss scaler (``precision="16-mixed"``) a rank sees only its slice of the gradients: after the
backward the ranks agree whether any slice holds inf or NaN, and if one does, every rank's slice is set
to NaN, so that every rank's scaler skips the step.

Manual optimization (several optimizers, several backwards per batch) shards every optimizer the task
configures, and each `opt.step()` steps that optimizer's slices, then all-gathers the buckets holding its
parameters. A backward may add to gradients an earlier one reduced: after each backward the ranks zero the
chunks they do not serve, and before the next one each rank multiplies its buckets by W, which the
reduce-scatter's division undoes (``(W * avg_r + sum of the ranks' new gradients) / W`` in chunk r). With a
loss scaler the ranks then agree per parameter, so that an optimizer whose gradients are finite steps.

With ``prefetch=True`` (ZeRO's prefetch, `comm/parameter_exchange.py`) every rank steps its slices bucket by
bucket, front layers first, and launches each bucket's all-gather as soon as its slices are stepped; the next
forward waits for each layer's bucket alone. The weights, the optimizer state and the bytes equal the blocking
all-gather's to the bit. It is for automatic optimization: a manual step runs other forwards, reads and steps
between an `opt.step()` and the next forward, so the Trainer refuses it there at setup.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.hooks import GradBucket
from syncline.strategies.comm.parameter_exchange import (
    PER_PARAMETER_OPTIMIZERS,
    ParameterExchange,
    PrefetchedParameters,
    front_first,
    step_in_buckets,
)
from syncline.strategies.comm.transfers import all_gather_in_pieces, all_reduce, all_to_all_in_pieces, future_of
from syncline.strategies.reducer_strategy import ReducerStrategy

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ReduceScatterState", "ShardedParameterServer", "reduce_scatter_hook"]

#: Optimizers whose update of an element depends on that element alone, so a slice can be stepped alone: torch's
#: per-parameter ones but ASGD (kept out as before; its averaging has not been checked on slices).
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    optimizer for optimizer in PER_PARAMETER_OPTIMIZERS if optimizer is not torch.optim.ASGD
)


@dataclass
class ReduceScatterState:
    """What `reduce_scatter_hook` needs: the group and the counter of bytes."""

    process_group: dist.ProcessGroup | None = None
    counter: CommCounter | None = None


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return the [start, stop) of `rank`'s chunk of a bucket of `numel` elements (empty past the end)."""
    chunk = math.ceil(numel / world_size)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def reduce_scatter_hook(state: ReduceScatterState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket so that each rank gets its own chunk: a scatter of the chunks, then a local sum.

    gloo's own reduce-scatter is an all-reduce underneath (it sends the whole bucket); sending chunk j to
    rank j, in pieces, sends (W-1)/W of it, as a ring reduce-scatter does.

    Returns:
        A future whose value is `bucket.buffer`, holding the average in this rank's chunk (the rest is scratch).
    """
    buffer = bucket.buffer
    world_size, rank = dist.get_world_size(state.process_group), dist.get_rank(state.process_group)
    # Divide before the reduction so low-precision sums cannot overflow.
    buffer.div_(world_size)
    chunk = math.ceil(buffer.numel() / world_size)
    padding = chunk * world_size - buffer.numel()
    full = torch.cat([buffer, buffer.new_zeros(padding)]) if padding else buffer
    parts = list(full.split(chunk))
    received = buffer.new_empty(world_size, chunk)
    # Collective (point to point, asynchronous): chunk j to rank j; every rank's version of this rank's chunk.
    works = all_to_all_in_pieces(parts, list(received), group=state.process_group, async_op=True, counter=state.counter)
    start, stop = shard_range(buffer.numel(), rank, world_size)

    def write_chunk(_: Future[Any]) -> Tensor:
        received[rank].copy_(parts[rank])
        buffer[start:stop].copy_(received.sum(dim=0)[: stop - start])
        return buffer

    return future_of(works).then(write_chunk)


@dataclass(eq=False)
class Slice:
    """The part of one parameter this rank serves: elements [start, stop) of its flattened value."""

    param: Tensor
    start: int
    stop: int
    #: The elements themselves (a flat view sharing storage with `param`): what the optimizer steps.
    value: Tensor
    #: Their reduced gradient (a view into the bucket).
    grad: Tensor


class ShardedParameterServer(PrefetchedParameters, ReducerStrategy):
    """Reduce-scatter gradients, step each rank's slice of the parameters, all-gather them back.

    Args:
        bucket_cap_mb: the most MiB of gradients per bucket (one reduce-scatter and one all-gather each).
        find_unused_parameters: as in `BucketedDDP`.
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.
        prefetch: all-gather each bucket as soon as this rank's slices of it are stepped, and let the next forward
            wait per layer (`comm/parameter_exchange.py`); bit-identical to the blocking all-gather. Automatic
            optimization only: a task that steps its own optimizers is refused at setup (`manual_optimization_refused`).

    Raises:
        TypeError: when the task's optimizer is not one whose update is elementwise (`ELEMENTWISE_OPTIMIZERS`).
        ValueError: a parameter is not contiguous in memory.
    """

    name = "sharded_parameter_server"
    # Each rank serves fixed slices of fixed buckets: rebuilding the buckets would move optimizer state.
    fixed_layout = True
    fixed_cap_because = "each rank serves fixed slices of fixed buckets: another layout would move its optimizer state"

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        backend: str | None = None,
        timeout: float = 300.0,
        prefetch: bool = False,
    ) -> None:
        super().__init__(
            bucket_cap_mb,
            # As data parallel: a small first bucket starts communication early (never above the cap).
            first_bucket_mb=None,
            find_unused_parameters=find_unused_parameters,
            comm_hook=reduce_scatter_hook,
            comm_state=ReduceScatterState(),
            backend=backend,
            timeout=timeout,
        )
        self._slices: dict[int, list[Slice]] = {}  # by id of the parameter
        #: Per sharded optimizer (by id): each param group's own parameters, as it had them before sharding.
        self._group_params: dict[int, list[list[Tensor]]] = {}
        #: Per sharded optimizer (by id): the indices of the buckets holding its parameters (gathered after its step).
        self._buckets_of: dict[int, list[int]] = {}
        self._stepped: list[int] = []  # the buckets the last step changed
        #: Every bucket's [start, stop): this rank's chunk of it.
        self._chunks: list[tuple[int, int]] = []
        #: Every parameter of the buckets (by id), numbered alike on every rank: per-parameter verdicts.
        self._param_index: dict[int, int] = {}
        self.prefetch = prefetch
        #: With `prefetch`, the all-gathers in flight (after setup).
        self.exchange: ParameterExchange | None = None
        #: The buckets in the order their all-gathers are launched (front layers first with `prefetch`).
        self._order: list[int] = []
        self._sent: set[int] = set()
        #: This rank's slices (what the optimizer steps) in each bucket.
        self._bucket_slices: list[list[Tensor]] = []

    # --------------------------------------------------------------- lifecycle
    def after_setup(self, task: Task) -> None:
        """Find this rank's slice of every bucket."""
        self._group_params, self._buckets_of, self._stepped = {}, {}, []
        rank, world_size = self.global_rank, self.world_size
        slices: dict[int, list[Slice]] = {}
        self._chunks = [shard_range(bucket.buffer.numel(), rank, world_size) for bucket in self.reducer.buckets]
        self._param_index = {id(p): i for i, p in enumerate(p for b in self.reducer.buckets for p in b.parameters)}
        self._bucket_slices = []
        for bucket, (start, stop) in zip(self.reducer.buckets, self._chunks):
            self._bucket_slices.append([])
            for param, offset in zip(bucket.parameters, bucket.offsets):
                if not param.is_contiguous():
                    raise ValueError(
                        f"ShardedParameterServer needs contiguous parameters; {_name(task, param)} is not. "
                        "Make it contiguous (param.data = param.data.contiguous()) before training."
                    )
                first, last = max(start, offset) - offset, min(stop, offset + param.numel()) - offset
                if first < last:
                    flat = param.detach().view(-1)
                    grad = bucket.buffer[offset + first : offset + last]
                    slices.setdefault(id(param), []).append(Slice(param, first, last, flat[first:last], grad))
                    self._bucket_slices[-1].append(slices[id(param)][-1].value)
        self._slices = slices
        buckets = [bucket.parameters for bucket in self.reducer.buckets]
        self._order = list(range(len(buckets)))
        if self.prefetch:
            # The layout is fixed: the same buckets, in the same order, every step.
            self._order = front_first(buckets, task)
            self.exchange = ParameterExchange(task)
            self.exchange.set_layout(buckets)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer` step this rank's slices: each param group keeps its hyperparameters.

        Raises:
            TypeError: the optimizer's update is not elementwise, so a slice cannot be stepped alone.
            ValueError: the optimizer has stepped already (it holds state for whole parameters).
        """
        if id(optimizer) in self._group_params:
            return
        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
            raise TypeError(
                f"ShardedParameterServer steps each rank's slice of the parameters alone, which is exact only for "
                f"optimizers whose update is elementwise ({names}); configure_optimizers returned "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}. Use one of those, or "
                "strategy=parameter_server, which steps whole parameters."
            )
        if optimizer.state:
            raise ValueError(
                "ShardedParameterServer must shard the optimizer before its first step, but it holds state already; "
                "pass a fresh optimizer (load a checkpoint through the Trainer's ckpt_path instead)."
            )
        group_params = [list(group["params"]) for group in optimizer.param_groups]
        for group, params in zip(optimizer.param_groups, group_params):
            # Parameters outside the reducer (frozen ones) stay whole: they never get a gradient.
            group["params"] = [s.value for p in params for s in self._slices.get(id(p), [])] + [
                p for p in params if not p.requires_grad
            ]
        self._group_params[id(optimizer)] = group_params
        mine = {id(p) for params in group_params for p in params}
        self._buckets_of[id(optimizer)] = [
            index
            for index, bucket in enumerate(self.reducer.buckets)
            if any(id(param) in mine for param in bucket.parameters)
        ]

    def optimizer_parameters(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """Return the whole parameters `optimizer` updates (its param groups hold this rank's slices of them)."""
        groups = self._group_params.get(id(optimizer))
        if groups is None:
            return super().optimizer_parameters(optimizer)
        return [p for params in groups for p in params]

    # -------------------------------------------------------------- train step
    def before_backward(self, sync: bool) -> None:
        """Before a backward that reduce-scatters the gradients.

        A backward of a manual optimization step may add to gradients an earlier one reduce-scattered: each
        rank's buckets then hold the average in its own chunk and zeros elsewhere, so each rank multiplies them
        by the world size first, which the reduce-scatter's division undoes.

        Raises:
            RuntimeError: a backward of a manual step inside `no_sync`: a rank could not tell its local gradients
                from its reduced chunk.
        """
        if self.manual_optimization:
            if not self._backward_syncs(sync):
                raise RuntimeError(
                    "ShardedParameterServer reduce-scatters every backward of a manual optimization step: leave "
                    "out strategy.no_sync() (accumulating by stepping every N batches needs no local accumulation)."
                )
            for bucket in self.reducer.buckets:
                bucket.buffer.mul_(self.world_size)

    def after_backward(self) -> None:
        """The gradients are reduce-scattered: attach each slice's, and agree on their finiteness."""
        self._attach_and_agree()
        if self.manual_optimization:
            # The chunks other ranks serve hold this rank's scratch: zeros, so the next backward adds to nothing.
            for bucket, (start, stop) in zip(self.reducer.buckets, self._chunks):
                bucket.buffer[:start].zero_()
                bucket.buffer[stop:].zero_()

    def clip_gradients(self, parameters: list[Tensor], max_norm: float, algorithm: str = "norm") -> Tensor:
        """Clip every rank's slices by the global 2-norm of all gradients (all-reduced squared norms); by
        value, each rank clamps its own slices (elementwise, so no collective is needed)."""
        grads = [s.grad for s in self._slices_of(parameters)]
        if algorithm == "value":
            for grad in grads:
                grad.clamp_(-max_norm, max_norm)
            return torch.zeros((), device=self.root_device)
        squares = torch.zeros(1, dtype=torch.float32, device=self.root_device)
        if grads:
            squares += torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]).sum()
        # Collective: the sum of every rank's squared norm is the squared norm of the whole gradient.
        all_reduce(squares, self.comm_counter)
        total = squares.sqrt().reshape(())
        # As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), never up.
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total

    def apply_update(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Step this rank's slices of `optimizer`'s parameters; with `prefetch`, bucket by bucket, each all-gathered as
        soon as it is stepped."""
        self.setup_optimizer(optimizer)
        self._sent = set()
        # A manual step changes only this optimizer's buckets; an automatic one (one optimizer) gathers them all.
        self._stepped = self._buckets_of[id(optimizer)] if self.manual_optimization else self._order
        if self.exchange is None:
            step()
            return
        buckets = [(index, self._bucket_slices[index]) for index in self._order]
        # The optimizer is elementwise (setup_optimizer checked it), so a bucket's slices step as in the whole.
        step_in_buckets(optimizer, step, buckets, self._launch_gather)

    def after_optimizer_step(self) -> None:
        """All-gather the stepped buckets' updated slices into the parameters (with `prefetch`, launch those not yet
        launched, a skipped fp16 step's, and return)."""
        if self.exchange is not None:
            for index in self._order:
                if index not in self._sent:
                    self._launch_gather(index)
            return
        self._gather_parameters(self._stepped)

    # ----------------------------------------------------------------- helpers
    def _slices_of(self, parameters: Iterable[Tensor]) -> list[Slice]:
        return [s for p in parameters for s in self._slices.get(id(p), [])]

    def _all_slices(self) -> list[Slice]:
        return [s for slices in self._slices.values() for s in slices]

    def _attach_and_agree(self) -> None:
        """Point every slice's `.grad` at its reduced chunk; if any rank's chunk is not finite, poison all (under
        manual optimization, all of that parameter's)."""
        slices = self._all_slices()
        for s in slices:
            # A parameter no rank used (find_unused_parameters) keeps .grad None, so the optimizer skips it.
            s.value.grad = None if s.param.grad is None else s.grad
        if self.manual_optimization:
            self._agree_per_parameter(slices)
            return
        finite = torch.stack([torch.isfinite(s.grad).all() for s in slices]).all() if slices else torch.tensor(True)
        flag = finite.logical_not().float().reshape(1).to(self.root_device)
        # Collective: whether any rank's slice of the gradients holds inf or NaN.
        all_reduce(flag, self.comm_counter, op=dist.ReduceOp.MAX)
        # Host sync: the verdict decides whether this rank's slice must carry the others' inf.
        if flag.item() and finite:
            for s in slices:
                s.grad.fill_(float("nan"))

    def _agree_per_parameter(self, slices: list[Slice]) -> None:
        """Poison every rank's slices of each parameter that holds inf or NaN on some rank: several optimizers
        each skip or take their step on their own parameters, as one process's loss scaler decides."""
        bad = torch.zeros(len(self._param_index), dtype=torch.float32, device=self.root_device)
        if slices:
            index = torch.tensor([self._param_index[id(s.param)] for s in slices], device=self.root_device)
            nonfinite = torch.stack([torch.isfinite(s.grad).all().logical_not() for s in slices]).float()
            bad.scatter_reduce_(0, index, nonfinite, "amax")
        # Collective: per parameter, whether any rank's slice of its gradient holds inf or NaN.
        all_reduce(bad, self.comm_counter, op=dist.ReduceOp.MAX)
        # Host sync: the verdicts decide which slices must carry the others' inf.
        if bad.any().item():
            verdicts = bad.tolist()
            for s in slices:
                if verdicts[self._param_index[id(s.param)]]:
                    s.grad.fill_(float("nan"))

    @torch.no_grad()
    def _gather_parameters(self, indices: list[int]) -> None:
        """All-gather the chunks of updated parameter values of the buckets `indices`, into the parameters."""
        pending = [(index, *self._start_gather(index)) for index in indices]
        for index, gathered, works in pending:
            for work in works:
                work.wait()
            self._write_gathered(index, gathered)

    def _launch_gather(self, index: int) -> None:
        """Launch bucket `index`'s all-gather, landed by the forward that needs its parameters (`prefetch`)."""
        assert self.exchange is not None
        self._sent.add(index)
        gathered, works = self._start_gather(index)
        self.exchange.launch(index, works, lambda: self._write_gathered(index, gathered))

    @torch.no_grad()
    def _start_gather(self, index: int) -> tuple[Tensor, list[Any]]:
        """Start the all-gather of this rank's chunk of bucket `index`'s updated values; return where it lands."""
        bucket = self.reducer.buckets[index]
        world_size, rank = self.world_size, self.global_rank
        numel = bucket.buffer.numel()
        chunk = math.ceil(numel / world_size)
        start, stop = shard_range(numel, rank, world_size)
        pieces = [
            param.detach().view(-1)[max(start, offset) - offset : min(stop, offset + param.numel()) - offset]
            for param, offset in zip(bucket.parameters, bucket.offsets)
            if max(start, offset) < min(stop, offset + param.numel())
        ]
        mine = bucket.buffer.new_zeros(chunk, dtype=bucket.parameters[0].dtype)
        if pieces:
            torch.cat(pieces, out=mine[: stop - start])
        # Collective: asynchronous all-gather of every rank's updated chunk of this bucket.
        return all_gather_in_pieces(mine, world_size, async_op=True, counter=self.comm_counter)

    @torch.no_grad()
    def _write_gathered(self, index: int, gathered: Tensor) -> None:
        """Copy bucket `index`'s gathered values into its parameters."""
        bucket = self.reducer.buckets[index]
        for param, offset in zip(bucket.parameters, bucket.offsets):
            param.view(-1).copy_(gathered[offset : offset + param.numel()])

    # ------------------------------------------------------------ checkpoints
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Gather every rank's slices of the optimizer state into one ordinary, whole `state_dict` (a collective)."""
        self.setup_optimizer(optimizer)
        group_params = self._group_params[id(optimizer)]
        params = [p for group in group_params for p in group]
        mine: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
        for index, param in enumerate(params):
            for s in self._slices.get(id(param), []):
                if s.value in optimizer.state:
                    state = {k: _to_cpu(v) for k, v in optimizer.state[s.value].items()}
                    mine.setdefault(index, []).append((s.start, s.stop, state))
        # Collective: every rank's slices of the state (pickled; rank 0 writes the checkpoint).
        everyone = self.all_gather_object(mine)
        state: dict[int, dict[str, Any]] = {}
        for index, param in enumerate(params):
            pieces = sorted((piece for theirs in everyone for piece in theirs.get(index, [])), key=lambda p: p[0])
            if pieces:
                state[index] = _join_slices(type(optimizer).__name__, param, pieces)
        groups, first = [], 0
        for group, own in zip(optimizer.param_groups, group_params):
            saved = {k: v for k, v in group.items() if k != "params"}
            groups.append({**saved, "params": list(range(first, first + len(own)))})
            first += len(own)
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a whole `state_dict` (from any number of processes): hyperparameters, and this rank's slices.

        Raises:
            ValueError: the saved param groups do not match the optimizer's.
        """
        self.setup_optimizer(optimizer)
        group_params = self._group_params[id(optimizer)]
        saved_groups = state["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(params) for params in group_params]:
            raise ValueError(
                "The checkpoint's optimizer has param groups of "
                f"{[len(g['params']) for g in saved_groups]} parameters, the task's optimizer "
                f"{[len(params) for params in group_params]}; resume with the same configure_optimizers()."
            )
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        optimizer.state.clear()
        saved_state = state["state"]
        for saved, params in zip(saved_groups, group_params):
            for index, param in zip(saved["params"], params):
                entry = saved_state.get(index, saved_state.get(str(index)))
                if entry is None:
                    continue
                for s in self._slices.get(id(param), []):
                    optimizer.state[s.value] = {k: _slice_of(k, v, param, s) for k, v in entry.items()}

    def __repr__(self) -> str:
        prefetch = ", prefetch=True" if self.prefetch else ""
        return f"ShardedParameterServer(bucket_cap_mb={self.bucket_cap_mb}{prefetch})"


def _join_slices(optimizer: str, param: Tensor, pieces: list[tuple[int, int, dict[str, Any]]]) -> dict[str, Any]:
    """Join the ranks' slices of one parameter's state into the state of the whole parameter."""
    covered = [(start, stop) for start, stop, _ in pieces]
    if covered[0][0] != 0 or covered[-1][1] != param.numel() or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
        raise RuntimeError(f"The ranks' slices of a parameter of {tuple(param.shape)} do not cover it: {covered}.")
    joined: dict[str, Any] = {}
    for key, value in pieces[0][2].items():
        # As torch's Optimizer.load_state_dict, "step" is the one entry that is not per element.
        if key != "step" and isinstance(value, Tensor) and value.dim() == 1:
            joined[key] = torch.cat([state[key] for _, _, state in pieces]).view(param.shape)
            continue
        if key != "step" and isinstance(value, Tensor) and value.numel() != pieces[0][1] - pieces[0][0]:
            raise TypeError(
                f"{optimizer} keeps state {key!r} of shape {tuple(value.shape)} for a slice of "
                f"{pieces[0][1] - pieces[0][0]} elements: not an elementwise state ShardedParameterServer can join."
            )
        joined[key] = value
    return joined


def _slice_of(key: str, value: Any, param: Tensor, piece: Slice) -> Any:
    """Return this rank's slice of one entry of a whole parameter's state ("step" and non-tensors stay whole)."""
    if not isinstance(value, Tensor):
        return value
    if key != "step" and value.shape == param.shape:
        return value.reshape(-1)[piece.start : piece.stop].to(piece.value.device, copy=True)
    return value.clone()


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _name(task: Task, param: Tensor) -> str:
    return next((f"parameter {name!r}" for name, p in task.named_parameters() if p is param), "a parameter")
