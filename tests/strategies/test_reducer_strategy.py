"""The core of the reducer strategies: every algorithm is hooks around the same steps, and counts no bytes itself."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from syncline.strategies.native_ddp import NativeDDP
from syncline.strategies.reducer_strategy import ReducerStrategy
from syncline.strategies.registry import STRATEGIES

CORE_STEPS = ("training_step", "backward", "optimizer_step", "zero_grad", "on_stage_failure")
ALGORITHMS = sorted(name for name, cls in STRATEGIES.items() if issubclass(cls, ReducerStrategy))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_no_algorithm_overrides_a_core_step(name):
    cls = STRATEGIES[name]
    overridden = [step for step in CORE_STEPS if getattr(cls, step) is not getattr(ReducerStrategy, step)]
    assert overridden == [], f"{cls.__name__} overrides {overridden}: use the moment hooks instead"


def test_algorithm_files_count_no_bytes_themselves():
    """Bytes are counted where they leave (the transfer wrappers, the comm hooks, the reducer), never beside a
    collective in an algorithm; torch's DDP sends its own, so `native_ddp` counts what it hands torch."""
    counting = re.compile(r"counter\.add")
    folder = Path(inspect.getsourcefile(ReducerStrategy)).parent
    files = [path for path in folder.glob("*.py") if path.name != Path(inspect.getsourcefile(NativeDDP)).name]
    found = {path.name: counting.findall(path.read_text()) for path in files}
    assert {name: calls for name, calls in found.items() if calls} == {}
