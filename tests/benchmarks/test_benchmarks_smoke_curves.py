"""The curves section (training at every skip-sync interval) runs end to end in its smoke configuration."""

from __future__ import annotations

import math

import pytest

from benchmarks.report import tables
from tests.benchmarks._smoke import assert_figures, run_smoke


@pytest.fixture(scope="module")
def curves_run(tmp_path_factory):
    return run_smoke(tmp_path_factory, "curves")


def test_curves_train_every_interval_with_base_and_scaled_learning_rates(curves_run):
    curves = curves_run["sections"]["curves"]
    assert set(curves["runs"]) == {"1", "2"}
    assert set(curves["lr_scaled"]) == {"2"} and set(curves["lr_scaled"]["2"]) == {"sqrt"}
    assert curves["lr_scaled"]["2"]["sqrt"]["lr"] == pytest.approx(curves["model"]["lr"] * math.sqrt(2))
    for run in [*curves["runs"].values(), curves["lr_scaled"]["2"]["sqrt"]]:
        # One loss per micro-batch of rank 0, and a finite validation loss at the end.
        assert len(run["losses"]) == curves["microbatches"]
        assert math.isfinite(run["val_loss"]["median"])
    best = curves_run["headline"]["curves_best_val_loss_by_sync_every"]["2"]
    assert best["val_loss"] == min(
        curves["runs"]["2"]["val_loss"]["median"], curves["lr_scaled"]["2"]["sqrt"]["val_loss"]["median"]
    )


def test_report_and_figure_of_the_curves(curves_run, tmp_path):
    assert "| 2 | 2 |" in tables(curves_run)
    assert_figures(curves_run, tmp_path, {"skip_sync.png"})
