"""The lab's strategy report: which rows give the bound its compute, and the arithmetic of each row."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncline.lab.cluster import root_cause, run_isolating
from syncline.lab.strategies import _table, busy_cpu_seconds, grid_table, lab_rows, model_overrides, select_strategies

ROOT = Path(__file__).resolve().parents[2]


def _record(label: str, step_s: float, sent: list[float], busy: list[float] | None = None) -> dict:
    ranks = [{"sent_per_step": s, "comm_bytes_per_step": s} for s in sent]
    record = {"label": label, "step_s": step_s, "ranks": ranks}
    if busy is not None:
        for rank, seconds in zip(ranks, busy):
            rank["busy_cpu_per_step"] = seconds
        record["cores"] = 2
    return record


def test_only_the_rows_without_communication_are_added_to_a_selection():
    labels = [label for label, _, _ in select_strategies(["native_ddp"])]
    assert labels == ["local", "native_ddp", "local (end)"]  # not local_sgd, which averages


def test_the_bound_takes_the_faster_local_row_and_the_busiest_link():
    records = [
        _record("local", 0.12, [0.0, 0.0]),
        _record("local_sgd", 0.05, [3e6, 3e6]),  # faster than local, but communicates: not the compute
        _record("bucketed_ddp", 0.3, [12.5e6, 10e6], busy=[0.2, 0.22]),
        _record("local (end)", 0.1, [0.0, 0.0]),
    ]
    rows = {row["label"]: row for row in lab_rows(records, nodes=2, rate="1gbit")}
    # 12.5 MB through 1 Gbit/s is 0.1 s, equal to the faster local row: the bound is 0.1 s.
    assert rows["bucketed_ddp"]["bound_s"] == pytest.approx(0.1)
    assert rows["bucketed_ddp"]["measured_over_bound"] == pytest.approx(3.0)
    assert rows["local_sgd"]["bound_s"] == pytest.approx(0.1)
    # The busiest rank's window saw 0.22 busy CPU seconds per step on 2 cores: 0.11 s at the least.
    assert rows["bucketed_ddp"]["cpu_floor_s"] == pytest.approx(0.11)
    assert "cpu_floor_s" not in rows["local"]  # a run recorded before the CPU was counted


def test_an_isolated_strategy_that_fails_is_a_row_and_the_others_still_run():
    jobs = []

    def run(strategies):
        jobs.append([label for label, _, _ in strategies])
        if strategies[0][0] == "torch powersgd":
            raise RuntimeError("lab strategies on 4 nodes failed:\n...\nReceived data size doesn't match expected size")
        return [_record(label, 0.2, [1e6, 1e6]) for label, _, _ in strategies]

    strategies = [("local", "local_sgd", {}), ("torch powersgd", "native_ddp", {}), ("powersgd", "powersgd", {})]
    records = run_isolating(run, strategies, ["torch powersgd"])
    assert jobs == [["local", "powersgd"], ["torch powersgd"]]  # one shared job, then the isolated one alone
    failed = records[-1]
    assert failed["failed"] and failed["error"] == "Received data size doesn't match expected size"
    rows = lab_rows(records, nodes=4, rate=None)
    assert [row["label"] for row in rows] == ["local", "powersgd", "torch powersgd"]
    assert "| torch powersgd | 4 | unshaped | failed: Received data size" in _table(rows)
    assert "| torch powersgd | failed |" in grid_table(rows)


def test_a_failed_jobs_cause_is_gloos_check_or_a_ranks_error_not_the_agents_exit():
    agent = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15"
    check = "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 5632 vs 4864."
    rank = "[rank1]: RuntimeError: Connection reset by peer"
    assert root_cause("\n".join(["lab failed:", rank, check, agent])) == check.strip()
    assert root_cause("\n".join(["lab failed:", rank, agent])) == rank
    assert root_cause("lab failed:\n" + agent) == agent


def test_a_lab_worker_with_no_step_for_its_stall_time_ends_itself():
    """The lab's bound on a hang no process-group timeout catches (torch's PowerSGD hook on gloo, 4 nodes)."""
    script = (
        "import time\n"
        "from syncline.lab.cluster import StallGuard\n"
        "guard = StallGuard('beating', 1.0)\n"
        "for _ in range(6): time.sleep(0.3); guard.beat()\n"
        "guard.stop()\n"
        "StallGuard('torch powersgd', 0.5)\n"
        "time.sleep(30)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 3, done.stderr
    assert "no training step of torch powersgd ended in 0.5 s: hung" in done.stdout
    assert time.monotonic() - started < 20  # the steady beats outlived their 1 s; the silence did not


def test_busy_cpu_seconds_count_this_process_working():
    before = busy_cpu_seconds()
    total = 0
    for i in range(3_000_000):
        total += i
    assert busy_cpu_seconds() > before


def test_model_overrides_name_the_valid_keys():
    assert model_overrides(["batch_size=2", "n_layer=2"]) == {"batch_size": 2, "n_layer": 2}
    with pytest.raises(SystemExit, match="batch_size"):
        model_overrides(["batch=2"])


def test_step_phases_read_a_timeline_trace(tmp_path):
    from benchmarks.lab_deferred_update import step_phases

    def span(name: str, start_ms: float, ms: float, tid: int = 0) -> dict:
        return {"ph": "X", "pid": 0, "tid": tid, "name": name, "ts": start_ms * 1e3, "dur": ms * 1e3}

    step = [
        span("forward", 0, 10),
        span("backward", 10, 50),
        span("bucket 0", 12, 30, tid=1),
        span("bucket 1", 20, 60, tid=2),  # the last completion, at 80 ms
        span("exposed wait", 40, 20),
        span("optimizer step", 60, 5),
    ]
    other_rank = [dict(event, pid=1, dur=1.0) for event in step]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": step + other_rank}))
    phases = step_phases(tmp_path / "trace.json")
    assert phases == {"forward": 10, "autograd": 30, "exposed wait": 20, "optimizer step": 5, "wire": 68}


def test_the_algorithmic_bound_serializes_what_the_strategy_declares():
    records = [
        _record("local", 0.1, [0.0, 0.0]),
        {**_record("local_sgd", 0.25, [12.5e6, 0.0]), "strategy": "local_sgd", "options": {"period": 4}},
        {**_record("bucketed_ddp", 0.3, [12.5e6, 0.0]), "strategy": "bucketed_ddp", "options": {}},
    ]
    phases = {"forward": 30.0, "backward": 50.0, "optimizer": 20.0}
    rows = {row["label"]: row for row in lab_rows(records, nodes=2, rate="1gbit", phases_ms=phases)}
    # 0.1 s of wire: local SGD's averaging follows the step (0.1 + 0.1); bucketed_ddp hides it behind the
    # 0.05 s backward (0.1 - 0.05 + 0.1).
    assert rows["local_sgd"]["algorithmic_bound_s"] == pytest.approx(0.2)
    assert rows["local_sgd"]["measured_over_algorithmic"] == pytest.approx(1.25)
    assert rows["bucketed_ddp"]["algorithmic_bound_s"] == pytest.approx(0.15)
    assert "algorithmic_bound_s" not in rows["local"]
