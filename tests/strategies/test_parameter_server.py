"""ParameterServer and ShardedParameterServer against BucketedDDP, in real gloo processes (2 ranks).

Exactness: the same parameters as BucketedDDP (atol 1e-5) with SGD+momentum and Adam, accumulation and
clipping; where the optimizer state lives; bytes per step; a loss scaler skipping alike on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.options import OptionError
from syncline.strategies import BucketedDDP, ParameterServer, ShardedParameterServer
from syncline.testing import run_distributed

STEPS, ACCUMULATE, MAX_NORM = 4, 2, 0.5
# Small buckets, so a parameter can straddle two ranks' chunks and there are several collectives.
CAP_MB = 0.0003


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        # Two param groups: the second's learning rate follows a scheduler.
        weights = [p for p in model.parameters() if p.dim() > 1]
        biases = [p for p in model.parameters() if p.dim() == 1]
        return torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 0.05}], lr=0.02, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(strategy, kind: str, rank: int, scaler=None, poison=None):
    model = _model()
    strategy.setup_environment()
    strategy.setup(model)
    optimizer = _optimizer(kind, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    strategy.setup_optimizer(optimizer)
    generator = torch.Generator().manual_seed(rank)
    target = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))
    scales = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x = torch.randn(6, 8, generator=generator)
            loss = nn.functional.mse_loss(model(x), x @ target) / ACCUMULATE
            handle = poison(model) if poison is not None and step == 1 else None
            sync = micro == ACCUMULATE - 1
            strategy.backward(scaler.scale(loss) if scaler else loss, sync=sync)
            if handle is not None:
                handle.remove()
        if scaler:
            scaler.unscale_(optimizer)
        strategy.clip_gradients(list(model.parameters()), MAX_NORM)
        if scaler:
            strategy.optimizer_step(optimizer, lambda: (scaler.step(optimizer), scaler.update()))
            scales.append(scaler.get_scale())
        else:
            strategy.optimizer_step(optimizer, optimizer.step)
        strategy.zero_grad(optimizer)
        scheduler.step()
    params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    state_numel = sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return params, state_numel, strategy, scales


def _inf_in_rank_one_chunk(strategy):
    """Return a poison that puts an inf into one gradient element that rank 1 serves (or anywhere for a server)."""

    def poison(model: nn.Module):
        if torch.distributed.get_rank() != 1:
            return None
        if isinstance(strategy, ShardedParameterServer):
            piece = next(s for slices in strategy._slices.values() for s in slices)
            param, index = piece.param, piece.start
        else:
            param, index = next(model.parameters()), 0

        def hook(grad):
            grad = grad.clone()
            grad.view(-1)[index] = float("inf")
            return grad

        return param.register_hook(hook)

    return poison


def _everything(rank: int, world_size: int) -> dict:
    out = {}
    model_bytes = sum(p.numel() * 4 for p in _model().parameters())
    for kind in ("sgd", "adam"):
        reference, full_state, _, _ = _train(BucketedDDP(bucket_cap_mb=CAP_MB), kind, rank)
        server, server_state, ps, _ = _train(ParameterServer(server_rank=1, bucket_cap_mb=CAP_MB), kind, rank)
        sharded, sharded_state, sps, _ = _train(ShardedParameterServer(bucket_cap_mb=CAP_MB), kind, rank)
        buckets = [b.buffer.numel() for b in sps.reducer.buckets]
        out[kind] = {
            "reference": reference,
            "server": server,
            "sharded": sharded,
            "state_fraction": {"server": server_state / full_state, "sharded": sharded_state / full_state},
            "bytes": {
                "server": ps.communication_stats()["comm/bytes"],
                "sharded": sps.communication_stats()["comm/bytes"],
            },
            "buckets": buckets,
        }
    out["model_bytes"] = model_bytes
    for name, make in (("server", ParameterServer), ("sharded", ShardedParameterServer)):
        strategy = make(bucket_cap_mb=CAP_MB)
        # One scaler per rank, as the Trainer has: rank 1's gradient gets an inf at step 1.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        params, _, _, scales = _train(strategy, "sgd", rank, scaler=scaler, poison=_inf_in_rank_one_chunk(strategy))
        clean_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        clean, _, _, clean_scales = _train(make(bucket_cap_mb=CAP_MB), "sgd", rank, clean_scaler)
        out[f"scaler_{name}"] = {"params": params, "scales": scales, "clean": clean, "clean_scales": clean_scales}
    return out


def test_both_servers_match_bucketed_ddp_hold_their_share_of_state_count_bytes_and_skip_inf_steps_alike():
    ranks = run_distributed(_everything, world_size=2, timeout=90)
    for rank, result in enumerate(ranks):
        for kind in ("sgd", "adam"):
            runs = result[kind]
            # Accumulation over 2 micro-batches, clipping to 0.5 and a halving learning rate, every step.
            torch.testing.assert_close(runs["server"], runs["reference"], atol=1e-5, rtol=0)
            torch.testing.assert_close(runs["sharded"], runs["reference"], atol=1e-5, rtol=0)
            assert not torch.allclose(runs["reference"], _model_params(), atol=1e-3)  # training moved them
            # The server (rank 1) holds all the state, the worker none; each shard about half.
            assert runs["state_fraction"]["server"] == (1.0 if rank == 1 else 0.0)
            assert 0.4 <= runs["state_fraction"]["sharded"] <= 0.6
            # Server: a worker sends every gradient to the server; every rank takes part in the broadcast of
            # the parameters; + a 4-byte flag.
            sent_gradients = result["model_bytes"] if rank == 0 else 0
            assert runs["bytes"]["server"] == sent_gradients + result["model_bytes"] + 4
            # Sharded: the other rank's chunk of every (padded) bucket (the scatter), this rank's chunk of each
            # (the all-gather), the finiteness flag and the squared norm for clipping.
            padded = sum(-(-n // 2) * 2 for n in runs["buckets"])
            assert len(runs["buckets"]) > 1
            assert runs["bytes"]["sharded"] == 4 * padded // 2 + 4 * padded // 2 + 4 + 4
        for name in ("server", "sharded"):
            run = result[f"scaler_{name}"]
            # Step 1 skipped on both ranks: the scale halves once, and the parameters differ from a clean run.
            assert run["scales"] == [1024.0, 512.0, 512.0, 512.0], run["scales"]
            assert run["clean_scales"] == [1024.0] * 4
            assert not torch.allclose(run["params"], run["clean"])
    for key in ("server", "sharded"):
        for kind in ("sgd", "adam"):
            assert torch.equal(ranks[0][kind][key], ranks[1][kind][key])
        assert torch.equal(ranks[0][f"scaler_{key}"]["params"], ranks[1][f"scaler_{key}"]["params"])


def _model_params() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _model().parameters()])


def test_bad_options_and_optimizers_fail_early_with_the_fix():
    with pytest.raises(OptionError, match="server_rank must be an int >= 0"):
        ParameterServer(server_rank=-1)
    with pytest.raises(ValueError, match=r"server_rank=1\) needs at least 2 processes.*the job has 1"):
        ParameterServer(server_rank=1).setup(_model())
    lbfgs = torch.optim.LBFGS(_model().parameters())
    with pytest.raises(TypeError, match="elementwise.*torch.optim.lbfgs.LBFGS.*strategy=parameter_server"):
        ShardedParameterServer().setup_optimizer(lbfgs)
