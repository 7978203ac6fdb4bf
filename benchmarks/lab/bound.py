"""The algorithmic bound of a step: what a strategy's algorithm must serialize, and what it may overlap.

The lab's link bound, ``max(local step, wire)``, assumes every second of compute can hide wire time. Most
algorithms allow less: a gradient all-reduce cannot start before the backward produces the gradients, nor the
next forward before the optimizer step has used all of them; local SGD's averaging follows the step and the
next forward needs its result. Each strategy's communication is a few *wire phases* (`wire_phases`, below, by
the strategy's registered name and options), each a share of the step's wire time and the part of the local step
it may run behind:

    "none"      nothing: the phase is serialized with compute (after the step, inside a blocking hook)
    "backward"  the backward (buckets launched as gradients become ready)
    "forward"   the next forward (parameters sent layer by layer, the forward waiting per layer)
    "all"       the whole step (a background thread, or deferred updates)

With the local step split into forward F, backward B and optimizer step O (their shares measured by
`syncline.lab.strategies.local_phases`), local = F + B + O, W the busiest node's bytes per step over the rate,
and for each phase p its share s_p of W and the compute h_p it may hide behind (0, B, F or local):

    algorithmic bound = local + sum over phases of (max(h_p, s_p W) - h_p)

so a phase that hides behind nothing adds its wire time, and one that hides behind the whole step gives the link
bound ``max(local, W)``. Phases hide behind distinct parts of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from syncline.strategies.reducer_strategy import ReducerStrategy
from syncline.strategies.strategy import Strategy

__all__ = ["OVERLAPS", "WIRE_PHASES", "Overlap", "WirePhase", "algorithmic_bound", "wire_phases"]

Overlap = Literal["none", "backward", "forward", "all"]
#: The parts of a step a wire phase may hide behind.
OVERLAPS: tuple[str, ...] = ("none", "backward", "forward", "all")


@dataclass(frozen=True)
class WirePhase:
    """One phase of a step's communication.

    Attributes:
        share: its share of the busiest node's wire time per step (phases in opposite directions of a full-duplex
            link, a parameter server's gradients in and parameters out, may each carry 1).
        hides_behind: the part of the local step it may overlap (`OVERLAPS`).
        why: one line on what forces it there, for the docs and the lab's report.
    """

    share: float
    hides_behind: Overlap
    why: str = ""

    def __post_init__(self) -> None:
        if self.hides_behind not in OVERLAPS:
            raise ValueError(f"WirePhase(hides_behind={self.hides_behind!r}): one of {', '.join(OVERLAPS)}.")


def algorithmic_bound(
    phases: Sequence[WirePhase], local_s: float, wire_s: float, fractions: Mapping[str, float]
) -> float:
    """Return the least time a step of this algorithm can take (see the module's docstring).

    Args:
        phases: the strategy's `wire_phases(strategy)`.
        local_s: the local step (no communication), seconds.
        wire_s: the busiest node's bytes per step through its link, seconds.
        fractions: the shares of the local step spent in "forward" and "backward" (the rest is the optimizer's).
    """
    hidden = {
        "none": 0.0,
        "backward": local_s * fractions["backward"],
        "forward": local_s * fractions["forward"],
        "all": local_s,
    }
    bound = local_s
    for phase in phases:
        behind = hidden[phase.hides_behind]
        bound += max(behind, phase.share * wire_s) - behind
    return bound


#: The reducer's: gradient buckets on the wire during the backward.
_BUCKETS = (WirePhase(1.0, "backward", "buckets launch as the backward produces them; the step needs every one"),)
#: The averaging family after its warm-up: averaging follows the step, and the next forward needs its result (the
#: lab's wire time is already per step, a period's bytes over its steps).
_AVERAGING = (WirePhase(1.0, "none", "averaging follows the step; the next forward needs its result"),)


def _parameter_server(strategy: Any) -> tuple[WirePhase, ...]:
    """Gradients in behind the backward; parameters out behind the next forward with `prefetch`, else after the
    step. The server's link carries (W-1) copies each way, in opposite directions: each phase takes the whole wire
    time."""
    return (
        WirePhase(1.0, "backward", "gradient buckets reach the server during the backward"),
        WirePhase(1.0, "forward", "the server's new parameters reach each layer before the forward does")
        if strategy.prefetch
        else WirePhase(1.0, "none", "the workers wait for the whole broadcast before the forward"),
    )


def _sharded_parameter_server(strategy: Any) -> tuple[WirePhase, ...]:
    """The reduce-scatter behind the backward; the all-gather behind the next forward with `prefetch`, else after the
    step. Each sends (W-1)/W of the gradients from every node: half the step's wire time each."""
    return (
        WirePhase(0.5, "backward", "the reduce-scatter runs bucket by bucket during the backward"),
        WirePhase(0.5, "forward", "the updated chunks reach each layer before the forward does")
        if strategy.prefetch
        else WirePhase(0.5, "none", "every rank waits for the whole all-gather before the forward"),
    )


def _native_ddp(strategy: Any) -> tuple[WirePhase, ...]:
    """torch's reducer: gradient buckets behind the backward; its relaxations as syncline's own."""
    if strategy.comm_hook == "powersgd":
        return (WirePhase(1.0, "none", "torch's PowerSGD hook: P then Q all-reduce per bucket"),)
    if strategy.comm_hook == "post_local_sgd":
        return (WirePhase(1.0, "none", "torch's averager follows the step; the next forward needs its result"),)
    return (WirePhase(1.0, "backward", "torch's buckets launch as the backward produces them"),)


#: What each registered strategy's communication may overlap once past any warm-up, by its registered name.
WIRE_PHASES: dict[str, Callable[[Any], tuple[WirePhase, ...]]] = {
    "single": lambda strategy: (),
    # With deferred updates the wire may run behind the whole step (forward, backward and optimizer step).
    "bucketed_ddp": lambda strategy: (
        (WirePhase(1.0, "all", "updates land per layer in the next forward (ByteScheduler)"),)
        if strategy.deferred_update
        else _BUCKETS
    ),
    "native_ddp": _native_ddp,
    # Behind the backward on the communication thread; inside the hook, serialized with it.
    "bytegrad": lambda strategy: (
        _BUCKETS
        if strategy.comm_thread
        else (WirePhase(1.0, "none", "each bucket's exchange blocks the backward inside the autograd hook"),)
    ),
    # After the exact start: a bucket's P and Q all-reduces are sequential, with the orthogonalization between
    # them, and the default 25 MiB bucket holds the whole model, so the exchange follows the backward.
    "powersgd": lambda strategy: (
        WirePhase(1.0, "none", "P then Q all-reduce per bucket, the model in one bucket: after the backward"),
    ),
    # After the warm-up: each bucket of momenta is quantized in one chunk per rank, and rank 0's chunk (the front
    # layers) is complete only when the backward ends; the update needs the average.
    "qadam": lambda strategy: (
        WirePhase(1.0, "none", "the momentum's per-rank chunks need the whole backward; the step needs them"),
    ),
    "local_sgd": lambda strategy: _AVERAGING,
    # With prefetch, the exchange runs behind the next forward; else serialized as the averaging family's.
    "decentralized": lambda strategy: (
        (WirePhase(1.0, "forward", "the averaged differences land per layer in the next forward"),)
        if strategy.prefetch
        else _AVERAGING
    ),
    # Blocking, serialized with compute; with overlap on the thread, behind the next inner steps.
    "diloco": lambda strategy: (
        (WirePhase(1.0, "all", "an exchange runs behind the next overlap_steps inner steps"),)
        if strategy.overlap_steps and strategy.comm_thread
        else _AVERAGING
    ),
    "async_model_average": lambda strategy: (
        WirePhase(1.0, "all", "a background thread averages while training goes on"),
    ),
    "tensor_fusion": lambda strategy: (
        WirePhase(1.0, "backward", "gradients are fused and reduced as the backward produces them"),
    ),
    "parameter_server": _parameter_server,
    "sharded_parameter_server": _sharded_parameter_server,
}


def wire_phases(strategy: Strategy) -> tuple[WirePhase, ...]:
    """Return `strategy`'s wire phases; a strategy the table does not name is taken as the reducer's when it is built
    on the core (gradient buckets behind the backward), else as sending nothing."""
    phases = WIRE_PHASES.get(type(strategy).name)
    if phases is not None:
        return phases(strategy)
    return _BUCKETS if isinstance(strategy, ReducerStrategy) else ()
