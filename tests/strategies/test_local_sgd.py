"""LocalSGD (post-local SGD) against BucketedDDP, in real gloo processes."""

from __future__ import annotations

import pytest
import torch
from _averaging import PlainSGD, fit, flat_params, model_bytes, straight_and_resumed

from syncline.options import OptionError
from syncline.strategies import BucketedDDP, LocalSGD
from syncline.testing import run_distributed, run_ranks


def _period_one_and_bytes(rank, world_size):
    ddp, ddp_task = fit(BucketedDDP(), PlainSGD, max_steps=16)
    # BucketedDDP all-reduces every gradient once per step, in the parameters' dtype.
    ddp_step_bytes = model_bytes(ddp_task)
    every, every_task = fit(LocalSGD(period=1), PlainSGD, max_steps=16)
    delayed, delayed_task = fit(LocalSGD(period=4, warmup_steps=2), max_steps=16)
    return {
        "ddp": flat_params(ddp_task),
        "every": flat_params(every_task),
        "ddp_total": ddp_step_bytes * 16,
        "every_stats": every.strategy.communication_stats(),
        "delayed_stats": delayed.strategy.communication_stats(),
        "ddp_step_bytes": ddp_step_bytes,
        "model_bytes": model_bytes(delayed_task),
    }


def test_period_one_is_data_parallel_and_period_four_sends_a_third_of_the_bytes():
    ranks = run_distributed(_period_one_and_bytes, world_size=2, timeout=120)
    for result in ranks:
        # Plain SGD: averaging the parameters after each step is averaging the gradients before it.
        torch.testing.assert_close(result["every"], result["ddp"], rtol=1e-5, atol=1e-5)
        assert result["every_stats"]["comm/total_bytes"] == 16 * result["model_bytes"]
        # Warm-up: 2 gradient all-reduces; then 14 local steps, averaged after local steps 4, 8, 12.
        delayed = result["delayed_stats"]["comm/total_bytes"]
        assert delayed == 2 * result["ddp_step_bytes"] + 3 * result["model_bytes"]
        assert delayed <= 0.35 * result["ddp_total"]
    torch.testing.assert_close(ranks[0]["every"], ranks[1]["every"], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 0}, "LocalSGD(period=0): period must be an int >= 1"),
        ({"warmup_steps": -1}, "LocalSGD(warmup_steps=-1): warmup_steps must be an int >= 0"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LocalSGD(**kwargs)


def _local_sgd():
    return LocalSGD(period=4, warmup_steps=2)


def test_resume_in_the_middle_of_a_period_is_bit_exact_on_every_rank(tmp_path):
    # Stopped after step 5: local step 3 of the first period, the replicas differ.
    ranks = run_distributed(straight_and_resumed, 2, args=(str(tmp_path), _local_sgd, 5, 11), timeout=120)
    assert not torch.equal(ranks[0]["at_checkpoint"], ranks[1]["at_checkpoint"])
    for runs in ranks:
        assert torch.equal(runs["resumed"]["weights"], runs["straight"]["weights"])
        assert runs["resumed"]["state"] == runs["straight"]["state"]


def _resume_on_one(rank, world_size, path):
    fit(_local_sgd(), max_steps=8, ckpt_path=path)


def test_resume_on_another_world_size_names_the_strategy(tmp_path):
    run_distributed(straight_and_resumed, 2, args=(str(tmp_path), _local_sgd, 5, 6), timeout=120)
    [outcome] = run_ranks(_resume_on_one, 1, args=(str(tmp_path / "resumed" / "mid.ckpt"),), timeout=60)
    assert "LocalSGD keeps per-rank state, which cannot move from 2 to 1 processes" in outcome.error
