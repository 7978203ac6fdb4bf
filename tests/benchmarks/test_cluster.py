"""The network lab: a 2-node cluster in private namespaces runs a torchrun job and leaves nothing behind."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from benchmarks.lab.cluster import link_bound, namespaces_unavailable, parse_rate, run_lab

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
