"""CommunicationTimeline in a real 2-rank gloo run: one Chrome trace, every rank's steps and buckets in it."""

from __future__ import annotations

import json

import torch

from syncline.callbacks import CommunicationTimeline
from syncline.strategies import BucketedDDP, LocalSGD
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

BUCKETS = 4  # cap 0: each of the regressor's 4 parameters in a bucket of its own
RECORDED = 3
EPS = 0.01  # microseconds: times are written rounded to a nanosecond


def _fit_with_timeline(strategy, path: str) -> CommunicationTimeline:
    torch.manual_seed(0)
    timeline = CommunicationTimeline(path=path, start_step=1, num_steps=RECORDED)
    trainer = Trainer(strategy=strategy, callbacks=[timeline], **quiet(max_steps=6, num_sanity_val_steps=0))
    trainer.fit(Regressor(lr=0.05), loader(regression_data(64), 4))
    return timeline


def _traces(rank, world_size, tmp):
    ddp = _fit_with_timeline(BucketedDDP(bucket_cap_mb=0, first_bucket_mb=0), f"{tmp}/ddp.json")
    local = _fit_with_timeline(LocalSGD(period=1), f"{tmp}/local_sgd.json")
    return {"written": [ddp.written, local.written]}


def _spans(trace, pid, name=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and name in (None, e["name"])]


def test_the_trace_holds_every_ranks_steps_buckets_and_exposed_wait(tmp_path):
    ranks = run_distributed(_traces, world_size=2, args=(str(tmp_path),), timeout=120)
    # Rank 0 writes; the other ranks only send their spans.
    assert ranks[0]["written"] == [str(tmp_path / "ddp.json"), str(tmp_path / "local_sgd.json")]
    assert ranks[1]["written"] == [None, None]
    trace = json.loads((tmp_path / "ddp.json").read_text())
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    for rank in (0, 1):
        spans = _spans(trace, rank)
        # Only the recorded steps (1, 2, 3), each with forward, backward, exposed wait and optimizer step.
        assert {e["args"]["step"] for e in spans} == {1, 2, 3}
        for step in (1, 2, 3):
            of_step = [e for e in spans if e["args"]["step"] == step]
            by_name = {e["name"]: e for e in of_step}
            assert {"forward", "backward", "exposed wait", "optimizer step"} <= set(by_name)
            backward, wait = by_name["backward"], by_name["exposed wait"]
            # The exposed wait is the end of the backward: it nests inside it on the step lane.
            assert lanes[backward["tid"]] == lanes[wait["tid"]] == "step"
            assert backward["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= backward["ts"] + backward["dur"] + EPS
            assert by_name["forward"]["ts"] + by_name["forward"]["dur"] <= backward["ts"] + EPS
            # Every bucket once: launched during the backward, completed no earlier than launched.
            buckets = [e for e in of_step if e["cat"] == "bucket"]
            assert sorted(e["name"] for e in buckets) == [f"bucket {i}" for i in range(BUCKETS)]
            for bucket in buckets:
                assert lanes[bucket["tid"]] == bucket["name"]
                assert backward["ts"] <= bucket["ts"] <= wait["ts"] + wait["dur"] + EPS and bucket["dur"] >= 0
                assert bucket["args"]["bytes"] > 0
    # Local SGD has no buckets after its (empty) warm-up, but its model averaging is a collective span.
    local = json.loads((tmp_path / "local_sgd.json").read_text())
    for rank in (0, 1):
        averaging = _spans(local, rank, "model averaging")
        assert sorted(e["args"]["step"] for e in averaging) == [1, 2, 3]
        assert not [e for e in _spans(local, rank) if e["cat"] == "bucket"]
