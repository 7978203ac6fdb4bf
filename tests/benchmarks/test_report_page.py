"""docs/performance.md quotes the committed suite run: its tables are exactly what report.py makes of the JSON.

The suite itself is too slow for the tests (see test_benchmarks_smoke.py for its smallest configuration);
these tests read the committed results, so a rerun of the suite that is not written into the page, or a
hand edit of a table, fails here.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import main
from benchmarks.common import ROOT
from benchmarks.report import BLOCKS, blocks, fill

PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results" / "suite.json"


@pytest.fixture(scope="module")
def results():
    return json.loads(RESULTS.read_text())


def test_page_has_every_table_once():
    assert sorted(blocks(PAGE.read_text())) == sorted(BLOCKS)


def test_page_tables_are_the_committed_run(results):
    page = PAGE.read_text()
    assert fill(page, results) == page, "run `python -m benchmarks report --write docs/performance.md`"
    assert results["mode"] == "full"
    # The page names the run it quotes.
    assert results["started_at"] in page


def test_fill_replaces_only_the_marked_block(results):
    page = "intro\n<!-- report:strategies -->\nstale\n<!-- /report:strategies -->\nafter\n"
    filled = fill(page, results)
    assert filled.startswith("intro\n<!-- report:strategies -->\n\n| strategy |")
    assert filled.endswith("|\n\n<!-- /report:strategies -->\nafter\n")
    assert "stale" not in filled
    assert fill(filled, results) == filled


def test_unknown_block_and_missing_section_are_named(results):
    with pytest.raises(ValueError, match="unknown report block 'nope'"):
        fill("<!-- report:nope -->\n\n<!-- /report:nope -->", results)
    partial = {**results, "sections": {k: v for k, v in results["sections"].items() if k != "curves"}}
    with pytest.raises(ValueError, match="'curves' needs a section"):
        fill("<!-- report:curves -->\n\n<!-- /report:curves -->", partial)


def test_check_fails_on_a_stale_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- report:machine -->\nold\n<!-- /report:machine -->\n")
    with pytest.raises(SystemExit, match="differ from"):
        main(["report", str(RESULTS), "--check", str(page)])
    main(["report", str(RESULTS), "--write", str(page)])
    main(["report", str(RESULTS), "--check", str(page)])
    assert "| CPU |" in page.read_text()
