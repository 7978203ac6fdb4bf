"""The benchmark suite's smallest runs, shared by the smoke test files (one section a file, so that pytest-xdist runs
the sections that train through the Trainer in fresh processes side by side)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.run import run_suite


def run_smoke(tmp_path_factory: pytest.TempPathFactory, section: str) -> dict[str, Any]:
    """Run one section of the suite in its smoke configuration; return its results."""
    out = tmp_path_factory.mktemp("bench") / f"{section}.json"
    return run_suite("smoke", (section,), out, log=lambda message: None)


def assert_figures(results: dict[str, Any], out: Path, names: set[str]) -> None:
    """The figures drawn from `results` are exactly `names`, each a PNG (skipped without matplotlib)."""
    pytest.importorskip("matplotlib", reason="matplotlib is the optional bench extra")
    from benchmarks.plot import plot_all

    written = plot_all(results, out)
    assert {path.name for path in written} == names
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
