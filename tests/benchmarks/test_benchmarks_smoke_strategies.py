"""The benchmark suite's strategies section in its smallest configuration runs end to end (fresh processes
through the Trainer), so that it cannot rot unnoticed. One section a file: pytest-xdist runs the files side by side.
"""

from __future__ import annotations

import pytest

from benchmarks.report import tables
from benchmarks.run import run_suite


@pytest.fixture(scope="module")
def strategies_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "strategies.json"
    return run_suite("smoke", ("strategies",), out, log=lambda message: None)


def test_strategies_run_every_strategy_on_the_same_global_batch(strategies_run):
    strategies = strategies_run["sections"]["strategies"]["strategies"]
    assert {name: s["devices"] for name, s in strategies.items()} == {"single": 1, "bucketed_ddp": 2, "native_ddp": 2}
    # The two reducers average the same gradients: the same model at the end, to the report's precision.
    assert strategies["bucketed_ddp"]["val_loss"]["median"] == pytest.approx(
        strategies["native_ddp"]["val_loss"]["median"], abs=1e-3
    )
    assert "| bucketed_ddp | 2 |" in tables(strategies_run)
