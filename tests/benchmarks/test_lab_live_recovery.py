"""The live-recovery figure's values: per cell (nodes, link; fastest link first), the median seconds lost of each
mode, the checkpoint restart's own cost and its cost at the guide's interval, and no bar for a mode a cell lacks.
(The runs themselves are tests/benchmarks/test_lab_faults.py's.)"""

from __future__ import annotations

import pytest

from syncline.lab.live_recovery import plot, plotted


def _record(mode: str, nodes: int, rate: str | None, lost: float, case: str = "worker_killed", **more) -> dict:
    return {"case": case, "mode": mode, "nodes": nodes, "rate": rate, "seconds_lost": lost, **more}


RECORDS = [
    _record("live", 4, "100mbit", 4.1),
    _record("live", 2, "100mbit", 3.8),
    _record("live", 2, "1gbit", 3.0),
    _record("live", 2, "1gbit", 4.0),  # a second run of the cell: its median is drawn
    _record("checkpoint", 2, "1gbit", 5.8, restart_s=5.3, seconds_lost_at_guide_interval=305.3),
    _record("torchft", 2, "1gbit", -0.2),
    _record("torchft", 2, "100mbit", None),  # a run without a failure: no value
    _record("live", 3, None, 9.0, case="node_lost"),  # another case: not in the figure
]


def test_the_figure_has_a_bar_per_mode_and_cell_with_the_cells_median():
    cells, series = plotted(RECORDS)
    assert cells == [(2, "1gbit"), (2, "100mbit"), (4, "100mbit")]
    assert series == {
        "live": [3.5, 3.8, 4.1],
        "checkpoint: restart": [5.3, None, None],
        "checkpoint at the guide's interval": [305.3, None, None],
        "torchft": [-0.2, None, None],
    }


def test_the_figure_draws_from_the_records(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional bench extra")
    plot({"records": RECORDS}, tmp_path / "live.png")
    assert (tmp_path / "live.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
