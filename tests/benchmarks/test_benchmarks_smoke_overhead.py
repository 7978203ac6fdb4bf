"""The overhead section (Trainer against a raw loop) runs end to end in its smoke configuration."""

from __future__ import annotations

import pytest

from benchmarks.report import tables
from tests.benchmarks._smoke import assert_figures, run_smoke


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
    return run_smoke(tmp_path_factory, "overhead")


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
    assert_figures(overhead_run, tmp_path, {"overhead.png"})
