"""Join and leave the default process group the way launchers (torchrun, SLURM wrappers) describe it.

A launcher starts one process per device and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in each. `init_process_group_from_env` reads them, picks the backend (gloo on CPU, NCCL on
CUDA) and joins the group with a timeout, so that a rank that never arrives fails the job instead of
hanging it. `ProcessGroupStrategy` is the part every data-parallel strategy shares: identity from the
group, joining and leaving it, the metric collectives, and the start-of-training checks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parameter import UninitializedParameter

from syncline.options import check_backend, check_number
from syncline.strategies.comm import worker_guard
from syncline.strategies.comm.collective_log import COLLECTIVES, diagnosis_wait
from syncline.strategies.comm.counter import CommCounter, count_bytes
from syncline.strategies.comm.flat import flatten_by_dtype, unflatten_into
from syncline.strategies.comm.group_abort import abort_default_group, joined_group
from syncline.strategies.comm.reducer_errors import CollectiveError, first_line
from syncline.strategies.strategy import ReduceOp, Strategy

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedEnv",
    "ProcessGroupStrategy",
    "broadcast_coalesced",
    "default_backend",
    "destroy_process_group",
    "device_for_local_rank",
    "init_process_group_from_env",
    "leave_without_waiting",
]

#: Seconds a training collective may take before it fails: long enough for a slow checkpoint or a
#: straggler, short enough that a hang ends in minutes rather than torch's 30.
DEFAULT_TIMEOUT_S = 300.0

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> DistributedEnv:
        """Read the launcher's environment variables.

        Raises:
            RuntimeError: a required variable is missing.
        """
        missing = [name for name in _REQUIRED if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"Cannot join the process group: environment variable(s) {', '.join(missing)} are not set. "
                "Start the job with a launcher such as `torchrun --nproc-per-node=N`."
            )
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
        )


def default_backend() -> str:
    """Return "nccl" when CUDA is available, else "gloo"."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for_local_rank(local_rank: int, backend: str) -> torch.device:
    """Return the device a process with `local_rank` computes on: its GPU, unless the backend is gloo."""
    if torch.cuda.is_available() and backend != "gloo":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group_from_env(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the default process group described by the environment, unless already joined.

    Without any of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (no launcher), join a world of one
    process instead; with some of them but not all, raise.

    Args:
        backend: "gloo", "nccl", ...; None picks `default_backend()`.
        timeout: seconds a collective (and the rendezvous) may take before it fails.

    Returns:
        True when this call created the group (and so its caller should destroy it).
    """
    if dist.is_initialized():
        return False
    backend = backend or default_backend()
    if not any(name in os.environ for name in _REQUIRED):
        _init_world_of_one(backend, timeout)
        return True
    env = DistributedEnv.from_environ()
    if backend == "nccl":
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={env.local_rank} has no GPU of its own: {torch.cuda.device_count()} visible, and NCCL "
                "needs one per process. Start at most that many processes per node, or compute on the CPU "
                "(accelerator='cpu', or backend='gloo')."
            )
        torch.cuda.set_device(env.local_rank)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Started by an elastic agent that hosts the store (torchrun's c10d rendezvous, or `launch`'s on
        # loopback): every rank joins it as a client. The store outlives restarts of the group, so each
        # restart keeps its keys apart from those a failed attempt left behind.
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, False, timeout=timedelta(seconds=timeout)
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # Collective: rendezvous of all ranks through the agent's store.
        with joined_group(env.master_port):
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"syncline/attempt{attempt}", store),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=timeout),
            )
        return True
    # Collective: rendezvous of all ranks at MASTER_ADDR:MASTER_PORT.
    with joined_group(env.master_port):
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout),
        )
    return True


def _init_world_of_one(backend: str, timeout: float) -> None:
    """Join a process group of this process alone: no launcher, one device (as Lightning runs DDP on one).

    A distributed configuration can then be run and debugged on one device, collectives included. The
    store lives in this process's memory, so nothing listens on the network.
    """
    if backend == "nccl":
        torch.cuda.set_device(0)
    # Collective (of one): no other process takes part.
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout))


def destroy_process_group() -> None:
    """Leave the default process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


#: Set when a stage raised on this rank: the others may be blocked in a collective that this rank will
#: never join, so leaving must not wait for them.
_LEAVE_WITHOUT_WAITING = False


def leave_without_waiting() -> None:
    """Make this process leave the group at exit without waiting for the other ranks (after a failure)."""
    global _LEAVE_WITHOUT_WAITING
    _LEAVE_WITHOUT_WAITING = True


def _leave_at_exit() -> None:
    """Leave the group together with the other ranks when the interpreter exits normally.

    A rank that tears gloo down while a peer is still working (rank 0 writing a file, say) can abort
    with "terminate called without an active exception"; waiting for everyone first avoids that. The
    wait is bounded, so a rank whose peer died still exits. After a failure on this rank there is no
    wait at all: the others may be blocked in a training collective, and this process ending is what
    ends it for them (their connections to it close) and tells the elastic agent to stop the group.
    """
    if not dist.is_initialized():
        return
    if _LEAVE_WITHOUT_WAITING:
        return
    # A peer that is gone makes the barrier fail: leave anyway.
    with contextlib.suppress(Exception):
        # Collective: every rank reaches the end of its script before any leaves the group.
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        else:
            dist.barrier()
    destroy_process_group()


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class ProcessGroupStrategy(Strategy):
    """Base of the strategies whose processes form one `torch.distributed` process group.

    Args:
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.
    """

    multi_process = True

    def __init__(self, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        check_number(type(self).__name__, "timeout", timeout, above=0, meaning="seconds a collective may take")
        check_backend(type(self).__name__, backend)
        self.backend = backend
        self.timeout = timeout

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

    def use_accelerator(self, device_type: str) -> None:
        # The device follows the backend: gloo computes on the CPU, NCCL on each rank's GPU.
        wanted = "nccl" if device_type == "cuda" else "gloo"
        if self.backend is None:
            self.backend = wanted
        elif self.backend != wanted:
            raise ValueError(
                f"{type(self).__name__}(backend={self.backend!r}) cannot compute on {device_type}: use "
                f"backend={wanted!r} (or leave backend unset), or accelerator='auto'."
            )

    # --------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        """Join the default process group from RANK, WORLD_SIZE, ... unless already in one."""
        COLLECTIVES.reset(self.name)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # Started by an elastic agent: end with it, and tell its teardown's SIGTERM from a preemption.
            worker_guard.start()
        if init_process_group_from_env(self.backend, self.timeout):
            # The group outlives stages (see teardown); leave it cleanly before the interpreter shuts down,
            # since gloo's threads dying with the process can abort it ("terminate called ...").
            atexit.register(_leave_at_exit)
            if "TORCHELASTIC_RUN_ID" in os.environ and dist.get_world_size() > 1:
                # A rank stuck in compute, or on another node, learns of a failure from the store.
                worker_guard.watch_peers(dist.distributed_c10d._get_default_store(), dist.get_rank())

    def on_stage_failure(self) -> None:
        """Exit without waiting for the other ranks, which may be blocked in a collective this rank left.

        Under an elastic agent, also tell them through the store (bounded): a rank stuck in compute or
        on another node would otherwise never learn that the job is over.
        """
        leave_without_waiting()
        if "TORCHELASTIC_RUN_ID" in os.environ and dist.is_initialized() and dist.get_world_size() > 1:
            with contextlib.suppress(Exception):
                worker_guard.announce_failure(dist.distributed_c10d._get_default_store(), dist.get_rank())
            # The process ends: its group's teardown would wait out a collective still in flight (the preemption
            # flag's all-reduce, blocked on a peer that is stuck too) up to the timeout. Aborted, it ends now, and
            # so do the peers' collectives with this rank.
            abort_default_group()

    def teardown(self) -> None:
        """Stay in the process group: it outlives a stage, as in Lightning.

        `trainer.save_checkpoint` after `fit`, or `trainer.test` after it, still need the group; the
        process leaves it when it exits (or on an explicit `destroy_process_group()`).
        """

    # ------------------------------------------------------------- collectives
    def reduce(self, tensor: Tensor, op: ReduceOp = "mean") -> Tensor:
        """Return `tensor` reduced across ranks with `op`; the input is not modified."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"Unknown reduce op {op!r}. Valid: {', '.join(_REDUCE_OPS)}.")
        self._require_group()
        # On the group's device (a value logged as a Python number is a CPU tensor, which NCCL cannot send).
        result = tensor.detach().to(self.root_device, copy=True)
        what = f"all-reduce ({op}) of a {tuple(result.shape)} {result.dtype} tensor (Strategy.reduce)"
        with self._collective(what):
            # Collective: all-reduce of a metric.
            dist.all_reduce(result, op=_REDUCE_OPS[op])
        result = result.to(tensor.device)
        return result / self.world_size if op == "mean" else result

    def reduce_async(self, tensor: Tensor, op: ReduceOp = "max") -> Callable[[], Tensor]:
        """Start an all-reduce of `tensor` in place ("sum", "max" or "min"); return a function that waits for it."""
        if op not in ("sum", "max", "min"):
            raise ValueError(f"reduce_async supports 'sum', 'max' and 'min', not {op!r}.")
        self._require_group()
        # Collective: asynchronous all-reduce; the caller waits when it needs the value.
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], async_op=True)

        def wait() -> Tensor:
            work.wait()
            return tensor

        return wait

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._require_group()
        gathered: list[Any] = [None] * self.world_size
        with self._collective("all-gather of an object (Strategy.all_gather_object)"):
            # Collective: every rank's object, pickled.
            dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._require_group()
        box = [obj]
        with self._collective(f"broadcast of an object from rank {src} (Strategy.broadcast_object)"):
            # Collective: rank `src`'s object, pickled.
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        self._require_group()
        with self._collective("barrier (Strategy.barrier)"):
            # Collective: wait for every rank.
            dist.barrier()

    # ----------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Log the collective `what` launches; if it fails or times out, say where the ranks diverged."""
        COLLECTIVES.record(what)
        try:
            yield
        except RuntimeError as error:
            if isinstance(error, CollectiveError):
                raise
            diagnosis = COLLECTIVES.diagnose(diagnosis_wait(error, self.timeout))
            raise CollectiveError(
                f"Rank {self.global_rank}: {what} failed or did not complete within {self.timeout:g} s: "
                f"{first_line(error)}." + diagnosis
            ) from error

    def _require_group(self) -> None:
        """Raise a clear error instead of torch's when there is no process group to talk to."""
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} has no process group: call setup_environment() first. Note that "
                "teardown() leaves the group that setup_environment() joined, so collectives after "
                "teardown() fail."
            )

    def check_same_parameters(self, task: Task) -> None:
        """Raise on every rank if two ranks' parameters differ in name, shape, dtype or requires_grad.

        Raises:
            ValueError: naming the first differing parameter and the two ranks, or the parameters of a
                lazy module that no forward has initialized yet.
        """
        lazy = [name for name, p in task.named_parameters() if isinstance(p, UninitializedParameter)]
        if lazy:
            raise ValueError(
                f"Parameter(s) {', '.join(lazy)} are not initialized yet (a lazy module such as nn.LazyLinear), "
                f"so {type(self).__name__} cannot copy rank 0's values or size its buckets. Run one forward on "
                "a sample batch before training (before trainer.fit), or give the layer its input size."
            )
        mine = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in task.named_parameters()]
        # Collective: every rank sees every rank's list, so every rank raises the same error.
        everyone = self.all_gather_object(mine)
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs != everyone[0]:
                raise ValueError(
                    "The model differs across ranks, so their gradients cannot be averaged: "
                    f"{_first_difference(everyone[0], theirs, rank)}. Build the same model on every rank."
                )


def broadcast_coalesced(tensors: list[Tensor], src: int = 0, counter: CommCounter | None = None) -> None:
    """Overwrite `tensors` with rank `src`'s values, one broadcast per dtype and device (counted in `counter`)."""
    count_bytes(counter, *tensors)
    for group, flat in flatten_by_dtype(tensors):
        # Collective: one broadcast for all tensors of this dtype and device.
        dist.broadcast(flat, src=src)
        unflatten_into(group, flat)


_Signature = tuple[str, tuple[int, ...], str, bool]


def _first_difference(reference: list[_Signature], other: list[_Signature], rank: int) -> str:
    """Describe the first parameter in which rank `rank`'s model differs from rank 0's."""
    for mine, theirs in zip(reference, other):
        if mine != theirs:
            name, shape, dtype, grad = mine
            other_name, other_shape, other_dtype, other_grad = theirs
            if name != other_name:
                return f"parameter {name!r} on rank 0 is {other_name!r} on rank {rank}"
            return (
                f"parameter {name!r} is (shape={shape}, dtype={dtype}, requires_grad={grad}) on rank 0 "
                f"but (shape={other_shape}, dtype={other_dtype}, requires_grad={other_grad}) on rank {rank}"
            )
    common = min(len(reference), len(other))
    if len(reference) > common:
        return f"parameter {reference[common][0]!r} exists on rank 0 but not on rank {rank}"
    return f"parameter {other[common][0]!r} exists on rank {rank} but not on rank 0"
