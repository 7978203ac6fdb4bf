"""The core of the strategies built on syncline's `Reducer`: one reducer, one step counter, hooks for each moment.

BucketedDDP, the compression family (ByteGrad, PowerSGD, QAdam), the averaging family (local SGD,
decentralized, asynchronous averaging) and both parameter servers average gradients with the bucketed
`Reducer` during the backward, at least for a while, and differ in what they do around it. This class owns
what they share: the options of the reducer (checked once, here), the reducer itself, rank 0's weights at
setup, buffer broadcasts, joining, the guard against unaveraged steps, the byte counter and `steps`, the
one counter an algorithm's stage is derived from. An algorithm is a small declaration plus the hooks it
needs, called at the moments their names say (as BAGUA's `Algorithm`, `bagua/torch_api/algorithms/base.py`):

    setup(task)                 check_world_size(world_size) first (the launcher asks it too); then the
                                reducer built and rank 0's weights on every rank -> after_setup(task)
    training_step(task, ...)    work in flight lands on the task's own parameters -> before_forward(task);
                                rank 0's buffers if a synchronized step changed them; the forward
    backward(loss, sync)        work in flight lands                              -> before_backward(sync);
                                the reducer averages gradients if syncs_gradients() -> after_backward()
    optimizer_step(opt, step)   apply_update(opt, step); steps += 1 (stages)     -> after_optimizer_step()
                                the stage moved (stage())                        -> stage_changed()
    zero_grad(opt)              work in flight lands                              -> before_zero_grad(opt);
                                the reducer resets the gradients (bucket views kept)
    on_stage_failure()          work in flight is forgotten                       -> on_failure()

The algorithm never overrides the steps themselves (`training_step`, `backward`, `optimizer_step`,
`zero_grad`): what it does around them is one of the hooks, so the order above holds for every strategy.

Work a step leaves in flight for the next forward (deferred optimizer updates, prefetched parameter transfers) is
one `LayerWaits` in `in_flight`, made by the algorithm in `after_setup`. Its forward pre-hooks land each bucket
just before a layer uses it; the core lands the rest before `before_forward` (the task's own parameters), the
backward and `zero_grad`, in `apply_pending_updates` (validation, checkpoints, the end of a fit) and at
teardown, and forgets it, unlanded, when the stage fails.

What a bucket sends is the comm hook, a plain function ``hook(state, bucket) -> Future[Tensor]``
(`comm/hooks.py`, or the algorithm's own); what the algorithm sends outside the buckets (averaged
parameters, compressed momentum, a parameter broadcast) happens in one of the hooks above. An algorithm with
stages (QAdam's warm-up, PowerSGD's exact start) names them in `stages` and says in `stage()` which one the
coming step runs in; `steps` is then part of its checkpointed state, and `stage_changed` is BAGUA's
`need_reset`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from syncline.options import OptionError, check_number
from syncline.strategies.comm.backward_sync import BackwardSyncControl
from syncline.strategies.comm.bucket_autotune import AUTO
from syncline.strategies.comm.events import CommEvents
from syncline.strategies.comm.hooks import COMM_HOOKS, CommHook
from syncline.strategies.comm.join import Joinable
from syncline.strategies.comm.layer_waits import LayerWaits
from syncline.strategies.comm.process_group import ProcessGroupStrategy, broadcast_coalesced
from syncline.strategies.comm.reducer import Reducer
from syncline.strategies.comm.reducer_errors import unsynced_message
from syncline.strategies.comm.sparse_gradients import sparse_gradient_parameters
from syncline.strategies.strategy import call_training_step

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["ReducerStrategy"]

CAP_MEANING = "MiB per bucket; 0 gives every parameter its own bucket"
_STATIC_GRAPH_IN_MANUAL_STEPS = (
    "static_graph=True promises that every backward reaches the same parameters, which the backwards of a manual "
    "step (one per optimizer) need not; drop static_graph"
)
_BLOCKING = "its hook compresses whole buckets, so the layout is part of what it sends: there is no cap to tune"


class ReducerStrategy(BackwardSyncControl, Joinable, ProcessGroupStrategy):
    """Data parallelism on syncline's `Reducer`; an algorithm declares itself and overrides the hooks it needs.

    Args:
        bucket_cap_mb: the most MiB of gradients per bucket (one collective of the comm hook each).
        first_bucket_mb: cap of the first bucket to be reduced, small so communication starts early; None is
            1 MiB or the cap, whichever is smaller (with a `blocking_hook`, every bucket gets `bucket_cap_mb`).
        find_unused_parameters: tolerate parameters that a forward does not use, at the cost of a walk of the
            autograd graph and one extra small all-reduce per synchronized step.
        comm_hook: per-bucket communication, a function `hook(state, bucket) -> Future[Tensor]` or the name of
            one in `COMM_HOOKS` ("allreduce", "fp16", "bf16"); None is "allreduce".
        comm_state: the state passed to `comm_hook`; None gives the default hooks' `AllreduceState`.
        gradient_as_bucket_view: make `param.grad` a view into the bucket, saving a copy and memory.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before each forward
            that follows a synchronized step.
        overlap: launch each bucket as soon as its gradients are ready; False waits for the end of the backward.
        static_graph: promise that every step uses the same parameters (unused ones are found once).
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.
    """

    #: The names of the algorithm's stages, in order; empty for an algorithm with one. `stage()` says which
    #: one the coming optimizer step runs in, and `steps` is then part of `state_dict`.
    stages: tuple[str, ...] = ()
    #: Keep the bucket layout of construction instead of rebuilding it once in the observed gradient order:
    #: the comm hook's result depends on the layout (chunks), or the algorithm's state does (slices).
    fixed_layout: bool = False
    #: The comm hook compresses a bucket and blocks until it is averaged (ByteGrad, PowerSGD): a small first
    #: bucket buys no overlap, and a joined rank's zero bucket would still carry its error-feedback memory.
    blocking_hook: bool = False
    #: Why `bucket_cap_mb` must be a number of MiB here; `bucket_cap_mb="auto"` is refused with it.
    fixed_cap_because: str = "only bucketed_ddp tunes its buckets"

    def __init__(
        self,
        bucket_cap_mb: float | str = 25,
        first_bucket_mb: float | None = 1,
        find_unused_parameters: bool = False,
        *,
        comm_hook: CommHook | str | None = None,
        comm_state: Any = None,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool = True,
        overlap: bool = True,
        static_graph: bool = False,
        backend: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        name = type(self).__name__
        self._check_bucket_cap(bucket_cap_mb)
        if first_bucket_mb is None:
            first_bucket_mb = min(1.0, bucket_cap_mb)
        check_number(name, "first_bucket_mb", first_bucket_mb, minimum=0, meaning=CAP_MEANING)
        super().__init__(backend=backend, timeout=timeout)
        if isinstance(comm_hook, str):
            if comm_hook not in COMM_HOOKS:
                raise ValueError(f"Unknown comm_hook {comm_hook!r}. Valid: {', '.join(sorted(COMM_HOOKS))}.")
            comm_hook = COMM_HOOKS[comm_hook]
        self.bucket_cap_mb = bucket_cap_mb
        # A blocking hook gains nothing from a small first bucket: every bucket gets the cap.
        self.first_bucket_mb = bucket_cap_mb if self.blocking_hook else first_bucket_mb
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook = comm_hook
        self.comm_state = comm_state
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.overlap = overlap
        self.static_graph = static_graph
        #: Optimizer steps taken, the counter a stage is derived from: counted (and checkpointed) for an
        #: algorithm with `stages`; one with a single stage leaves it, and the name, to its subclasses.
        self.steps = 0
        self._stage = 0
        self._comm_events: CommEvents | None = None
        #: Work the last step left in flight for the next forward to land per layer (None: the step finished).
        self.in_flight: LayerWaits | None = None
        self._reducer: Reducer | None = None
        self._sparse_gradients = False
        self._step_check: RemovableHandle | None = None
        self._buffers: list[Tensor] = []
        self._buffers_stale = True
        #: `time.perf_counter()` at the start of the last synchronized backward (BucketedDDP's autotuner times it).
        self._sync_started = 0.0

    def _check_bucket_cap(self, bucket_cap_mb: Any) -> None:
        """Require a number of MiB; "auto" is refused with the algorithm's reason (BucketedDDP overrides this)."""
        name = type(self).__name__
        if bucket_cap_mb == AUTO:
            reason = _BLOCKING if self.blocking_hook else self.fixed_cap_because
            raise OptionError(
                f"{name}(bucket_cap_mb='auto'): {reason}; give a number of MiB instead, e.g. "
                "bucket_cap_mb=25 (autotuning is for bucketed_ddp)."
            )
        check_number(name, "bucket_cap_mb", bucket_cap_mb, minimum=0, meaning=CAP_MEANING)

    @property
    def manual_optimization_refused(self) -> str:  # type: ignore[override]
        """Why these options cannot follow manual optimization ("" when they can); an algorithm that never can
        declares its reason as a class attribute instead."""
        return _STATIC_GRAPH_IN_MANUAL_STEPS if self.static_graph else ""

    @property
    def supports_join(self) -> bool:
        """Whether a rank whose data ran out can shadow the step's collectives (not with a blocking hook)."""
        return not self.blocking_hook

    @property
    def reducer(self) -> Reducer:
        """The reducer built by `setup`."""
        if self._reducer is None:
            raise RuntimeError(f"{type(self).__name__}.setup(task) has not been called yet.")
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

    # ----------------------------------------------------- the algorithm's hooks
    def after_setup(self, task: Task) -> None:
        """Once the reducer exists and every rank holds rank 0's weights: the algorithm's own setup."""

    def before_forward(self, task: Task) -> None:
        """Before each micro-batch's forward, once the task's own parameters are landed and before rank 0's buffers
        are broadcast."""

    def before_backward(self, sync: bool) -> None:
        """Before each backward, once the work in flight has landed; `sync` is the loop's (outside `no_sync`)."""

    def before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the gradients of `optimizer`'s parameters are reset, once the work in flight has landed."""

    def on_failure(self) -> None:
        """The failure moment: this rank's stage raised, and its peers may be gone, cut off or blocked waiting.

        Called once, on the failing rank only, after the work in flight was forgotten and before the process group
        announces the failure to the other ranks; `teardown` follows. It must neither run nor wait for a collective
        (a peer may never answer) and must return promptly: stop background threads without waiting long, drop
        state owed to peers. Afterwards the strategy may be torn down and set up again on a new process group from
        a checkpoint, so it must leave nothing behind that `setup` does not rebuild.
        """

    def syncs_gradients(self) -> bool:
        """Whether the coming synchronized backward averages gradients (False: the algorithm sends something else)."""
        return True

    def after_backward(self) -> None:
        """After a backward that averaged gradients, and after a joined rank's shadow of one."""

    def apply_update(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Take the optimizer step; `step` applies the loss scaler's part (skip on overflow, scale update)."""
        step()

    def after_optimizer_step(self) -> None:
        """After the update, with `steps` counting it: averaging models, broadcasting parameters, ..."""

    def stage(self) -> int:
        """The index in `stages` of the stage the coming optimizer step runs in (0 for an algorithm with one)."""
        return 0

    def stage_changed(self) -> None:
        """Called when `stage()` moves on: after the step that ends a stage, or when setup or a checkpoint moves it."""

    def algorithm_state_dict(self) -> dict[str, Any]:
        """This rank's state beside `steps` (error feedback, factors, ...), as `state_dict` documents it."""
        return {}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `algorithm_state_dict` returned."""

    def held_buckets(self) -> int | None:
        """For deferred optimizer updates: how many buckets the coming synchronized backward keeps back to its end,
        returning without waiting for any (None, the default: the backward waits for every bucket)."""
        return None

    def _bucket_cap_at_setup(self) -> float:
        """The cap the buckets are laid out with at setup."""
        return float(self.bucket_cap_mb)

    # --------------------------------------------------------------- lifecycle
    def setup(self, task: Task) -> None:
        """Move `task` to the device, check all ranks agree on it, copy rank 0's state, build the reducer.

        Raises:
            ValueError: the ranks' models differ in parameter names, shapes or dtypes, or a lazy module
                has not been initialized by a forward yet.
        """
        self.check_world_size(self.world_size)
        task.to(self.root_device)
        self.check_same_parameters(task)
        # Collective: start every replica from rank 0's parameters and buffers.
        broadcast_coalesced([*task.parameters(), *task.buffers()])
        self._buffers = list(task.buffers())
        self._buffers_stale = False
        sparse = sparse_gradient_parameters(task)
        self._sparse_gradients = bool(sparse)
        self._reducer = Reducer(
            list(task.named_parameters()),
            bucket_cap_mb=self._bucket_cap_at_setup(),
            first_bucket_mb=self.first_bucket_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            comm_hook=self.comm_hook,
            comm_state=self.comm_state,
            overlap=self.overlap,
            timeout=self.timeout,
            sparse_gradients=sparse,
            static_graph=self.static_graph,
            counter=self.comm_counter,
            rebuild_buckets=not self.fixed_layout,
        )
        self._reducer.events = self._comm_events
        if self._step_check is None:
            # Every optimizer's step, including one in a hand-written loop, first checks that the
            # gradients it is about to apply were averaged.
            self._step_check = register_optimizer_step_pre_hook(self._check_before_step)
        self.after_setup(task)
        self._enter_stage()

    def teardown(self) -> None:
        """Land the work in flight (a fit that ended without the loop's last flush), remove its hooks and the
        reducer's; the process group stays for later stages."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            in_flight.land_all()
            in_flight.remove_hooks()
        if self._reducer is not None:
            self._reducer.remove_hooks()
            self._reducer = None
        if self._step_check is not None:
            self._step_check.remove()
            self._step_check = None
        super().teardown()

    # -------------------------------------------------------------- train step
    def on_stage_failure(self) -> None:
        """Forget the work in flight (its collectives may never complete), then the algorithm's `on_failure`."""
        if self.in_flight is not None:
            self.in_flight.forget()
        self.on_failure()
        super().on_stage_failure()

    def apply_pending_updates(self) -> None:
        """Land every bucket of the work in flight: the parameters and optimizer state become every step's."""
        if self.in_flight is not None:
            self.in_flight.land_all()

    # -------------------------------------------------------------- train step
    def training_step(self, task: Task, batch: Any, batch_idx: int) -> Any:
        """Land the task's own parameters (`training_step` may read them outside a forward), refresh buffers from
        rank 0 if a synchronized step changed them, then run the forward."""
        if self.in_flight is not None:
            self.in_flight.land_parameters(task.parameters(recurse=False))
        self.before_forward(task)
        if self._buffers_stale:
            self._broadcast_buffers()
        return call_training_step(task, batch, batch_idx)

    def _broadcast_buffers(self) -> None:
        """Give every rank `buffer_source`'s buffers, if buffers are broadcast."""
        if not (self.broadcast_buffers and self._buffers):
            return
        # Collective: every rank's forward sees rank 0's buffers, as torch's DDP does (under join, the
        # highest rank's that still has data; the same broadcast on a joined rank and after the last round).
        broadcast_coalesced(self._buffers, src=self.buffer_source, counter=self.comm_counter)
        self._buffers_stale = False

    def backward(self, loss: Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Back-propagate `loss`; average gradients across ranks when `sync` is true and the stage averages them.

        With `find_unused_parameters`, a parameter is unused when the graph of `loss` does not reach
        it, whatever else the forward computed from it.
        """
        if self.in_flight is not None:
            self.in_flight.land_all()  # before autograd writes into the buckets again
        self.before_backward(sync)
        reducer = self.reducer
        averages = self._backward_syncs(sync) and self.syncs_gradients()
        start = time.perf_counter()
        walk = self.find_unused_parameters or self.static_graph
        held = self.held_buckets() if averages else None
        reducer.prepare_for_backward(sync=averages, loss=loss if walk else None, hold=held or 0)
        self._autograd_backward(loss, retain_graph)
        reducer.finalize_backward(wait=held is None)
        if averages:
            self._sync_started = start
            self._buffers_stale = True
            self.after_backward()

    def finish_join(self) -> None:
        """Give every rank the last joiner's buffers (the parameters are already equal)."""
        self._broadcast_buffers()  # collective: from the rank that had data last

    def shadow_forward(self) -> None:
        """Shadow `training_step`'s buffer broadcast on a rank whose data ran out."""
        # Collective: the broadcast the ranks with data run before their forward, counted as they count it.
        if self._buffers_stale:
            self._broadcast_buffers()

    def shadow_backward(self) -> None:
        """Shadow a synchronized backward with zero gradients on a rank whose data ran out."""
        reducer = self.reducer
        if self._sparse_gradients or self.static_graph:
            raise RuntimeError(
                "A rank whose data ran out cannot shadow sparse gradients or a static graph; use even data "
                "(uneven_inputs='check') with sparse=True embeddings or static_graph=True."
            )
        self._sync_started = time.perf_counter()
        # A loss with no graph: with find_unused_parameters every parameter is then unreached (unused here).
        reducer.prepare_for_backward(sync=True, loss=torch.zeros(()) if self.find_unused_parameters else None)
        # Collective: the step's bucket all-reduces (and used-parameter map), with zeros from this rank.
        reducer.contribute_zeros()
        reducer.finalize_backward()
        self._buffers_stale = True
        self.after_backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Apply the update, count the step, run what follows it, and close the step's byte count."""
        self.apply_update(optimizer, step)
        if self.stages:
            self.steps += 1
        self.after_optimizer_step()
        self._enter_stage()
        self.comm_counter.close_step()

    def _enter_stage(self) -> None:
        """Tell the algorithm when `steps` has moved it to another stage."""
        stage = self.stage()
        if stage != self._stage:
            self._stage = stage
            self.stage_changed()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Reset the gradients of `optimizer`'s whole parameters as `optimizer.zero_grad()` does (to None), keeping
        bucket views attached.

        A parameter that the next step does not use on any rank ends it with `.grad` None, so weight
        decay and momentum leave frozen and unused parameters where they are, as in one process.
        """
        if self.in_flight is not None:
            self.in_flight.land_all()  # a deferred step still reads the averages in the buckets
        self.before_zero_grad(optimizer)
        self.reducer.zero_grad(self.optimizer_parameters(optimizer))

    def restore_gradients(self, parameters: list[Tensor], grads: list[Tensor | None]) -> None:
        """Put the checkpoint's gradients back and tell the reducer they hold values: a backward that does not
        reach those parameters (a toggled optimizer's) must keep them, not reset them to None as never set."""
        super().restore_gradients(parameters, grads)
        self.reducer.mark_gradients_held([param for param, grad in zip(parameters, grads) if grad is not None])

    def _check_before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Refuse a step on gradients that a bare `loss.backward()` left unaveraged (a global pre-hook).

        Inside `no_sync`, or in a stage that does not average gradients, a local step is deliberate.
        """
        reducer = self._reducer
        if (
            reducer is not None
            and reducer.has_unsynced_gradients
            and not self._sync_disabled
            and self.syncs_gradients()
        ):
            names = reducer.unsynced_parameters([p for group in optimizer.param_groups for p in group["params"]])
            if names:
                raise RuntimeError(unsynced_message(self.global_rank, names))

    # -------------------------------------------------------------- reporting
    def communication_stats(self) -> dict[str, float]:
        """Bytes of the last optimizer step and since setup; while gradients are averaged, the reducer's counters
        of the last synchronized backward (collectives, buckets, exposed wait)."""
        stats = self._reducer_stats() if self.syncs_gradients() else {}
        # The strategy's counter has the last optimizer step's bytes, buffer broadcasts included.
        return {**stats, **self.comm_counter.as_dict()}

    def _reducer_stats(self) -> dict[str, float]:
        reducer = self._reducer
        return {} if reducer is None or reducer.stats().buckets == 0 else reducer.stats().as_dict()

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return `steps` (for an algorithm with stages) and this rank's part of the algorithm's state."""
        counter = {"steps": self.steps} if self.stages else {}
        return {**counter, **self.algorithm_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: the stage first, then the algorithm's state in it."""
        if self.stages:
            # Checkpoints of format 2 written before the core kept the counter call QAdam's and PowerSGD's "step".
            self.steps = int(state["steps"] if "steps" in state else state["step"])
            self._enter_stage()
        self.load_algorithm_state_dict(state)
