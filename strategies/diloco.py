"""DiLoCo (Douillard et al. 2023) and streaming DiLoCo (Douillard et al. 2025).

DiLoCo, "Distributed Low-Communication training", with M replicas, H = `period` inner steps:

    θ̃ = θ                                                     # the global parameters, the same on every rank
    for each outer step:
        for h = 1..H:  θ_m = InnerOpt_m(θ_m, ∇L(x_m, θ_m))      # replica m, its own optimizer, its own data
        Δ = mean_m(θ̃ - θ_m)                                     # the outer gradient: one all-reduce
        θ̃ = OuterOpt(θ̃, Δ)                                      # SGD, Nesterov momentum (outer_lr, outer_momentum)
        θ_m = θ̃

Streaming DiLoCo cuts the parameters into F = `fragments` fragments and synchronizes fragment p on its own
schedule, every H steps at offset t_p = p·H/F, so that each exchange carries 1/F of the model (peak bytes
per step / F). A fragment is part p of each dtype's flat parameters, cut as `torch.tensor_split` cuts (the
paper cuts by layers; every operation below is elementwise, so only the sizes differ). The exchange runs
behind the next τ = `overlap_steps` inner steps, and the new global fragment is merged into the local one,
which moved meanwhile, with the mixing factor α = `alpha`:

    after inner step t, for each fragment p:
        if t ≡ t_p (mod H):       Δ_p = mean_m(θ̃_p - θ_m,p)              # launched now, on the wire for τ steps
        if t - τ ≡ t_p (mod H):   θ̃_p = OuterOpt_p(θ̃_p, Δ_p)
                                  θ_m,p = α θ_m,p + (1 - α) θ̃_p

With F = 1, τ = 0 and α = 0 this is DiLoCo. `merge="carry"` replaces the mix by the global fragment plus the
replica's own τ inner steps since the launch, θ_m,p = θ̃_p + (θ_m,p - θ_m,p at launch): none of the overlapped
steps' progress is halved away, and the replicas differ after the merge by those steps only, as they would
τ steps after a blocking exchange (equal to the mix for τ = 0).

The outer gradient may travel in bfloat16 or as 8-bit MinMax codes (`compression`, the shared quantizer and its
scatter-reduce in `comm/compression.py`), with error feedback by default: what compression dropped is added to the
next outer gradient of the same fragment.

The optimizer the task configures is the inner one, each rank's own (never averaged); the outer one is
torch's SGD over the global copies, one per fragment. An in-flight exchange runs on a communication thread
(`comm/comm_thread.py`) with a process group of its own; `comm_thread=False` runs it at launch, blocking,
and holds the result τ steps: the same numbers to the bit. Checkpoints keep every rank's replica and inner
optimizer state (`replicas_differ`), and the global copies, the outer momentum, the error feedback and the
averaged outer gradient of a fragment in flight, so a run resumes bit-exactly anywhere in a period.

Under ``Trainer(recovery="live")`` the outer state (θ̃, the outer momentum, the step count that places every
fragment's schedule, and an exchange in flight) is the group's: after a death, every member takes the healing
member's, so the survivors agree bit for bit even where an exchange completed on some of them and not on
others. An exchange that lost a member is dropped: its fragment's θ̃ and momentum stay at the last completed
outer step, and the replicas keep their inner steps, so the fragment's next outer gradient carries them. Each
survivor keeps its replica, its inner optimizer and its error feedback. A replacement starts its replica at θ̃,
with error feedback at zero (it has sent nothing yet), and the inner optimizer state of the member it heals
from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.options import OptionError, check_int, check_number
from syncline.strategies.comm.comm_thread import CommThread
from syncline.strategies.comm.compression import ErrorFeedback, compressed_average
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.flat import flatten, group_by_dtype, read_range, write_range
from syncline.strategies.comm.transfers import all_reduce
from syncline.strategies.model_averaging import ModelAveraging

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["COMPRESSIONS", "DiLoCo"]

#: Seconds the communication thread gets to stop after this rank's stage failed.
_FAILED_JOIN_S = 2.0
#: How the outer gradient may travel: float32 as it is, bfloat16, or 8-bit MinMax codes (ByteGrad's exchange).
COMPRESSIONS = ("none", "bf16", "uint8")
#: How a new global fragment meets the local one that moved during the overlap: the paper's mix, or the global
#: fragment plus the local steps since the launch.
MERGES = ("mix", "carry")


@dataclass
class _Fragment:
    """What one exchange synchronizes: a range of the flat parameters of each dtype, its global copy θ̃, the outer
    optimizer over that copy, and the step offset of its schedule."""

    spans: list[tuple[int, int]]
    globals: list[Tensor]
    outer: torch.optim.SGD
    offset: int


@dataclass
class _InFlight:
    """A fragment's averaged outer gradient on its way: applied after local step `apply_at`. With
    ``merge="carry"``, `launched_from` holds this replica's fragment at the launch (one tensor per dtype)."""

    fragment: int
    apply_at: int
    future: Future[tuple[list[Tensor], CommCounter]]
    launched_from: list[Tensor] | None = None


class DiLoCo(ModelAveraging):
    """Inner steps on each replica's own optimizer, an outer Nesterov step on the averaged weight delta.

    Args:
        period: inner optimizer steps between two exchanges of a fragment (H).
        outer_lr: the outer SGD's learning rate (the paper's 0.7).
        outer_momentum: the outer SGD's Nesterov momentum (the paper's 0.9; 0: plain SGD).
        fragments: fragments of the model exchanged on staggered schedules (F; 1 is DiLoCo, more is streaming
            DiLoCo). Must divide `period`.
        overlap_steps: inner steps an exchange runs behind before its result is merged (τ); None is 0 with one
            fragment (DiLoCo blocks) and 1 with several (streaming; 0 where period / fragments is 1). Less than
            period / fragments.
        alpha: the mixing factor of the merge, the local fragment's weight (α); None is 0 without overlap (take
            the global fragment) and 0.5 with it (an even mix). Only with ``merge="mix"``.
        merge: "mix" (the paper's: α θ_m,p + (1 - α) θ̃_p) or "carry" (θ̃_p plus the replica's inner steps since
            the launch, so the overlapped steps keep all their progress).
        compression: how the outer gradient travels: "none" (float32), "bf16" or "uint8" (8-bit MinMax).
        error_feedback: with compression, carry what it dropped into the fragment's next outer gradient.
        comm_thread: run exchanges on a communication thread (False: at launch, blocking; the same numbers).
        warmup_steps: optimizer steps of exact gradient all-reduce before the first inner step.
        kwargs: passed to the core, whose reducer runs the warm-up (`bucket_cap_mb`, `backend`, `timeout`, ...).
    """

    name = "diloco"
    live_recovery_refused = ""  # the outer state is the group's, taken from one member; replicas stay their own
    manual_optimization_refused = (
        "its outer step follows every period-th optimizer step, counting one optimizer step per batch"
    )

    def __init__(
        self,
        period: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        overlap_steps: int | None = None,
        alpha: float | None = None,
        merge: str = "mix",
        compression: str = "none",
        error_feedback: bool = True,
        comm_thread: bool = True,
        warmup_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        check_int("DiLoCo", "period", period, 1, meaning="inner steps between exchanges")
        check_number("DiLoCo", "outer_lr", outer_lr, above=0, meaning="the outer SGD's learning rate")
        check_number("DiLoCo", "outer_momentum", outer_momentum, minimum=0, meaning="Nesterov momentum, below 1")
        if outer_momentum >= 1:
            raise OptionError(f"DiLoCo(outer_momentum={outer_momentum!r}): outer_momentum must be below 1 (0.9).")
        check_int("DiLoCo", "fragments", fragments, 1, meaning="1 is DiLoCo, more is streaming DiLoCo")
        if period % fragments:
            raise OptionError(
                f"DiLoCo(period={period}, fragments={fragments}): fragments must divide period (fragment f is "
                f"exchanged at offset f*period/fragments); e.g. period={period - period % fragments or fragments}."
            )
        spacing = period // fragments
        if overlap_steps is None:
            # Streaming overlaps one inner step, where its schedule leaves one between two exchanges.
            overlap_steps = 0 if fragments == 1 else min(1, spacing - 1)
        check_int("DiLoCo", "overlap_steps", overlap_steps, 0, meaning="inner steps an exchange runs behind")
        if overlap_steps >= spacing:
            raise OptionError(
                f"DiLoCo(overlap_steps={overlap_steps}): overlap_steps must be below period / fragments = {spacing} "
                "(one exchange in flight at a time); lower it or raise period."
            )
        if merge not in MERGES:
            raise OptionError(f"DiLoCo(merge={merge!r}): merge must be one of {', '.join(map(repr, MERGES))}.")
        if merge == "carry" and alpha is not None:
            raise OptionError(
                f"DiLoCo(merge='carry', alpha={alpha!r}): alpha is the weight of the mix; leave it out with 'carry', "
                "which keeps the local steps since the launch instead."
            )
        if alpha is None:
            alpha = 0.0 if overlap_steps == 0 else 0.5
        check_number("DiLoCo", "alpha", alpha, minimum=0, meaning="the local fragment's weight in the merge, 0..1")
        if alpha > 1:
            raise OptionError(f"DiLoCo(alpha={alpha!r}): alpha must be between 0 and 1 (the local fragment's weight).")
        if compression not in COMPRESSIONS:
            raise OptionError(
                f"DiLoCo(compression={compression!r}): compression must be one of {', '.join(map(repr, COMPRESSIONS))}."
            )
        super().__init__(warmup_steps=warmup_steps, **kwargs)
        self.period = period
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.fragments = fragments
        self.overlap_steps = overlap_steps
        self.alpha = alpha
        self.merge = merge
        self.compression = compression
        self.error_feedback = error_feedback
        self.comm_thread = comm_thread
        self._feedback = ErrorFeedback()
        #: The parameters by dtype (at setup): each group's flat concatenation is cut into the fragments' ranges.
        self._groups: list[list[Tensor]] = []
        self._fragments: list[_Fragment] = []
        self._in_flight: _InFlight | None = None
        self._thread: CommThread | None = None
        #: Set when this rank's stage failed: its peers may be gone, so nobody waits for the thread.
        self._failed = False

    # --------------------------------------------------------------- lifecycle
    def after_setup(self, task: Task) -> None:
        """Group the parameters by dtype, start the outer loop from them, start the communication thread."""
        super().after_setup(task)
        self._failed = False
        self._groups = group_by_dtype(self._params)
        smallest = min((sum(t.numel() for t in group) for group in self._groups), default=0)
        if smallest < self.fragments:
            raise OptionError(
                f"DiLoCo(fragments={self.fragments}): the model has {smallest} trainable values of one dtype, fewer "
                "than fragments; use fewer fragments."
            )
        self._start_outer_loop()
        if self.comm_thread and self.world_size > 1 and self._thread is None:
            # Collective: every rank creates the thread's process group, in the same order.
            self._thread = CommThread("syncline-diloco", self.timeout)

    def stage_changed(self) -> None:
        """After the warm-up, the outer loop starts from the parameters the warm-up reached."""
        if self.local and self._groups:
            self._start_outer_loop()

    def _start_outer_loop(self) -> None:
        """θ̃ = θ for every fragment; fresh outer optimizers; no error remembered, nothing in flight.

        Fragment p holds part p of each dtype's flat parameters cut as `torch.tensor_split` cuts (sizes differ by at
        most one value), so each exchange carries 1/F of the model.
        """
        momentum, self._fragments = self.outer_momentum, []
        flats = [flatten(group) for group in self._groups]
        for index in range(self.fragments):
            spans = [_part(flat.numel(), index, self.fragments) for flat in flats]
            globals_ = [flat[start:end].clone() for flat, (start, end) in zip(flats, spans)]
            outer = torch.optim.SGD(globals_, lr=self.outer_lr, momentum=momentum, nesterov=momentum > 0)
            self._fragments.append(_Fragment(spans, globals_, outer, index * self.period // self.fragments))
        self._feedback.reset()
        self._in_flight = None

    def on_peer_lost(self) -> None:
        """Keep the exchange in flight if it completed here; drop it if it failed or is still waiting after a
        moment (its collective lost a member). The group then heals from one member's outer state, so what each
        survivor keeps here only matters on that member."""
        self._failed = True  # the thread may be stuck in the lost collective: teardown waits for it briefly
        in_flight = self._in_flight
        if in_flight is None:
            return
        deadline = time.monotonic() + _FAILED_JOIN_S
        while not in_flight.future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not in_flight.future.done() or not _succeeded(in_flight.future):
            self._in_flight = None

    def heal_from(self, state: dict[str, Any], *, replacement: bool) -> None:
        """Take the healing member's outer state (θ̃, outer momentum, step count, exchange in flight); a replacement
        starts its replica at θ̃ and its error feedback at zero, keeping the inner optimizer state it loaded."""
        super().heal_from(state, replacement=replacement)
        own = self._in_flight
        self._load_outer_state(state)
        if replacement:
            self._feedback.reset()
            for fragment in self._fragments:
                for group, (start, end), glob in zip(self._groups, fragment.spans, fragment.globals):
                    write_range(group, start, end, glob)
        healed = self._in_flight
        if healed is not None and healed.launched_from is not None:
            # `merge="carry"` counts this replica's own steps since the launch: the source's launch point is the
            # source's replica. A survivor that launched the same exchange keeps its own; a replacement, or a
            # survivor that dropped it, counts from where it stands now.
            if (
                not replacement
                and own is not None
                and own.launched_from is not None
                and ((own.fragment, own.apply_at) == (healed.fragment, healed.apply_at))
            ):
                healed.launched_from = own.launched_from
            else:
                healed.launched_from = self._local(self._fragments[healed.fragment])

    def on_failure(self) -> None:
        """Drop the exchange in flight and wait only briefly for the thread: its peers may be gone."""
        self._failed = True
        self._in_flight = None

    def teardown(self) -> None:
        """Let an exchange in flight finish (a checkpoint after the fit keeps it), stop the thread, then the core's."""
        self._settle_in_flight()
        thread, self._thread = self._thread, None
        if thread is not None:
            # After a failure the thread's collective may wait for a peer that is gone, until the group's timeout:
            # leave it (a daemon) to the process, which is about to end.
            thread.close(_FAILED_JOIN_S if self._failed else None)
        super().teardown()

    # -------------------------------------------------------------- the loop
    def average_after_step(self, local_step: int) -> None:
        """Launch the exchanges due after inner step `local_step`, then merge the one whose overlap is over."""
        for index, fragment in enumerate(self._fragments):
            if local_step % self.period == fragment.offset:
                self._launch(index, local_step)
        if self._in_flight is not None and self._in_flight.apply_at == local_step:
            self._merge()

    def _launch(self, index: int, local_step: int) -> None:
        """Δ_p = θ̃_p - θ_m,p, averaged over the ranks on the thread (or here, blocking)."""
        fragment = self._fragments[index]
        locals_ = self._local(fragment)
        deltas = [glob - local for glob, local in zip(fragment.globals, locals_)]
        if self._thread is not None:
            future = self._thread.submit(self._average, index, deltas, self._thread.group)
        else:
            future = Future()
            future.set_result(self._average(index, deltas, None))
        launched_from = locals_ if self.merge == "carry" and self.overlap_steps else None
        self._in_flight = _InFlight(index, local_step + self.overlap_steps, future, launched_from)

    def _local(self, fragment: _Fragment) -> list[Tensor]:
        """A copy of this replica's values of `fragment`, one tensor per dtype."""
        return [read_range(group, start, end) for group, (start, end) in zip(self._groups, fragment.spans)]

    def _average(self, index: int, deltas: list[Tensor], group: Any) -> tuple[list[Tensor], CommCounter]:
        """Return the mean over ranks of each outer gradient of fragment `index`, and the bytes sent (counted apart:
        they join the strategy's count at the merge, so a step's bytes do not depend on the thread's timing)."""
        counter, world, averages = CommCounter(), dist.get_world_size(group), []
        for dtype_index, delta in enumerate(deltas):
            key = f"{index}.{dtype_index}"
            lossy = self.compression != "none"
            if lossy and self.error_feedback:
                delta = self._feedback.compensate(key, delta)
            if self.compression == "uint8":
                # Collective: BAGUA's 8-bit scatter-reduce and all-gather (ByteGrad's exchange).
                average, sent = compressed_average(delta, group, counter)
            elif self.compression == "bf16":
                wire = delta.to(torch.bfloat16)
                sent = wire.clone()
                # Collective: the bfloat16 sum (float32's range: no overflow), divided after.
                all_reduce(wire, counter, group=group)
                average = wire.to(delta.dtype) / world
            else:
                average = delta / world  # divided before the sum, as `average_parameters`
                # Collective: one flat all-reduce of the fragment's outer gradient.
                all_reduce(average, counter, group=group)
            if lossy and self.error_feedback:
                self._feedback.remember(key, delta, sent)
            averages.append(average)
        return averages, counter

    def _merge(self) -> None:
        """θ̃_p = OuterOpt_p(θ̃_p, Δ_p); θ_m,p = α θ_m,p + (1 - α) θ̃_p, or θ̃_p + (θ_m,p - θ_m,p at launch)."""
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        # Host sync: wait for the thread's exchange (done already when it overlapped enough steps).
        averages, sent = in_flight.future.wait()
        self.comm_counter.absorb(sent)
        fragment = self._fragments[in_flight.fragment]
        for glob, average in zip(fragment.globals, averages):
            glob.grad = average
        fragment.outer.step()
        launched_from = in_flight.launched_from or [None] * len(fragment.globals)
        for group, (start, end), glob, launched in zip(self._groups, fragment.spans, fragment.globals, launched_from):
            glob.grad = None
            if launched is not None:
                write_range(group, start, end, glob + (read_range(group, start, end) - launched))
            else:
                # lerp(θ̃, θ, α) = θ̃ + α (θ - θ̃): exactly θ̃ for α = 0.
                write_range(group, start, end, torch.lerp(glob, read_range(group, start, end), self.alpha))

    def _settle_in_flight(self) -> None:
        """Wait for the exchange in flight (every rank's thread ran it), keeping its result for its merge."""
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.future.done():
            in_flight.future.wait()

    # ------------------------------------------------------------- checkpoints
    def algorithm_state_dict(self) -> dict[str, Any]:
        """This rank's global copies, outer optimizer states, error feedback and averaged fragment in flight."""
        in_flight = None
        if self._in_flight is not None:
            # Host sync: the exchange finishes first (every rank's thread runs it), so the checkpoint holds its result.
            averages, sent = self._in_flight.future.wait()
            in_flight = {
                "fragment": self._in_flight.fragment,
                "apply_at": self._in_flight.apply_at,
                "averages": _cpu_copies(averages),
                "bytes": sent.total_bytes,
                "launched_from": _cpu_copies(self._in_flight.launched_from),
            }
        return {
            **super().algorithm_state_dict(),
            "globals": [_cpu_copies(fragment.globals) for fragment in self._fragments],
            "outer": [fragment.outer.state_dict() for fragment in self._fragments],
            "error_feedback": self._feedback.state_dict(),
            "in_flight": in_flight,
        }

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `algorithm_state_dict` returned (after setup: the fragments exist)."""
        super().load_algorithm_state_dict(state)
        self._load_outer_state(state)
        self._feedback.load_state_dict({k: v.to(self.root_device) for k, v in state["error_feedback"].items()})

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        """Restore the global copies, the outer optimizers and the exchange in flight from a `state_dict`."""
        for fragment, saved, outer in zip(self._fragments, state["globals"], state["outer"], strict=True):
            for glob, value in zip(fragment.globals, saved, strict=True):
                glob.copy_(value)
            fragment.outer.load_state_dict(outer)
        self._in_flight = None
        if state["in_flight"] is not None:
            saved = state["in_flight"]
            sent = CommCounter()
            sent.load_state_dict({"step_bytes": 0, "total_bytes": int(saved["bytes"])})
            future: Future[tuple[list[Tensor], CommCounter]] = Future()
            future.set_result(([a.to(self.root_device) for a in saved["averages"]], sent))
            launched = saved.get("launched_from")
            launched = None if launched is None else [t.to(self.root_device) for t in launched]
            self._in_flight = _InFlight(int(saved["fragment"]), int(saved["apply_at"]), future, launched)

    def __repr__(self) -> str:
        return (
            f"DiLoCo(period={self.period}, outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, "
            f"fragments={self.fragments}, overlap_steps={self.overlap_steps}, alpha={self.alpha}, "
            f"merge={self.merge!r}, "
            f"compression={self.compression!r}, comm_thread={self.comm_thread})"
        )


def _cpu_copies(tensors: list[Tensor] | None) -> list[Tensor] | None:
    """CPU copies of `tensors` for a checkpoint (None stays None)."""
    return None if tensors is None else [t.detach().cpu().clone() for t in tensors]


def _succeeded(future: Future[Any]) -> bool:
    """Whether a completed `future` holds a result rather than an error."""
    try:
        future.value()
    except Exception:
        return False
    return True


def _part(numel: int, index: int, parts: int) -> tuple[int, int]:
    """[start, end) of part `index` of `numel` values cut in `parts` as `torch.tensor_split` cuts them."""
    size, longer = divmod(numel, parts)
    start = index * size + min(index, longer)
    return start, start + size + (index < longer)
