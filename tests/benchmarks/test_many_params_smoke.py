"""`benchmarks/bench_many_params.py` runs end to end at its smallest size, so that it cannot rot unnoticed.

Timings are not checked (speed is never asserted by a test); what is checked is that every variant ran
on real processes and produced the numbers docs/performance.md section 8 is made of.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "benchmarks", "many-params"]
TINY = ["--depth", "3", "--repeats", "2", "--steps", "2", "--warmup", "1"]


def test_two_process_run_reports_every_pair(tmp_path):
    out = tmp_path / "many.json"
    subprocess.run([*COMMAND, *TINY, "--out", str(out)], check=True, timeout=240, cwd=ROOT)
    result = json.loads(out.read_text())
    assert result["setup"]["parameter_tensors"] == 12
    assert set(result["bucketed_over_native"]) == {"default", "find_unused_parameters", "static_graph"}
    for variant in result["variants"].values():
        assert variant["median_ms"] > 0 and variant["timed_steps"] == 2 * 2


def test_one_process_run_reports_each_reducer_against_plain(tmp_path):
    out = tmp_path / "one.json"
    subprocess.run([*COMMAND, *TINY, "--one-process", "--out", str(out)], check=True, timeout=240, cwd=ROOT)
    result = json.loads(out.read_text())
    assert result["variants"]["plain"]["overhead_per_parameter_us"] == 0
    assert {"native_ddp", "bucketed_ddp", "bucketed_ddp_static"} <= set(result["variants"])
