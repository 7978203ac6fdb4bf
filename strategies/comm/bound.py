"""The algorithmic bound of a step: what a strategy's algorithm must serialize, and what it may overlap.

The lab's link bound, ``max(local step, wire)``, assumes every second of compute can hide wire time. Most
algorithms allow less: a gradient all-reduce cannot start before the backward produces the gradients, nor the
next forward before the optimizer step has used all of them; local SGD's averaging follows the step and the
next forward needs its result. Each strategy declares its communication as a few *wire phases*
(`Strategy.wire_phases`), each a share of the step's wire time and the part of the local step it may run
behind:

    "none"      nothing: the phase is serialized with compute (after the step, inside a blocking hook)
    "backward"  the backward (buckets launched as gradients become ready)
    "forward"   the next forward (parameters sent layer by layer, the forward waiting per layer)
    "all"       the whole step (a background thread, or deferred updates)

With the local step split into forward F, backward B and optimizer step O (their shares measured by
`benchmarks.lab.strategies.local_phases`), local = F + B + O, W the busiest node's bytes per step over the rate,
and for each phase p its share s_p of W and the compute h_p it may hide behind (0, B, F or local):

    algorithmic bound = local + sum over phases of (max(h_p, s_p W) - h_p)

so a phase that hides behind nothing adds its wire time, and one that hides behind the whole step gives the link
bound ``max(local, W)``. Phases hide behind distinct parts of the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["OVERLAPS", "Overlap", "WirePhase", "algorithmic_bound"]

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
        phases: the strategy's `wire_phases()`.
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
