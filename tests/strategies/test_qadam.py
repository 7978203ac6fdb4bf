"""QAdam: Adam during the warm-up exactly as bucketed_ddp; then a frozen variance and compressed momentum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.options import OptionError
from syncline.strategies import BucketedDDP, QAdam
from syncline.strategies.bytegrad import ByteGradState, bytegrad_hook
from syncline.strategies.comm.compression import ErrorFeedback, compressed_average
from syncline.testing import run_distributed

WARMUP = 4


def _train(strategy, rank: int, steps: int) -> tuple[nn.Module, torch.optim.Adam, list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    strategy.setup_environment()
    strategy.setup(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02, weight_decay=0.01)
    generator = torch.Generator().manual_seed(rank)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=generator)
        loss = nn.functional.mse_loss(model(x), x @ target)
        strategy.backward(loss, sync=True)
        strategy.optimizer_step(optimizer, optimizer.step)
        strategy.zero_grad(optimizer)
        losses.append(loss.item())
    return model, optimizer, losses


def _compare(rank: int, world_size: int) -> dict:
    reference, _, _ = _train(BucketedDDP(), rank, WARMUP)
    warm, optimizer, _ = _train(QAdam(warmup_steps=WARMUP), rank, WARMUP)
    variance = [optimizer.state[p]["exp_avg_sq"].clone() for p in warm.parameters()]
    strategy = QAdam(warmup_steps=WARMUP)
    model, optimizer, losses = _train(strategy, rank, 40)
    named = [(name, optimizer.state[p]["exp_avg"].clone()) for name, p in model.named_parameters()]
    memory = {name: strategy.error_feedback.memory[name].clone() for name, _ in named}
    # The one flat chunk of every momentum plus its memory, as QAdam sent it before its momentum went
    # through the reducer's buckets (and as a one-bucket model still sends it).
    flat = torch.cat([m.reshape(-1) + memory[name].reshape(-1) for name, m in named])
    flat_average, _ = compressed_average(flat, None, None)
    feedback = ErrorFeedback()
    feedback.load_state_dict(memory)
    strategy.reducer.average_tensors(named, bytegrad_hook, ByteGradState(error_feedback=feedback))
    # A checkpoint of that time kept the memory as one flat tensor under "momentum": it is cut per parameter.
    legacy = QAdam()
    legacy.error_feedback.memory = {"momentum": torch.cat([memory[name].reshape(-1) for name, _ in named])}
    legacy._split_legacy_memory(named)
    return {
        "flat_average": flat_average,
        "bucketed_average": torch.cat([m.reshape(-1) for _, m in named]),
        "legacy_split": all(torch.equal(legacy.error_feedback.memory[name], memory[name]) for name, _ in named),
        "reference": [p.detach().clone() for p in reference.parameters()],
        "warm": [p.detach().clone() for p in warm.parameters()],
        "variance_at_warmup": variance,
        "variance_at_end": [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
        "losses": losses,
        "bytes": strategy.communication_stats()["comm/bytes"],
    }


def test_warmup_equals_bucketed_ddp_with_adam_then_variance_freezes_and_replicas_agree():
    """Also: the momentum through one bucket is the flat one-chunk average to the bit, and a checkpoint's flat
    error-feedback memory is cut into the per-parameter memories."""
    results = run_distributed(_compare, world_size=2, timeout=90)
    for result in results:
        for got, want in zip(result["warm"], result["reference"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for frozen, at_end in zip(result["variance_at_warmup"], result["variance_at_end"]):
            assert torch.equal(frozen, at_end)
        assert result["losses"][-1] < 0.5 * result["losses"][0]
    for mine, theirs in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(mine, theirs)  # every rank applies the same averaged momentum
    assert 0 < results[0]["bytes"] < 4 * sum(p.numel() for p in results[0]["params"]) * 0.35
    for result in results:
        assert torch.equal(result["bucketed_average"], result["flat_average"])
        assert result["legacy_split"]


def test_bad_options_fail_at_construction():
    with pytest.raises(OptionError, match="warmup_steps must be an int >= 1"):
        QAdam(warmup_steps=0)


def test_an_optimizer_other_than_adam_is_refused_by_name():
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="QAdam needs the task's optimizer to be torch.optim.Adam.*torch.optim.sgd.SGD"):
        QAdam().optimizer_step(optimizer, optimizer.step)
    amsgrad = torch.optim.Adam(nn.Linear(2, 2).parameters(), amsgrad=True)
    with pytest.raises(TypeError, match="without amsgrad"):
        QAdam().optimizer_step(amsgrad, amsgrad.step)
