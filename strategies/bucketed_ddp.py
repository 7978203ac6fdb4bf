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
and every option of the reducer, plus the one thing only it does, bucket autotuning
(`bucket_cap_mb="auto"`, `comm/bucket_autotune.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from syncline.options import OptionError, check_int, check_number
from syncline.strategies.comm.bucket_autotune import AUTO, DEFAULT_CAPS_MB, BucketAutotune, distinct_caps
from syncline.strategies.comm.hooks import CommHook
from syncline.strategies.reducer_strategy import CAP_MEANING, ReducerStrategy
from syncline.trainer.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["BucketedDDP"]


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
    """

    name = "bucketed_ddp"

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

    # ---------------------------------------------------------------- autotune
    def _bucket_cap_at_setup(self) -> float:
        # Tuning starts with the smallest cap: the first step runs it.
        return min(self.autotune_caps_mb) if self.bucket_cap_mb == AUTO else float(self.bucket_cap_mb)

    def after_setup(self, task: Task) -> None:
        """With `bucket_cap_mb="auto"`, start the trials (the caps that can change the layout)."""
        self.autotune = None
        self._synced_cap_mb = None
        if self.bucket_cap_mb == AUTO:
            caps = distinct_caps(self.autotune_caps_mb, self.reducer.gradient_group_bytes())
            self.autotune = BucketAutotune(caps, self.autotune_steps)
            self.reducer.set_bucket_cap(self.autotune.current_mb)

    def after_backward(self) -> None:
        """While tuning, time the synchronized step; lay out the cap the tuner asks for."""
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
            f"static_graph={self.static_graph})"
        )
