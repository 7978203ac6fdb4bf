"""Faults between two lab nodes end the whole job in bounded time, leaving nothing listening.

One lab, two torchrun jobs with a 5 s collective timeout. A permanent partition: the first rank to notice
ends within timeout + 10 s and the last process of the job within timeout + 20 s. A rank stuck in compute
on one node when the rank on the other node raises: it is given the one grace period every rank gets when
the job is over (`SYNCLINE_GRACE_S`, 3 s here instead of the default 30 s) and the job ends within it.
(A killed agent is timed by `python -m syncline.lab faults` and, with `devices=2`, by
tests/strategies/test_worker_guard.py.)

Under `recovery="live"` on three nodes (one launcher per node), a node whose every process is SIGKILLed mid-epoch
leaves the other two training, and the node started again joins them live; node 0 killed (its launcher hosts the
run's store) ends every other node with one message naming the store. (A node cut off, its connections open, is
dropped by its keep-alives stopping: here by `python -m syncline.lab live-recovery --cases node_cut`, in the suite by
tests/trainer/test_live_recovery.py's frozen member, whose connections stay open too.)
"""

from __future__ import annotations

import pytest

from syncline.lab.cluster import namespaces_unavailable
from syncline.lab.faults import run
from syncline.lab.live_recovery import run_cell

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))

TIMEOUT_S = 5.0


GRACE_S = 3.0


def test_a_partition_and_a_stuck_rank_end_every_process_in_bounded_time(monkeypatch):
    monkeypatch.setenv("SYNCLINE_GRACE_S", str(GRACE_S))  # every node inherits the caller's environment
    partition, stuck = run(["tensor_fusion"], ["partition", "stuck"], TIMEOUT_S, out=None)
    assert not partition["hung"], partition["log_tail"]
    ended = partition["ended_s"]
    assert min(ended["worker0"], ended["worker1"]) <= TIMEOUT_S + 10, ended
    assert partition["last_gone_s"] <= TIMEOUT_S + 20, ended
    assert "CollectiveError" in partition["raised"]["node0"], partition["raised"]
    assert not stuck["hung"] and stuck["last_gone_s"] < GRACE_S + 7, stuck["log_tail"]
    assert "boom on rank 0" in stuck["raised"]["node0"]
    for record in (partition, stuck):
        assert record["listening_after"] == {"node0": [], "node1": []}


def test_live_recovery_a_node_lost_leaves_the_others_training_and_the_node_started_again_joins_live():
    lost, store_host = run_cell(3, None, ["node_lost", "store_host_lost"], step_s=0.1, batches=20, kill_at=5)
    assert not lost["hung"] and lost["codes"] == [0, 0, 0], lost["log_tail"]
    assert lost["worlds"] == [3, 2, 3], "3 nodes, then 2 after the loss, then 3 with the node back"
    assert lost["seconds_lost"] is not None and len(lost["replacement_first_step_s"]) == 1, lost
    # Node 0 hosts the store: without it no round can form, and every other node ends, naming it.
    assert not store_host["hung"] and store_host["codes"][1:] == [1, 1], store_host["log_tail"]
    for node in ("node1", "node2"):
        assert (
            "The live run's store at 10.77.0.1:29500, hosted by node 0's launcher, is gone"
            in (store_host["log_tail"][node])
        )
