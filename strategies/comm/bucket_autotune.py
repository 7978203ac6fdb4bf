"""Bucket autotuning: try a few bucket caps in the first synchronized steps, agree on one, keep it.

`BucketedDDP(bucket_cap_mb="auto")` runs this schedule, as BAGUA's and Horovod's autotuners do, in a
simpler, deterministic form (no Bayesian search):

    candidates = caps_mb, less those that lay out the same buckets as a smaller one (every cap at or
                 above the largest gradient group gives "everything after the first bucket in one")
    for each candidate c:                      # in the first synchronized steps of training
        lay the buckets out with cap c         # the reducer's `set_bucket_cap`, between two steps
        1 warm-up step, then `steps` timed steps: backward + all-reduce wall time, on this rank
    median[c] = max over ranks of this rank's median[c]       # one all-reduce (MAX) of n numbers
    chosen = argmin median; ties -> the larger cap             # the same answer on every rank
    lay the buckets out with the chosen cap, once, and train on

Changing the cap regroups gradients into other flat buffers, between synchronized steps; it never
changes what is averaged, so the trial steps are ordinary training steps. The decision and the trial
timings are kept in the strategy's `state_dict`, so a resumed run takes the chosen cap without tuning
again (and a run stopped during tuning continues the schedule where it was).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from syncline.strategies.comm.collective_log import COLLECTIVES

__all__ = ["AUTO", "DEFAULT_CAPS_MB", "BucketAutotune", "distinct_caps"]

#: The value of `bucket_cap_mb` that asks for autotuning.
AUTO = "auto"
#: Caps tried by default (MiB): torch's default (25) with one size below it, one far below, one above.
DEFAULT_CAPS_MB = (1.0, 5.0, 25.0, 100.0)

_MB = 1024 * 1024


def distinct_caps(caps_mb: Sequence[float], group_bytes: Sequence[int]) -> list[float]:
    """Return `caps_mb` sorted, without the caps that cannot change the layout.

    A cap at or above the bytes of the largest group of gradients (one dtype on one device) puts every
    gradient after the first bucket into one bucket, whatever the order; so of all such caps only the
    smallest is tried.
    """
    largest = max(group_bytes, default=0)
    kept: list[float] = []
    for cap in sorted(set(caps_mb)):
        kept.append(cap)
        if cap * _MB >= largest:
            break
    return kept


@dataclass
class BucketAutotune:
    """The schedule of trials, this rank's timings, and the agreed cap.

    Attributes:
        caps_mb: the caps to try, in order (after `distinct_caps`).
        steps: timed synchronized steps per cap, after one warm-up step with it.
        seconds: per cap tried so far, this rank's timed steps (seconds).
        agreed_ms: per cap, the slowest rank's median (ms): what the choice compared. Empty until decided.
        chosen_mb: the agreed cap; None while tuning.
        observed: synchronized steps seen since tuning began.
    """

    caps_mb: list[float]
    steps: int
    seconds: dict[float, list[float]] = field(default_factory=dict)
    agreed_ms: dict[float, float] = field(default_factory=dict)
    chosen_mb: float | None = None
    observed: int = 0

    def __post_init__(self) -> None:
        if len(self.caps_mb) == 1 and self.chosen_mb is None:
            # Nothing to compare: no trial, no collective.
            self.chosen_mb = self.caps_mb[0]

    @property
    def done(self) -> bool:
        """Whether a cap has been agreed on."""
        return self.chosen_mb is not None

    @property
    def current_mb(self) -> float:
        """The cap the next synchronized step runs with."""
        if self.chosen_mb is not None:
            return self.chosen_mb
        return self.caps_mb[min(self.observed // (self.steps + 1), len(self.caps_mb) - 1)]

    def observe(self, seconds: float, device: torch.device) -> float | None:
        """Count one synchronized step of `seconds`; return the cap to lay out now, if it changes.

        After the last trial step this all-reduces the trial medians (every rank calls it at the same
        synchronized step, so the collective pairs up) and returns the chosen cap.
        """
        assert not self.done
        cap = self.current_mb
        position = self.observed % (self.steps + 1)
        self.observed += 1
        if position > 0:  # position 0 is the cap's warm-up step: a new layout's first step is not timed
            self.seconds.setdefault(cap, []).append(seconds)
        if self.observed < len(self.caps_mb) * (self.steps + 1):
            following = self.current_mb
            return following if following != cap else None
        self._agree(device)
        return self.chosen_mb

    def _agree(self, device: torch.device) -> None:
        medians = torch.tensor(
            [statistics.median(self.seconds[cap]) for cap in self.caps_mb], dtype=torch.float64, device=device
        )
        COLLECTIVES.record("all-reduce (max) of the bucket autotune's trial medians")
        # Collective: the slowest rank's median per cap, so every rank compares the same numbers.
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        # Host sync: the medians decide the layout, on the CPU.
        slowest = medians.tolist()
        self.agreed_ms = {cap: seconds * 1e3 for cap, seconds in zip(self.caps_mb, slowest)}
        # Ties go to the larger cap: fewer collectives for the same time.
        self.chosen_mb = min(self.caps_mb, key=lambda cap: (self.agreed_ms[cap], -cap))

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the schedule's progress, this rank's timings and the decision (plain numbers and lists)."""
        return {
            "caps_mb": list(self.caps_mb),
            "steps": self.steps,
            "observed": self.observed,
            "seconds": [[cap, list(values)] for cap, values in self.seconds.items()],
            "agreed_ms": [[cap, ms] for cap, ms in self.agreed_ms.items()],
            "chosen_mb": self.chosen_mb,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BucketAutotune:
        """Rebuild the tuner that `state_dict` described."""
        return cls(
            caps_mb=[float(cap) for cap in state["caps_mb"]],
            steps=int(state["steps"]),
            seconds={float(cap): [float(s) for s in values] for cap, values in state["seconds"]},
            agreed_ms={float(cap): float(ms) for cap, ms in state["agreed_ms"]},
            chosen_mb=None if state["chosen_mb"] is None else float(state["chosen_mb"]),
            observed=int(state["observed"]),
        )

    def summary(self) -> str:
        """One line: the chosen cap and what each cap tried cost (the slowest rank's median)."""
        trials = ", ".join(f"{cap:g} MiB {ms:.1f} ms" for cap, ms in self.agreed_ms.items())
        return f"bucket autotune chose bucket_cap_mb={self.chosen_mb:g} (backward + all-reduce: {trials or 'no trial'})"
