"""The algorithmic bound: each phase adds the wire time its compute cannot hide; every strategy declares phases."""

from __future__ import annotations

import pytest

from syncline.lab.bound import OVERLAPS, WIRE_PHASES, WirePhase, algorithmic_bound, wire_phases
from syncline.strategies import STRATEGIES, BucketedDDP, ByteGrad

FRACTIONS = {"forward": 0.3, "backward": 0.5}  # the optimizer step is the other 0.2


@pytest.mark.parametrize(
    ("phases", "wire", "expected"),
    [
        ((), 5.0, 1.0),  # no communication: the local step
        ((WirePhase(1.0, "none"),), 0.5, 1.5),  # serialized: local + wire
        ((WirePhase(1.0, "all"),), 0.5, 1.0),  # behind everything: the link bound max(local, wire)
        ((WirePhase(1.0, "all"),), 3.0, 3.0),
        ((WirePhase(1.0, "backward"),), 0.4, 1.0),  # hidden by the 0.5 s backward
        ((WirePhase(1.0, "backward"),), 2.0, 2.5),  # forward + wire + step
        # A parameter server: gradients in behind the backward, parameters out behind the forward.
        ((WirePhase(1.0, "backward"), WirePhase(1.0, "forward")), 2.0, 4.2),
        ((WirePhase(0.5, "backward"), WirePhase(0.5, "forward")), 2.0, 2.2),
    ],
)
def test_each_phase_adds_what_its_compute_cannot_hide(phases, wire, expected):
    assert algorithmic_bound(phases, 1.0, wire, FRACTIONS) == pytest.approx(expected)


def test_every_registered_strategy_declares_its_phases():
    assert set(WIRE_PHASES) == set(STRATEGIES)
    for name, cls in STRATEGIES.items():
        for phase in wire_phases(cls()):
            assert phase.hides_behind in OVERLAPS and 0 < phase.share <= 1 and phase.why, name
    assert wire_phases(BucketedDDP(deferred_update=True))[0].hides_behind == "all"
    assert wire_phases(ByteGrad(comm_thread=False))[0].hides_behind == "none"
    with pytest.raises(ValueError, match="hides_behind"):
        WirePhase(1.0, "optimizer")  # type: ignore[arg-type]
