"""Horovod's tensor fusion (Sergeev and Del Balso, 2018): gradients negotiated as they become ready, then fused.

Algorithm, for each synchronized backward (the last micro-batch of an accumulation window):

    backward (main thread):  as each parameter's gradient is accumulated, note it ready on this rank
                             (a post-accumulate-grad hook; the k-th gradient to be ready gets number k)
    every cycle_time_ms (the fusion thread, on its own process group):
        negotiate:   all-gather every rank's readiness vector (n int32: 0 not yet, k its arrival)
                     ready = the gradients ready on every rank and not yet reduced, in the order
                     rank 0, the coordinator, saw them become ready
        fuse:        pack `ready`, in that order, into flat buffers of one dtype of at most
                     fusion_threshold_mb (a larger gradient goes alone)
        all-reduce:  each buffer (the average), and copy it back into the gradients
    end of backward (main thread): mark what is left, wake the thread at once, and wait until every
                             gradient is reduced (the flush); clipping and the optimizer then see averages

Fusion is dynamic: what shares a buffer is what happened to be ready in the same cycle, not a fixed
bucket layout. Horovod's coordinator gathers every rank's ready list and answers with the tensors ready
everywhere; here one all-gather gives every rank every list, and each computes the coordinator's answer
(a pure function of the gathered lists, rank 0's arrival order first) -- one collective per cycle
instead of a gather and a broadcast.

Why this cannot deadlock:

1. The thread's collectives run on their own process group (`dist.new_group`, made at setup), so they
   never interleave with the main thread's (metric reductions, the loss-scaler agreement, checkpoints).
2. On that group every rank's thread issues the same sequence: one all-gather per cycle, then the
   all-reduces the plan says. The plan is computed from the all-gathered data, identical on every rank,
   so every rank fuses alike and finishes the step in the same cycle. Local timing only decides how
   long a cycle's all-gather waits, never how many collectives there are.
3. A rank's thread starts a step only when its main thread starts a synchronized backward, and every
   rank runs the same synchronized backwards (the loop's accumulation windows agree). The main thread
   waits for the step to finish before it touches gradients again, so steps never overlap.
4. Every step ends: at the end of its backward a rank marks every gradient that is not ready yet (a
   parameter the forward did not use), so once every rank's backward is over, the next cycle sees
   everything ready everywhere.
5. Errors are agreed or bounded: an unused parameter without `find_unused_parameters` is seen in the
   gathered data, so every rank raises at the same cycle; a failed collective (a peer died) raises
   after `timeout`, and the main thread waits at most `timeout` for the thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from syncline.options import check_number
from syncline.strategies.comm.backward_sync import BackwardSyncControl
from syncline.strategies.comm.flat import flatten, unflatten
from syncline.strategies.comm.process_group import ProcessGroupStrategy, broadcast_coalesced
from syncline.strategies.comm.transfers import all_reduce

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["FusionStats", "TensorFusion", "fusion_plan"]

#: A readiness entry for a gradient that this rank's backward did not produce (an unused parameter).
_UNUSED = -1
#: Seconds the main thread may wait past `timeout` for the thread to report a failed collective.
_GRACE_S = 5.0


@dataclass
class FusionStats:
    """What the last synchronized backward cost: negotiation cycles, fused all-reduces, negotiation bytes."""

    cycles: int = 0
    allreduces: int = 0
    negotiation_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        """Return the counters under the names the loop logs."""
        return {
            "fusion/cycles": float(self.cycles),
            "fusion/allreduces": float(self.allreduces),
            "fusion/negotiation_bytes": float(self.negotiation_bytes),
        }


def fusion_plan(
    readiness: Tensor, pending: Tensor, sizes: list[int], dtypes: list[Any], threshold_bytes: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """Decide one cycle's all-reduces from every rank's readiness: the coordinator's answer.

    Args:
        readiness: (world, n) int; 0 not ready, k > 0 the k-th gradient ready on that rank, -1 unused there.
        pending: (n,) bool; gradients not reduced yet in this step.
        sizes: bytes of each gradient.
        dtypes: dtype (and device) key of each gradient; a buffer holds one key only.
        threshold_bytes: most bytes per fused buffer; a larger gradient gets a buffer of its own.

    Returns:
        The fused buffers (lists of gradient indices, in all-reduce order); the gradients unused on every
        rank (left as they are); and the gradients unused on some rank but not all (reduced with zeros
        from those ranks).
    """
    ready = (readiness != 0).all(dim=0) & pending
    unused = readiness == _UNUSED
    unused_everywhere = (unused.all(dim=0) & ready).nonzero().flatten().tolist()
    unused_somewhere = (unused.any(dim=0) & ~unused.all(dim=0) & ready).nonzero().flatten().tolist()
    skip = set(unused_everywhere)
    coordinator = readiness[0].tolist()
    # Rank 0's arrival order; what rank 0 did not use comes last, by index.
    order = sorted(
        (i for i in ready.nonzero().flatten().tolist() if i not in skip),
        key=lambda i: (coordinator[i] <= 0, coordinator[i], i),
    )
    buffers: list[list[int]] = []
    open_buffer: dict[Any, list[int]] = {}
    open_bytes: dict[Any, int] = {}
    for index in order:
        key = dtypes[index]
        current = open_buffer.get(key)
        if not current or open_bytes[key] + sizes[index] > threshold_bytes:
            # A new buffer, all-reduced in the order buffers were opened.
            current = open_buffer[key] = []
            open_bytes[key] = 0
            buffers.append(current)
        current.append(index)
        open_bytes[key] += sizes[index]
    return buffers, unused_everywhere, unused_somewhere


class TensorFusion(BackwardSyncControl, ProcessGroupStrategy):
    """Average gradients with Horovod's negotiated, dynamically fused all-reduces on a background thread.

    Args:
        fusion_threshold_mb: the most MiB of gradients in one fused all-reduce (Horovod's
            HOROVOD_FUSION_THRESHOLD); 0 all-reduces every gradient alone.
        cycle_time_ms: milliseconds between two negotiations (HOROVOD_CYCLE_TIME); longer cycles fuse
            more gradients per all-reduce and start the first one later.
        find_unused_parameters: allow parameters that a backward does not reach: they are averaged with
            zeros from the ranks that did not use them, and keep `.grad` None when no rank used them.
            False makes such a parameter an error, raised on every rank and naming it.
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective (and the wait for the last fused all-reduce) may take.
    """

    name = "tensor_fusion"

    def __init__(
        self,
        fusion_threshold_mb: float = 64,
        cycle_time_ms: float = 5,
        find_unused_parameters: bool = False,
        backend: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        check_number(
            "TensorFusion",
            "fusion_threshold_mb",
            fusion_threshold_mb,
            minimum=0,
            meaning="MiB per fused all-reduce; 0 sends every gradient alone",
        )
        check_number("TensorFusion", "cycle_time_ms", cycle_time_ms, minimum=0, meaning="ms between negotiations")
        super().__init__(backend=backend, timeout=timeout)
        self.fusion_threshold_mb = fusion_threshold_mb
        self.cycle_time_ms = cycle_time_ms
        self.find_unused_parameters = find_unused_parameters
        self.stats = FusionStats()
        self._init_runtime()

    def _init_runtime(self) -> None:
        """The thread, its group and its handshakes: made fresh, never pickled."""
        self._names: list[str] = []
        self._params: list[Tensor] = []
        self._hooks: list[RemovableHandle] = []
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._go = threading.Event()  # main -> thread: a synchronized backward started (or stop)
        self._wake = threading.Event()  # main -> thread: the backward ended, negotiate now
        self._done = threading.Event()  # thread -> main: every gradient is reduced (or an error)
        self._stopping = False
        self._error: BaseException | None = None
        self._collecting = False
        self._backward_over = False
        self._readiness = torch.zeros(0, dtype=torch.int32)
        self._arrivals = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the options only: `Trainer(devices=N)` sends the strategy to its worker processes."""
        keep = ("fusion_threshold_mb", "cycle_time_ms", "find_unused_parameters", "backend", "timeout", "stats")
        return {key: self.__dict__[key] for key in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # --------------------------------------------------------------- lifecycle
    def setup(self, task: Task) -> None:
        """Copy rank 0's weights, hook every trainable parameter, make the thread's group and start it."""
        task.to(self.root_device)
        self.check_same_parameters(task)
        # Collective: start every replica from rank 0's parameters and buffers.
        broadcast_coalesced([*task.parameters(), *task.buffers()])
        self.teardown()
        named = [(name, p) for name, p in task.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._readiness = torch.zeros(len(self._params), dtype=torch.int32)
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._make_hook(index)) for index, param in enumerate(self._params)
        ]
        # Collective: every rank creates the fusion thread's group, in the same order.
        self._group = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=self.timeout))
        self._stopping, self._error = False, None
        self._thread = threading.Thread(target=self._run, name="syncline-tensor-fusion", daemon=True)
        self._thread.start()

    def teardown(self) -> None:
        """Stop the thread (it is idle between steps, so no collective is cut) and remove the hooks."""
        thread = self._thread
        if thread is not None:
            self._stopping = True
            self._go.set()
            thread.join(self.timeout)
            self._thread = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        super().teardown()

    # -------------------------------------------------------------- train step
    def backward(self, loss: Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Back-propagate `loss`; when `sync`, negotiate and all-reduce gradients as they become ready.

        Raises:
            RuntimeError: the fusion thread failed (a collective, or a parameter the backward did not
                reach without `find_unused_parameters`), on every rank alike.
        """
        if not self._backward_syncs(sync):
            # Inside an accumulation window: gradients accumulate locally, nothing is sent.
            self._autograd_backward(loss, retain_graph)
            return
        if self._thread is None:
            raise RuntimeError("TensorFusion.setup(task) has not been called yet.")
        with self._lock:
            self._readiness.zero_()
            self._arrivals = 0
            self._backward_over = False
            self._collecting = True
        self._done.clear()
        self._wake.clear()
        self._go.set()
        try:
            self._autograd_backward(loss, retain_graph)
        finally:
            with self._lock:
                self._collecting = False
                self._backward_over = True
                # What the backward did not reach is marked, so the step can end (reason 4).
                self._readiness[self._readiness == 0] = _UNUSED
            self._wake.set()
            self._wait_for_thread()

    def _make_hook(self, index: int) -> Any:
        def ready(param: Tensor) -> None:
            with self._lock:
                if self._collecting:
                    self._arrivals += 1
                    self._readiness[index] = self._arrivals

        return ready

    def _wait_for_thread(self) -> None:
        """Block until the thread has reduced every gradient of this step; re-raise what it raised."""
        if not self._done.wait(self.timeout + _GRACE_S):
            raise RuntimeError(
                f"TensorFusion: the fusion thread did not finish the step's all-reduces within "
                f"{self.timeout:g} s; another rank may have stopped or never started its backward."
            )
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"TensorFusion: {error}") from error

    # -------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stopping:
                return
            try:
                self._reduce_step()
            except BaseException as error:  # re-raised by the main thread, which is waiting for it
                self._error = error
            self._done.set()

    @torch.no_grad()
    def _reduce_step(self) -> None:
        """Negotiate and all-reduce, cycle after cycle, until every rank has every gradient averaged."""
        count = len(self._params)
        world = dist.get_world_size(self._group)
        pending = torch.ones(count, dtype=torch.bool)
        sizes = [p.numel() * p.element_size() for p in self._params]
        keys = [(p.dtype, p.device) for p in self._params]
        threshold = int(self.fusion_threshold_mb * 1024 * 1024)
        stats = FusionStats()
        while bool(pending.any()):
            # Sleep one cycle, unless the backward has ended: then flush at once.
            self._wake.wait(self.cycle_time_ms / 1000)
            self._wake.clear()
            with self._lock:
                mine = self._readiness.clone()
            gathered = [torch.empty_like(mine) for _ in range(world)]
            # Collective (fusion group): every rank's readiness; every rank then computes the same plan.
            dist.all_gather(gathered, mine, group=self._group)
            stats.cycles += 1
            stats.negotiation_bytes += mine.numel() * mine.element_size()
            readiness = torch.stack(gathered)
            buffers, unused_everywhere, unused_somewhere = fusion_plan(readiness, pending, sizes, keys, threshold)
            if (unused_somewhere or unused_everywhere) and not self.find_unused_parameters:
                # Every rank sees the same gathered data, so every rank raises here (reason 5).
                raise self._unused_error(readiness, unused_somewhere + unused_everywhere)
            for indices in buffers:
                self._allreduce(indices, world)
                stats.allreduces += 1
            for index in [*unused_everywhere, *(i for b in buffers for i in b)]:
                pending[index] = False
        self.stats = stats

    def _allreduce(self, indices: list[int], world: int) -> None:
        """Average the gradients `indices` across ranks with one fused all-reduce."""
        params = [self._params[i] for i in indices]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        fused = flatten(grads)
        # Divide before the all-reduce so low-precision sums cannot overflow.
        fused.div_(world)
        # Collective (fusion group): one all-reduce of every gradient fused in this buffer.
        all_reduce(fused, self.comm_counter, group=self._group)
        for param, grad, average in zip(params, grads, unflatten(fused, grads)):
            if param.grad is None:
                param.grad = average.clone()
            else:
                grad.copy_(average)

    def _unused_error(self, readiness: Tensor, indices: list[int]) -> RuntimeError:
        where = []
        for index in sorted(indices)[:5]:
            ranks = (readiness[:, index] == _UNUSED).nonzero().flatten().tolist()
            where.append(f"{self._names[index]} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})")
        more = f" and {len(indices) - 5} more" if len(indices) > 5 else ""
        return RuntimeError(
            f"parameter(s) {', '.join(where)}{more} got no gradient in this backward. Pass "
            "TensorFusion(find_unused_parameters=True) (strategy.find_unused_parameters=true) to average "
            "them with zeros from the ranks that did not use them, or set requires_grad=False on "
            "parameters that are never trained."
        )

    # -------------------------------------------------------------- reporting
    def communication_stats(self) -> dict[str, float]:
        """Gradient bytes of the last step and since setup, and the last synchronized backward's fusion counters."""
        return {**self.stats.as_dict(), **self.comm_counter.as_dict()}

    def state_dict(self) -> dict[str, Any]:
        """Return the byte counters (fusion itself carries nothing from one step to the next)."""
        return {"bytes": self.comm_counter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the byte counters."""
        self.comm_counter.load_state_dict(state["bytes"])

    def load_state_from_other_world(self, states: list[dict[str, Any]]) -> None:
        """Nothing per rank to carry: the byte counters start again from rank 0's."""
        if states:
            self.load_state_dict(states[0])

    def __repr__(self) -> str:
        return (
            f"TensorFusion(fusion_threshold_mb={self.fusion_threshold_mb}, cycle_time_ms={self.cycle_time_ms}, "
            f"find_unused_parameters={self.find_unused_parameters})"
        )
