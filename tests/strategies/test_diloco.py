"""DiLoCo and streaming DiLoCo against data parallel, local SGD and the papers' algorithm boxes, in real gloo processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _averaging import PlainSGD, fit, flat_params, model_bytes, straight_and_resumed
from torch import nn

from syncline.options import OptionError
from syncline.strategies import BucketedDDP, DiLoCo, LocalSGD
from syncline.strategies.comm.ranks import run_distributed
from tests.trainer._tasks import Regressor, regression_data

#: How the strategy cuts the shared regressor (weights 128, 16, 16, 1 values) into two fragments of about equal size.
TWO_FRAGMENTS = [[0], [1, 2, 3]]


def _equivalences(rank: int, world_size: int) -> dict[str, Any]:
    _, ddp = fit(BucketedDDP(), PlainSGD, max_steps=16)
    _, every = fit(DiLoCo(period=1, outer_lr=1.0, outer_momentum=0.0), PlainSGD, max_steps=16)
    _, local = fit(LocalSGD(period=4), max_steps=14)
    diloco, delayed = fit(DiLoCo(period=4, outer_lr=1.0, outer_momentum=0.0), max_steps=14)
    streaming, _ = fit(DiLoCo(period=4, fragments=2, overlap_steps=0, outer_lr=1.0, outer_momentum=0.0), max_steps=14)
    return {
        "ddp": flat_params(ddp),
        "every": flat_params(every),
        "local": flat_params(local),
        "delayed": flat_params(delayed),
        "bytes": diloco.strategy.communication_stats()["comm/total_bytes"],
        "streaming_bytes": streaming.strategy.communication_stats()["comm/total_bytes"],
        "model_bytes": model_bytes(delayed),
    }


def test_period_one_is_data_parallel_and_outer_sgd_at_rate_one_is_local_sgd():
    ranks = run_distributed(_equivalences, world_size=2, timeout=120)
    for result in ranks:
        # Plain SGD: the mean weight delta of one inner step is the learning rate times the mean gradient.
        torch.testing.assert_close(result["every"], result["ddp"], rtol=1e-5, atol=1e-5)
        # Outer SGD at rate 1 without momentum replaces the weights by the mean of the replicas (momentum SGD inside,
        # each rank's own), after local steps 4, 8, 12 as local SGD; steps 13-14 are local in both.
        torch.testing.assert_close(result["delayed"], result["local"], rtol=1e-5, atol=1e-5)
        assert result["bytes"] == 3 * result["model_bytes"]
        # Fragments exchanged at offsets 0 and 2 of 4: after steps 2 and 6, 10, 14 (fragment 1), 4, 8, 12 (fragment 0).
        assert result["streaming_bytes"] == 3 * 128 * 4 + 4 * 33 * 4
    torch.testing.assert_close(ranks[0]["every"], ranks[1]["every"], rtol=0, atol=0)
