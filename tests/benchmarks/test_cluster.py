"""The network lab: a 2-node cluster in private namespaces runs a torchrun job and leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from syncline.lab.cluster import (
    LabResult,
    NodeResult,
    _strategy_names,
    bounded,
    end_nodes,
    link_bound,
    namespaces_unavailable,
    parse_rate,
    run_lab,
    step_report,
    with_run_dir,
)
from syncline.trainer.launcher import LAUNCH_DIR_PREFIX

ROOT = Path(__file__).resolve().parents[2]

JOB = textwrap.dedent(
    """
    import sys
    import torch
    from syncline import Trainer
    from tests.trainer._tasks import Regressor, loader, quiet, regression_data

    from syncline.callbacks import Callback


    class CommBytes(Callback):
        total = 0.0

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            self.total += trainer.strategy.communication_stats().get("comm/bytes", 0.0)


    torch.manual_seed(0)
    task, counter = Regressor(), CommBytes()
    trainer = Trainer(max_steps=3, strategy="bucketed_ddp", **quiet(callbacks=[counter]))
    trainer.fit(task, loader(regression_data(64), batch_size=4))
    if trainer.global_rank == 0:
        torch.save({"weights": task.state_dict(), "comm_bytes": counter.total}, sys.argv[1])
    """
)


def test_rates_parse_as_tc_spells_them():
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("2.5Gbit") == 2.5e9
    with pytest.raises(ValueError, match="100mbit or 1gbit"):
        parse_rate("100MB/s")


def test_the_bound_is_compute_or_the_busiest_link():
    # 25 MB through 1 Gbit/s is 0.2 s: above 0.05 s of compute, the wire bounds the step.
    assert link_bound(0.05, [25e6, 12e6], 1e9) == pytest.approx(0.2)
    assert link_bound(0.5, [25e6, 12e6], 1e9) == 0.5
    with pytest.raises(ValueError):
        link_bound(0.1, [1.0], 0)


def test_a_jobs_steps_are_read_off_rank_0s_timeline_and_the_links(tmp_path):
    def forward(rank: int, step: int, start_s: float) -> dict:
        return {
            "ph": "X",
            "name": "forward",
            "pid": rank,
            "tid": 0,
            "ts": start_s * 1e6,
            "dur": 1,
            "args": {"step": step},
        }

    # Steps 0-4 of rank 0 start at 0, 1.0, 1.5, 2.0, 3.5 s (a validation between 3 and 4); rank 1 is ignored.
    starts = [0.0, 1.0, 1.5, 2.0, 3.5]
    events = [forward(0, step, start) for step, start in enumerate(starts)] + [forward(1, 2, 9.0)]
    events.append(forward(0, 2, 1.6))  # a second micro-batch of step 2: the step starts at its first
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    nodes = [NodeResult(0, 0, 5_000_000, 0, ""), NodeResult(1, 0, 2_500_000, 0, "")]
    report = step_report(LabResult(2, "100mbit", 100e6, 10.0, nodes), trace)
    # From step 1 (1.0 s) to step 4 (3.5 s): 2.5 s over 3 steps; the first step (warm-up) is left out.
    assert report.steps == 5 and report.seconds_per_step == pytest.approx(2.5 / 3)
    assert report.bytes_per_step == [1_000_000, 500_000]
    assert report.wire_seconds == pytest.approx(0.08) and report.wire_share == pytest.approx(0.08 / (2.5 / 3))
    unshaped = step_report(LabResult(2, None, None, 10.0, nodes), trace)
    assert unshaped.wire_seconds is None and unshaped.wire_share is None


def test_a_syncline_command_gets_one_output_folder_for_every_node(tmp_path):
    assert with_run_dir(["-m", "syncline", "task=x"], tmp_path) == [
        "-m",
        "syncline",
        "task=x",
        f"hydra.run.dir={tmp_path}",
    ]
    assert with_run_dir(["-m", "syncline", "hydra.run.dir=mine"], tmp_path) == ["-m", "syncline", "hydra.run.dir=mine"]
    assert with_run_dir(["train.py", "--lr", "1"], tmp_path) == ["train.py", "--lr", "1"]


def test_strategies_are_for_syncline_commands_and_must_be_registered():
    assert _strategy_names(None, ["train.py"]) is None
    assert _strategy_names("powersgd, bytegrad", ["-m", "syncline"]) == ["powersgd", "bytegrad"]
    every = _strategy_names("all", ["-m", "syncline"])
    assert "single" not in every and {"bucketed_ddp", "native_ddp", "bytegrad"} <= set(every)
    assert "independent model in each process" in _strategy_names("single,bytegrad", ["-m", "syncline"])
    assert "needs a `-m syncline ...` command" in _strategy_names("all", ["train.py"])
    assert "unknown powersdg" in _strategy_names("powersdg", ["-m", "syncline"])


def test_a_syncline_job_without_a_bound_gets_one():
    """The Trainer's default is 1,000 epochs: the lab adds a step limit unless the command has its own."""
    assert bounded(["-m", "syncline", "task=x"], 50) == ["-m", "syncline", "task=x", "trainer.max_steps=50"]
    for own in ("trainer.max_steps=7", "trainer.max_epochs=1", "+trainer.max_time=00:00:01:00"):
        assert bounded(["-m", "syncline", own], 50) == ["-m", "syncline", own]
    assert bounded(["-m", "syncline"], 0) == ["-m", "syncline"]
    assert bounded(["train.py", "--epochs", "3"], 50) == ["train.py", "--epochs", "3"]  # --timeout bounds it


def _host_network() -> tuple[str, bool]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return " ".join(sorted(line.split(":")[1].strip() for line in links.splitlines())), Path("/run/netns").exists()


@pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))
def test_a_two_node_trainer_job_runs_through_shaped_links_and_leaves_nothing(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    before = _host_network()
    result = run_lab(
        [str(script), str(tmp_path / "out.pt")],
        nodes=2,
        rate="1gbit",
        timeout=240,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    logs = {node.node: Path(node.log).read_text()[-2000:] for node in result.node_results}
    assert result.ok, logs
    assert _host_network() == before  # no namespace, veth or bridge left on the host
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    for node in result.node_results:
        # Every node's link carried at least the bytes the strategy says it handed to its collectives.
        assert node.bytes_sent >= out["comm_bytes"] > 0, (node, out["comm_bytes"])
    leftover = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout
    assert leftover == ""


def test_ending_the_nodes_removes_the_launch_folders_their_killed_launchers_left(tmp_path):
    """A node's launcher SIGKILLed after the grace cannot remove its /tmp/syncline-launch-<pid>-... folder; ending the
    nodes removes every launch folder whose launcher is gone, and keeps those of launchers still running."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = Path(tempfile.gettempdir())
    dead = tmp / f"{LAUNCH_DIR_PREFIX}{gone.pid}-live-{tmp_path.name}"
    alive = tmp / f"{LAUNCH_DIR_PREFIX}{os.getpid()}-live-{tmp_path.name}"
    for folder in (dead, alive):
        (folder / "logs-0").mkdir(parents=True)
        (folder / "payload.pkl").write_bytes(b"x")
    try:
        end_nodes([])  # no namespace to end: only the folders are looked at
        assert not dead.exists() and alive.is_dir()
    finally:
        for folder in (dead, alive):
            shutil.rmtree(folder, ignore_errors=True)
