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

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from syncline.options import OptionError, check_int, check_number
from syncline.strategies.comm.backward_sync import BackwardSyncControl
from syncline.strategies.comm.bucket_autotune import AUTO, DEFAULT_CAPS_MB, BucketAutotune, distinct_caps
from syncline.strategies.comm.events import CommEvents
from syncline.strategies.comm.hooks import COMM_HOOKS, CommHook
from syncline.strategies.comm.join import Joinable
from syncline.strategies.comm.process_group import ProcessGroupStrategy, broadcast_coalesced
from syncline.strategies.comm.reducer import Reducer
from syncline.strategies.comm.sparse_gradients import sparse_gradient_parameters
from syncline.trainer.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["BlockingHookDDP", "BucketedDDP", "refuse_autotune"]

_CAP_MEANING = "MiB per bucket; 0 gives every parameter its own bucket"


class BucketedDDP(BackwardSyncControl, Joinable, ProcessGroupStrategy):
    """Average gradients across processes with bucketed all-reduces that overlap the backward.

    Args:
        bucket_cap_mb: the most MiB of gradients per bucket (one all-reduce each), or "auto": try the caps
            of `autotune_caps_mb` in the first synchronized steps and keep the fastest
            (`strategies/comm/bucket_autotune.py`).
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
        autotune_caps_mb: the caps that `bucket_cap_mb="auto"` tries; those that cannot change the
            layout (at or above the model's gradient bytes) are tried once, as the smallest of them.
        autotune_steps: timed synchronized steps per cap tried, each cap after one untimed warm-up step.
    """

    name = "bucketed_ddp"
    #: Rebuild the buckets once in the observed gradient order (a subclass whose hook depends on the
    #: layout keeps the layout of construction instead).
    rebuild_buckets: bool = True
    #: Why `bucket_cap_mb="auto"` is refused by a subclass, or None where autotuning works.
    autotune_refusal: str | None = None

    def __init__(
        self,
        bucket_cap_mb: float | str = 25,
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
        autotune_caps_mb: Sequence[float] = DEFAULT_CAPS_MB,
        autotune_steps: int = 2,
    ) -> None:
        if bucket_cap_mb == AUTO:
            self._check_autotune(autotune_caps_mb, autotune_steps)
        else:
            # 0 is meaningful, as in torch's DDP: every parameter gets its own bucket.
            check_number("BucketedDDP", "bucket_cap_mb", bucket_cap_mb, minimum=0, meaning=_CAP_MEANING + ', or "auto"')
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
        self.autotune_caps_mb = tuple(autotune_caps_mb)
        self.autotune_steps = autotune_steps
        #: The autotuner of `bucket_cap_mb="auto"` (its trials and the agreed cap); None for a fixed cap.
        self.autotune: BucketAutotune | None = None
        self._synced_cap_mb: float | None = None  # the cap of the last synchronized step, while autotuning
        self._comm_events: CommEvents | None = None
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

    @property
    def comm_events(self) -> CommEvents | None:
        """Where the reducer records bucket launches and completions while a timeline listens."""
        return self._comm_events

    @comm_events.setter
    def comm_events(self, events: CommEvents | None) -> None:
        self._comm_events = events
        if self._reducer is not None:
            self._reducer.events = events

    def _check_autotune(self, caps_mb: Sequence[float], steps: int) -> None:
        """Refuse "auto" where the strategy cannot tune its buckets, or with bad trial options."""
        name = type(self).__name__
        refuse_autotune(type(self), AUTO)
        if isinstance(caps_mb, str) or not caps_mb:
            raise OptionError(f"{name}(autotune_caps_mb={caps_mb!r}): give a non-empty list of caps in MiB.")
        for cap in caps_mb:
            check_number(name, "autotune_caps_mb", cap, minimum=0, meaning="each cap tried, in MiB")
        check_int(name, "autotune_steps", steps, 1, meaning="timed steps per cap tried")

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
        autotuning = self.bucket_cap_mb == AUTO
        self._reducer = Reducer(
            list(task.named_parameters()),
            # Tuning starts with the smallest cap: the first step runs it.
            bucket_cap_mb=min(self.autotune_caps_mb) if autotuning else self.bucket_cap_mb,
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
        self._reducer.events = self._comm_events
        self.autotune = None
        self._synced_cap_mb = None
        if autotuning:
            caps = distinct_caps(self.autotune_caps_mb, self._reducer.gradient_group_bytes())
            self.autotune = BucketAutotune(caps, self.autotune_steps)
            self._reducer.set_bucket_cap(self.autotune.current_mb)
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
        if self._buffers_stale and self._broadcast_buffers():
            self.comm_counter.add_tensors(*self._buffers)
        return task.training_step(batch, batch_idx)

    def _broadcast_buffers(self) -> bool:
        """Give every rank `buffer_source`'s buffers, if buffers are broadcast; return whether they were."""
        if not (self.broadcast_buffers and self._buffers):
            return False
        # Collective: every rank's forward sees rank 0's buffers, as torch's DDP does (under join, the
        # highest rank's that still has data; the same broadcast on a joined rank and after the last round).
        broadcast_coalesced(self._buffers, src=self.buffer_source)
        self._buffers_stale = False
        return True

    def backward(self, loss: Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Back-propagate `loss`; average gradients across ranks only when `sync` is true.

        With `find_unused_parameters`, a parameter is unused when the graph of `loss` does not reach
        it, whatever else the forward computed from it.
        """
        reducer = self.reducer
        sync = self._backward_syncs(sync)
        start = time.perf_counter()
        walk = self.find_unused_parameters or self.static_graph
        reducer.prepare_for_backward(sync=sync, loss=loss if walk else None)
        loss.backward(retain_graph=retain_graph)
        reducer.finalize_backward()
        if sync:
            self._buffers_stale = True
            self._autotune_step(start)

    def finish_join(self) -> None:
        """Give every rank the last joiner's buffers (the parameters are already equal)."""
        if self._broadcast_buffers():  # collective: from the rank that had data last
            self.comm_counter.add_tensors(*self._buffers)

    def shadow_forward(self) -> None:
        """Shadow `training_step`'s buffer broadcast on a rank whose data ran out."""
        # Collective: the broadcast the ranks with data run before their forward, counted as they count it.
        if self._buffers_stale and self._broadcast_buffers():
            self.comm_counter.add_tensors(*self._buffers)

    def shadow_backward(self) -> None:
        """Shadow a synchronized backward with zero gradients on a rank whose data ran out."""
        start = time.perf_counter()
        # Collective: the step's bucket all-reduces (and used-parameter map), with zeros from this rank.
        self.reducer.shadow_backward()
        self._buffers_stale = True
        self._autotune_step(start)

    def _autotune_step(self, start: float) -> None:
        """While tuning, time the synchronized step that began at `start`; lay out the cap the tuner asks for."""
        tuner = self.autotune
        if tuner is None:
            return
        self._synced_cap_mb = tuner.current_mb
        if tuner.done:
            return
        if self.root_device.type == "cuda":
            # Host sync (tuning steps only): the step's wall time must include its kernels and collectives.
            torch.cuda.synchronize(self.root_device)
        # Collective (after the last trial step only): all-reduce of the trial medians.
        cap = tuner.observe(time.perf_counter() - start, self.root_device)
        if cap is not None:
            self.reducer.set_bucket_cap(cap)
        if tuner.done:
            rank_zero_info(tuner.summary())

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
        """Bytes of the last optimizer step and since setup; collectives and exposed wait of the last sync.

        With `bucket_cap_mb="auto"`, also `comm/bucket_cap_mb`: the last synchronized step's cap (a trial's,
        then the agreed one).
        """
        reducer = self._reducer
        reducer_stats = {} if reducer is None or reducer.stats().buckets == 0 else reducer.stats().as_dict()
        if self._synced_cap_mb is not None:
            reducer_stats["comm/bucket_cap_mb"] = self._synced_cap_mb
        # The strategy's counter has the last optimizer step's bytes, buffer broadcasts included.
        return {**reducer_stats, **self.comm_counter.as_dict()}

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the autotuner's trials and agreed cap (with `bucket_cap_mb="auto"`; else nothing)."""
        return {} if self.autotune is None else {"autotune": self.autotune.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved run's agreed cap (or its place in the trials) instead of tuning from the start."""
        if self.autotune is not None and "autotune" in state:
            self.autotune = BucketAutotune.from_state_dict(state["autotune"])
            self.reducer.set_bucket_cap(self.autotune.current_mb)

    def load_state_from_other_world(self, states: list[dict[str, Any]]) -> None:
        """Tune again on another number of processes: the saved cap was agreed for the old one."""
        super().load_state_from_other_world([{k: v for k, v in s.items() if k != "autotune"} for s in states])

    def __repr__(self) -> str:
        return (
            f"BucketedDDP(bucket_cap_mb={self.bucket_cap_mb}, first_bucket_mb={self.first_bucket_mb}, "
            f"find_unused_parameters={self.find_unused_parameters}, "
            f"gradient_as_bucket_view={self.gradient_as_bucket_view}, overlap={self.overlap}, "
            f"static_graph={self.static_graph})"
        )


def refuse_autotune(strategy: type[BucketedDDP], bucket_cap_mb: Any) -> None:
    """Raise if `bucket_cap_mb` is "auto" and `strategy` cannot tune its buckets (its `autotune_refusal`).

    Subclasses that check `bucket_cap_mb` themselves call this first, so "auto" gets its reason.

    Raises:
        OptionError: naming the strategy, why, and the fix.
    """
    if bucket_cap_mb == AUTO and strategy.autotune_refusal is not None:
        raise OptionError(
            f"{strategy.__name__}(bucket_cap_mb='auto'): {strategy.autotune_refusal}; give a number of MiB "
            "instead, e.g. bucket_cap_mb=25 (autotuning is for bucketed_ddp)."
        )


class BlockingHookDDP(BucketedDDP):
    """`BucketedDDP` whose comm hook compresses a bucket and blocks until it is averaged (ByteGrad, PowerSGD).

    Such a hook buys no overlap from a small first bucket, so every bucket gets `bucket_cap_mb`; and its
    per-parameter state is keyed by name, so `setup` gives the hook state a ``names`` map (id -> name).
    """

    supports_join = False  # a zero bucket still carries the joined rank's error-feedback memory
    autotune_refusal = "its hook compresses each bucket and blocks until it is averaged: there is no overlap to tune"

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
