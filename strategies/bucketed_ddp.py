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

Everything above is the core's (`reducer_strategy.py`): BucketedDDP is the core with the default comm hook
and every option of the reducer, plus the two things only it does: bucket autotuning
(`bucket_cap_mb="auto"`, `comm/bucket_autotune.py`) and deferred optimizer updates (`deferred_update=True`,
`comm/deferred_update.py`: each bucket's step runs in the next forward, just before the layer that uses it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from syncline.options import OptionError, check_int, check_number
from syncline.rank_zero import rank_zero_info
from syncline.strategies.comm.bucket_autotune import AUTO, DEFAULT_CAPS_MB, BucketAutotune, distinct_caps
from syncline.strategies.comm.deferred_update import DeferredUpdates
from syncline.strategies.comm.hooks import CommHook
from syncline.strategies.comm.sparse_gradients import sparse_gradient_parameters
from syncline.strategies.reducer_strategy import CAP_MEANING, ReducerStrategy

if TYPE_CHECKING:
    from torch import Tensor

    from syncline.trainer.task import Task

__all__ = ["BucketedDDP"]

_DEFERRED_NEEDS = (
    "each bucket's optimizer step runs in the next forward, so nothing may need every averaged gradient before the step"
)


class BucketedDDP(ReducerStrategy):
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
        deferred_update: do not wait for the buckets at the end of the backward; step the optimizer on each
            bucket's parameters in the next forward, just before the first module that uses them
            (`comm/deferred_update.py`). Bit-identical weights; refuses what needs every averaged gradient
            before the step (gradient clipping, fp16's loss scaler, manual optimization, uneven inputs by join)
            and the options whose bookkeeping needs every bucket at the backward's end.
        deferred_hold: with `deferred_update`, the fraction of the buckets (the front layers, ready last)
            launched only when the backward ends, front-most first, so the next forward's first layers get
            their averages first.
    """

    name = "bucketed_ddp"
    live_recovery_refused = ""  # every replica holds the whole state: any survivor can heal the others

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
        deferred_update: bool = False,
        deferred_hold: float = 0.5,
    ) -> None:
        if bucket_cap_mb == AUTO:
            self._check_autotune(autotune_caps_mb, autotune_steps)
        check_number("BucketedDDP", "deferred_hold", deferred_hold, minimum=0, meaning="a fraction of the buckets")
        if deferred_hold > 1:
            raise OptionError(f"BucketedDDP(deferred_hold={deferred_hold}): give a fraction of the buckets, 0 to 1.")
        if deferred_update:
            _check_deferrable(
                bucket_cap_mb=bucket_cap_mb,
                find_unused_parameters=find_unused_parameters,
                static_graph=static_graph,
                gradient_as_bucket_view=gradient_as_bucket_view,
                overlap=overlap,
            )
        super().__init__(
            bucket_cap_mb,
            first_bucket_mb,
            find_unused_parameters,
            comm_hook=comm_hook,
            comm_state=comm_state,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            overlap=overlap,
            static_graph=static_graph,
            backend=backend,
            timeout=timeout,
        )
        self.autotune_caps_mb = tuple(autotune_caps_mb)
        self.autotune_steps = autotune_steps
        #: The autotuner of `bucket_cap_mb="auto"` (its trials and the agreed cap); None for a fixed cap.
        self.autotune: BucketAutotune | None = None
        self._synced_cap_mb: float | None = None  # the cap of the last synchronized step, while autotuning
        self.deferred_update = deferred_update
        self.deferred_hold = deferred_hold

    @property
    def deferred(self) -> DeferredUpdates | None:
        """With `deferred_update`, the buckets whose optimizer step the next forward owes: the core's work in flight
        (after setup; None otherwise)."""
        return cast("DeferredUpdates | None", self.in_flight)

    def _check_bucket_cap(self, bucket_cap_mb: Any) -> None:
        # 0 is meaningful, as in torch's DDP: every parameter gets its own bucket.
        if bucket_cap_mb != AUTO:
            check_number("BucketedDDP", "bucket_cap_mb", bucket_cap_mb, minimum=0, meaning=CAP_MEANING + ', or "auto"')

    def _check_autotune(self, caps_mb: Sequence[float], steps: int) -> None:
        """Refuse "auto" with bad trial options."""
        if isinstance(caps_mb, str) or not caps_mb:
            raise OptionError(f"BucketedDDP(autotune_caps_mb={caps_mb!r}): give a non-empty list of caps in MiB.")
        for cap in caps_mb:
            check_number("BucketedDDP", "autotune_caps_mb", cap, minimum=0, meaning="each cap tried, in MiB")
        check_int("BucketedDDP", "autotune_steps", steps, 1, meaning="timed steps per cap tried")

    # ------------------------------------------------------- deferred updates
    @property
    def manual_optimization_refused(self) -> str:  # type: ignore[override]
        """Why these options cannot follow manual optimization ("" when they can)."""
        if self.deferred_update:
            return f"deferred_update=True: {_DEFERRED_NEEDS} (the task steps its own optimizers); drop deferred_update"
        return super().manual_optimization_refused

    @property
    def supports_join(self) -> bool:
        """Not with deferred updates: a joined rank's shadow step waits for every bucket."""
        return not self.deferred_update and super().supports_join

    def check_fit_options(self, *, gradient_clip_val: float | None, precision: str) -> None:
        """With `deferred_update`, refuse gradient clipping and fp16's loss scaler, which need every averaged
        gradient before the step."""
        if not self.deferred_update:
            return
        refused = []
        if gradient_clip_val:
            refused.append(f"gradient_clip_val={gradient_clip_val} (clipping needs every bucket's gradients)")
        if precision in ("16-mixed", "16"):
            refused.append(f"precision={precision!r} (the loss scaler checks every gradient for inf before the step)")
        if refused:
            raise OptionError(
                f"BucketedDDP(deferred_update=True) cannot run with {' and '.join(refused)}: {_DEFERRED_NEEDS}. "
                "Drop deferred_update, or those options (bf16-mixed needs no scaler)."
            )

    def held_buckets(self) -> int | None:
        """With `deferred_update`, once the buckets follow the observed order: the buckets held to the end."""
        if self.deferred is None or not self.reducer.has_rebuilt_buckets:
            return None  # the first synchronized backward observes the gradient order, and waits as usual
        return round(self.deferred_hold * len(self.reducer.buckets))

    def apply_update(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Take the step, or, with buckets in flight, record it for the next forward."""
        if self.deferred is not None and self.deferred.pending:
            self.deferred.step(optimizer)
        else:
            step()

    def clip_gradients(self, parameters: list[Tensor], max_norm: float, algorithm: str = "norm") -> Tensor:
        """Refuse with deferred updates (a task's own `configure_gradient_clipping` gets here too)."""
        if self.deferred_update:
            raise OptionError(f"BucketedDDP(deferred_update=True) cannot clip gradients: {_DEFERRED_NEEDS}.")
        return super().clip_gradients(parameters, max_norm, algorithm)

    # ---------------------------------------------------------------- autotune
    def _bucket_cap_at_setup(self) -> float:
        # Tuning starts with the smallest cap: the first step runs it.
        return min(self.autotune_caps_mb) if self.bucket_cap_mb == AUTO else float(self.bucket_cap_mb)

    def after_setup(self, task: Task) -> None:
        """With `bucket_cap_mb="auto"`, start the trials (the caps that can change the layout)."""
        self.autotune = None
        self._synced_cap_mb = None
        if self.deferred_update:
            if sparse_gradient_parameters(task):
                raise OptionError(
                    "BucketedDDP(deferred_update=True) cannot defer sparse gradients (nn.Embedding(sparse=True)), "
                    "which are averaged after every bucket; drop deferred_update or sparse=True."
                )
            self.in_flight = DeferredUpdates(self.reducer, task)
        if self.bucket_cap_mb == AUTO:
            caps = distinct_caps(self.autotune_caps_mb, self.reducer.gradient_group_bytes())
            self.autotune = BucketAutotune(caps, self.autotune_steps)
            self.reducer.set_bucket_cap(self.autotune.current_mb)

    def after_backward(self) -> None:
        """With `deferred_update`, owe the step of the buckets still in flight; while tuning, time the synchronized
        step and lay out the cap the tuner asks for."""
        if self.deferred is not None:
            self.deferred.defer(self.reducer.launched_buckets)
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
        cap = tuner.observe(time.perf_counter() - self._sync_started, self.root_device)
        if cap is not None:
            self.reducer.set_bucket_cap(cap)
        if tuner.done:
            rank_zero_info(tuner.summary())

    # -------------------------------------------------------------- reporting
    def _reducer_stats(self) -> dict[str, float]:
        """The reducer's counters; with `bucket_cap_mb="auto"`, also `comm/bucket_cap_mb`: the last synchronized
        step's cap (a trial's, then the agreed one)."""
        stats = super()._reducer_stats()
        if self._synced_cap_mb is not None:
            stats["comm/bucket_cap_mb"] = self._synced_cap_mb
        return stats

    # ------------------------------------------------------------- checkpoints
    def algorithm_state_dict(self) -> dict[str, Any]:
        """Return the autotuner's trials and agreed cap (with `bucket_cap_mb="auto"`; else nothing)."""
        return {} if self.autotune is None else {"autotune": self.autotune.state_dict()}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
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
            f"static_graph={self.static_graph}"
            + (f", deferred_update=True, deferred_hold={self.deferred_hold}" if self.deferred_update else "")
            + ")"
        )


def _check_deferrable(**options: Any) -> None:
    """Refuse, in one message, the options that `deferred_update=True` cannot combine with."""
    reasons = {
        "bucket_cap_mb": ("auto", "autotuning times each synchronized step at the backward's end"),
        "find_unused_parameters": (True, "unused gradients are settled once every bucket is averaged"),
        "static_graph": (True, "its used-parameter map is settled once every bucket is averaged"),
        "gradient_as_bucket_view": (False, "the averages are copied back once every bucket is averaged"),
        "overlap": (False, "without overlap there is nothing to defer to; drop deferred_update"),
    }
    refused = [f"{name}={value!r} ({why})" for name, (value, why) in reasons.items() if options[name] == value]
    if refused:
        raise OptionError(f"BucketedDDP(deferred_update=True) cannot combine with {'; '.join(refused)}.")
