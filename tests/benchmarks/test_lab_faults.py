"""Faults between two lab nodes end the whole job in bounded time, leaving nothing listening (issue 25).

A permanent partition with a 5 s collective timeout: the first rank to notice ends within timeout + 10 s
and the last process of the job within timeout + 20 s. A rank stuck in compute after its peer raised, and
a SIGKILLed torchrun agent, end the job within seconds (the latter after saving ``last.ckpt``).
"""

from __future__ import annotations

import pytest

from benchmarks.lab.cluster import namespaces_unavailable
from benchmarks.lab.faults import run

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))

TIMEOUT_S = 5.0


def test_a_permanent_partition_ends_every_process_within_the_timeout_plus_20_s():
    (record,) = run(["bucketed_ddp"], ["partition"], TIMEOUT_S, out=None)
    assert not record["hung"], record["log_tail"]
    ended = record["ended_s"]
    assert min(ended["worker0"], ended["worker1"]) <= TIMEOUT_S + 10, ended
    assert record["last_gone_s"] <= TIMEOUT_S + 20, ended
    assert "CollectiveError" in record["raised"]["node0"], record["raised"]
    assert record["listening_after"] == {"node0": [], "node1": []}


def test_a_stuck_rank_and_a_killed_agent_end_the_job_in_seconds():
    stuck, killed = run(["tensor_fusion"], ["stuck", "caller_killed"], TIMEOUT_S, out=None)
    assert not stuck["hung"] and stuck["last_gone_s"] < 10, stuck["log_tail"]
    assert not killed["hung"] and killed["last_gone_s"] < 15, killed["log_tail"]
    assert killed["last_ckpt"]
    for record in (stuck, killed):
        assert record["listening_after"] == {"node0": [], "node1": []}
