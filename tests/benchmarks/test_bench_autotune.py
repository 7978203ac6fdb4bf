"""`benchmarks/bench_autotune.py` runs end to end at a tiny size, so that it cannot rot unnoticed.

Its ranks run in the runner the tests use, as the script's own do. Timings are not
checked; what is checked is that every variant ran and "auto" reports its choice and its cost.
"""

from __future__ import annotations

from benchmarks.bench_autotune import run_rank, summarize
from benchmarks.cli import parse_args
from syncline.testing import run_distributed

TINY = ["--width", "16", "--depth", "3", "--caps", "0.001", "0.002", "1", "--repeats", "2", "--steps", "2"]


def test_auto_and_every_fixed_cap_run_side_by_side():
    args = parse_args(["autotune", *TINY])
    gathered, _ = run_distributed(run_rank, world_size=2, args=(args,), timeout=120)
    result = summarize(gathered, args)
    assert list(result["variants"]) == ["0.001 MiB", "0.002 MiB", "1 MiB", "auto"]
    for variant in result["variants"].values():
        assert variant["step"]["n"] == 2 * 2 and len(variant["repeat_medians_ms"]) == 2
    auto = result["variants"]["auto"]
    # Three distinct caps (the model's 3.6 KB of gradients exceed the two small ones): 3 x (warm-up + 2 timed).
    assert all(cap in args.caps for cap in auto["chosen_mb"]) and auto["tuning_steps"] == 3 * (1 + 2)
    assert result["best_fixed"] in result["variants"]
