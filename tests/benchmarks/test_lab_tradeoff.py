"""BAGUA's trade-off tables: speed-ups against bucketed_ddp per cell, runs that never reach the target,
and the performance page quoting the committed results. The lab section skips with one line where
namespaces are not permitted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import lab_section as lab
from benchmarks.plans import PLANS
from syncline.lab.tradeoff import (
    STRATEGIES,
    bounds,
    chosen_rows,
    diloco_row,
    fill_page,
    grid_tables,
    marker_of,
    speedups,
    table,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "lab_tradeoff.json"


def _row(label: str, nodes: int, rate: str, seconds: float, reached: bool = True) -> dict:
    return {"label": label, "nodes": nodes, "rate": rate, "seconds": seconds, "steps": 100, "reached": reached}


def test_speedups_are_per_cell_and_zero_where_the_target_was_never_reached():
    rows = [
        _row("bucketed_ddp", 2, "100mbit", 60.0),
        _row("powersgd", 2, "100mbit", 20.0),
        _row("local_sgd", 2, "100mbit", 90.0, reached=False),
        _row("bucketed_ddp", 4, "100mbit", 100.0),
        _row("powersgd", 4, "100mbit", 40.0),
        _row("powersgd", 2, "1gbit", 10.0),  # no bucketed_ddp in this cell: no speed-up
    ]
    ups = speedups(rows)
    assert ups[(2, "100mbit", "powersgd")] == pytest.approx(3.0)
    assert ups[(4, "100mbit", "powersgd")] == pytest.approx(2.5)
    assert ups[(2, "100mbit", "local_sgd")] == 0.0
    assert (2, "1gbit", "powersgd") not in ups
    text = grid_tables({"target": 1.95, "rows": rows})
    assert "| powersgd | 10.0 (100) | - | 20.0 (100) | 3.00x |" in text  # columns: 1gbit, then 100mbit
    assert "| local_sgd | - | - | > 90 (never) | never |" in text


def test_a_run_stopped_by_the_time_cap_is_not_within_it_and_speedups_against_it_are_bounds():
    def capped(label: str, rate: str, seconds: float) -> dict:
        return {**_row(label, 4, rate, seconds, reached=False), "capped": True, "max_seconds": 900.0}

    rows = [
        capped("bucketed_ddp", "10mbit", 905.0),
        _row("diloco H=100", 4, "10mbit", 100.0),
        capped("powersgd", "10mbit", 910.0),  # both stopped: no speed-up at all
        _row("local_sgd", 4, "10mbit", 1000.0, reached=False),  # the whole epoch without reaching it
        _row("bucketed_ddp", 4, "100mbit", 450.0),
        capped("diloco H=100", "100mbit", 901.0),
    ]
    ups, sides = speedups(rows), bounds(rows)
    # bucketed_ddp needed more than 900 s: diloco is more than 9x sooner; diloco needed more than 900 s where
    # bucketed_ddp took 450: it is less than 0.5x as fast.
    assert (ups[(4, "10mbit", "diloco H=100")], sides[(4, "10mbit", "diloco H=100")]) == (pytest.approx(9.0), ">")
    assert (ups[(4, "100mbit", "diloco H=100")], sides[(4, "100mbit", "diloco H=100")]) == (pytest.approx(0.5), "<")
    assert (4, "10mbit", "powersgd") not in ups and ups[(4, "10mbit", "local_sgd")] == 0.0
    text = grid_tables({"target": 1.95, "rows": rows})
    assert "| bucketed_ddp | 450.0 (100) | 1.00x | > 900 (not within 900 s, 100 steps) | - |" in text
    assert "| diloco H=100 | > 900 (not within 900 s, 100 steps) | < 0.50x | 100.0 (100) | > 9.00x |" in text
    assert "| powersgd | - | - | > 900 (not within 900 s, 100 steps) | - |" in text
    runs = [{**r, "step_s": 1.0, "comm_bytes_per_step": 0.0} for r in rows]
    assert "| 4 | 10mbit | diloco H=100 | 100.0 | 100 | 1.000 | 0.00 MB | - | > 9.00x |" in table(runs)
    assert "| 4 | 10mbit | bucketed_ddp | not within 900 s | 100 |" in table(runs)


@pytest.mark.parametrize(
    ("results", "rates", "nodes"),
    [
        (RESULTS, {"unshaped", "1gbit", "100mbit"}, {2, 4}),
        (RESULTS.with_name("lab_tradeoff_torch.json"), {"unshaped", "1gbit", "100mbit"}, {2, 4}),
        (RESULTS.with_name("lab_tradeoff_diloco.json"), {"unshaped", "1gbit", "100mbit", "10mbit"}, {2, 4}),
    ],
    ids=lambda p: p.stem if isinstance(p, Path) else None,
)
def test_performance_page_quotes_the_committed_tradeoff_run(results, rates, nodes):
    page = (ROOT / "docs" / "performance.md").read_text()
    data = json.loads(results.read_text())
    fix = f"run `python -m syncline.lab tradeoff --out {results.relative_to(ROOT)} --write docs/performance.md`"
    assert fill_page(page, data, marker_of(results)) == page, fix
    assert {r["rate"] for r in data["rows"]} == rates
    assert {r["nodes"] for r in data["rows"]} == nodes


def test_the_lab_section_skips_in_one_line_without_namespaces(monkeypatch):
    said = []
    monkeypatch.setattr(lab, "namespaces_unavailable", lambda: "the network lab needs private network namespaces")
    assert lab.run_lab_section(PLANS["smoke"], said.append) == {
        "skipped": "the network lab needs private network namespaces"
    }
    assert said == ["lab: skipped: the network lab needs private network namespaces"]


def test_torchs_rows_count_their_failures_and_compare_with_synclines_counterpart():
    rows = [
        _row("bucketed_ddp", 2, "100mbit", 60.0),
        _row("powersgd", 2, "100mbit", 20.0),
        _row("torch powersgd", 2, "100mbit", 30.0),
        {**_row("torch powersgd", 2, "100mbit", 0.0, reached=False), "failed": True, "error": "size mismatch"},
        _row("torch powersgd", 2, "100mbit", 25.0),
    ]
    text = grid_tables({"target": 1.95, "rows": rows})
    # The median of the two runs that did not fail (the lower: 25 s), one failure in three, 1.25x syncline's 20 s.
    assert "| torch powersgd | 25.0 (100), 25.0-30.0, 1/3 failed; powersgd 1.25x sooner | 2.40x |" in text
    failed = [{**_row("torch powersgd", 4, "1gbit", 0.0, reached=False), "failed": True, "error": "died"}]
    assert "| torch powersgd | failed, 1/1 failed | - |" in grid_tables({"target": 1.95, "rows": failed})


def test_runs_that_record_their_peak_get_a_bytes_table_and_the_10mbit_cell_comes_last():
    def run(label: str, rate: str, mean: float, peak: float) -> dict:
        return {**_row(label, 4, rate, 50.0), "comm_bytes_per_step": mean, "peak_comm_bytes_per_step": peak}

    rows = [
        run("bucketed_ddp", "10mbit", 3.26e6, 3.26e6),
        run("diloco H=100", "10mbit", 0.03e6, 3.26e6),
        run("streaming diloco H=100 F=4", "10mbit", 0.03e6, 0.81e6),
        run("bucketed_ddp", "100mbit", 3.26e6, 3.26e6),
    ]
    text = grid_tables({"target": 1.95, "rows": rows})
    # Each strategy's bytes are the same at every rate: one last column, no table of their own.
    assert (
        "| strategy | 100mbit: s (steps) | vs bucketed_ddp | 10mbit: s (steps) | vs bucketed_ddp | bytes per step per "
        "node, mean / peak |"
    ) in text
    assert "| streaming diloco H=100 F=4 | - | - | 50.0 (100) | 1.00x | 0.03 MB / 0.81 MB |" in text
    assert "mean over the run / peak step):" not in text
    # Where a strategy's differ between rates (a run stopped early), they get a table of their own.
    text = grid_tables({"target": 1.95, "rows": [*rows, run("streaming diloco H=100 F=4", "100mbit", 0.02e6, 0.81e6)]})
    assert "4 nodes, bytes per step per node (mean over the run / peak step):" in text
    assert "| streaming diloco H=100 F=4 | 0.02 MB / 0.81 MB | 0.03 MB / 0.81 MB |" in text
    # Runs recorded before the peak was: no bytes table.
    assert "peak" not in grid_tables({"target": 1.95, "rows": [_row("bucketed_ddp", 2, "100mbit", 60.0)]})


def test_a_diloco_setting_named_in_the_rows_words_runs_and_an_unknown_label_is_refused():
    for label, name, options in STRATEGIES:  # the table's DiLoCo rows read as they are defined
        if name == "diloco":
            assert diloco_row(label) == (label, name, options)
    label = "streaming diloco H=12 F=4 uint8 overlap=2 carry outer_lr=1.0 outer_momentum=0.0"
    expected = {"period": 12, "fragments": 4, "compression": "uint8", "overlap_steps": 2, "merge": "carry"}
    assert chosen_rows(["powersgd", label]) == [
        next(row for row in STRATEGIES if row[0] == "powersgd"),
        (label, "diloco", {**expected, "outer_lr": 1.0, "outer_momentum": 0.0}),
    ]
    with pytest.raises(SystemExit, match=r"--only 'powersgd2' 'diloco H=x': no such row\. Rows: 'bucketed_ddp'"):
        chosen_rows(["powersgd2", "diloco H=x", "powersgd"])
