"""The benchmark suite's overhead section in its smallest configuration runs end to end (fresh processes
through the Trainer), so that it cannot rot unnoticed. One section a file: pytest-xdist runs the files side by side.
"""

from __future__ import annotations

import pytest

from benchmarks.report import tables
from benchmarks.run import run_suite


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "overhead.json"
    return run_suite("smoke", ("overhead",), out, log=lambda message: None)


def test_overhead_times_each_loop_in_fresh_processes_and_in_one(overhead_run):
    loops = overhead_run["sections"]["overhead"]["loops"]
    assert {"raw", "trainer"} <= set(loops)
    for loop in loops.values():
        assert loop["step_us"]["median"] > 0 and loop["fresh_process_step_us"]["median"] > 0
        assert loop["first_step_s"]["median"] > 0
    trainer = loops["trainer"]
    assert trainer["step_ratio_over_raw"] == pytest.approx(
        trainer["step_us"]["median"] / loops["raw"]["step_us"]["median"], abs=1e-3
    )


def test_report_and_figure_of_the_overhead(overhead_run, tmp_path):
    text = tables(overhead_run)
    assert "| raw |" in text and "| trainer |" in text
    pytest.importorskip("matplotlib", reason="matplotlib is the optional bench extra")
    from benchmarks.plot import plot_all

    written = plot_all(overhead_run, tmp_path)
    assert {p.name for p in written} == {"overhead.png"}
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
