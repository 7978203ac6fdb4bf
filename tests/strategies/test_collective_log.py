"""A collective timeout names the rank, the strategy, the collective and where the ranks' sequences diverge."""

from __future__ import annotations

import time

import torch
from torch import nn

from syncline.strategies.comm.collective_log import CollectiveLog, first_divergence
from syncline.testing import run_ranks


def _mismatched(rank, world_size, extra_on_rank):
    from syncline.strategies import BucketedDDP

    strategy = BucketedDDP(timeout=3.0)
    strategy.setup_environment()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    strategy.setup(model)
    for step in range(3):
        if rank == extra_on_rank and step == 1:
            # The bug under test: a metric only this rank reduces (of the bucket's size, so gloo pairs it with
            # the other rank's bucket instead of aborting, and every later collective is off by one).
            strategy.reduce(torch.ones(10), "sum")
        strategy.backward(model(torch.ones(2, 4)).sum(), sync=True)
    strategy.barrier()


def test_mismatched_collectives_are_diagnosed_on_every_rank():
    start = time.monotonic()
    outcomes = run_ranks(_mismatched, 2, args=(1,), timeout=60)
    assert time.monotonic() - start < 30  # a 3 s timeout, a wait of at most 3 s for the other rank's log
    expected = (
        "The ranks' collectives diverge at collective #{}: rank 0: allreduce_hook of gradient bucket 0 of step 2; "
        "rank 1: all-reduce (sum) of a (10,) torch.float32 tensor (Strategy.reduce)."
    )
    for outcome, collective in zip(outcomes, ["barrier (Strategy.barrier)", "allreduce_hook of gradient bucket 0"]):
        assert outcome.error is not None, f"rank {outcome.rank} did not fail"
        message = outcome.error.strip().splitlines()[-1]
        assert message.startswith(
            f"syncline.strategies.comm.reducer_errors.CollectiveError: Rank {outcome.rank}: {collective}"
        )
        assert "Strategy 'bucketed_ddp'." in message
        number = message.split("diverge at collective #")[1].split(":")[0]
        assert expected.format(number) in message


def test_first_divergence_aligns_by_number_across_rings():
    log = CollectiveLog(capacity=3)
    for what in ["a", "b", "c", "d"]:
        log.record(what)
    assert list(log.entries) == [(1, "b"), (2, "c"), (3, "d")]
    same = {0: list(log.entries), 1: [(2, "c"), (3, "d")]}
    assert first_divergence(same) is None
    assert first_divergence({0: [(2, "c"), (3, "d")], 1: [(2, "c"), (3, "x"), (4, "y")]}) == (3, {0: "d", 1: "x"})
    assert first_divergence({0: [(2, "c")], 1: [(2, "c"), (3, "x")]}) == (
        3,
        {0: "nothing (its log ends before)", 1: "x"},
    )


def test_the_message_naming_a_failed_collective_keeps_only_the_first_line_of_torchs_error():
    """gloo's and torch's texts may end in a line break or go on with a C++ trace: the message stays one line."""
    from syncline.strategies.comm.reducer_errors import first_line

    assert first_line(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:5\n")) == (
        "[pair.cc:534] Connection closed by peer [127.0.0.1]:5"
    )
    assert first_line(RuntimeError("Timed out\nException raised from wait at Work.cpp:12")) == "Timed out"
    assert first_line(RuntimeError("")) == "RuntimeError"
