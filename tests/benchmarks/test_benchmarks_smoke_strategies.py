"""The strategies section (one to two processes) runs end to end in its smoke configuration."""

from __future__ import annotations

import pytest

from benchmarks.report import tables
from tests.benchmarks._smoke import run_smoke


@pytest.fixture(scope="module")
def strategies_run(tmp_path_factory):
    return run_smoke(tmp_path_factory, "strategies")


def test_strategies_run_every_strategy_on_the_same_global_batch(strategies_run):
    strategies = strategies_run["sections"]["strategies"]["strategies"]
    assert {name: s["devices"] for name, s in strategies.items()} == {"single": 1, "bucketed_ddp": 2, "native_ddp": 2}
    # The two reducers average the same gradients: the same model at the end, to the report's precision.
    assert strategies["bucketed_ddp"]["val_loss"]["median"] == pytest.approx(
        strategies["native_ddp"]["val_loss"]["median"], abs=1e-3
    )
    assert "| bucketed_ddp | 2 |" in tables(strategies_run)
