"""native_ddp with torch's PowerSGD hook and post-local SGD: they train, count their bytes, and resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from syncline.options import OptionError
from syncline.strategies import NativeDDP
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


def _fit(options: dict[str, Any], max_steps: int, tmp: str, ckpt_path: str | None = None, seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    task = Regressor(optimizer="adam", lr=0.02)
    trainer = Trainer(max_steps=max_steps, strategy=NativeDDP(**options), **quiet(default_root_dir=tmp, seed=0))
    trainer.fit(task, loader(regression_data(64), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return trainer


def _runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    x, y = regression_data(64).tensors
    out: dict[str, Any] = {}
    for name, options in {
        "powersgd": {"comm_hook": "powersgd", "powersgd_rank": 1, "start_iter": 2},
        "post_local_sgd": {"comm_hook": "post_local_sgd", "averaging_period": 3},
    }.items():
        straight = _fit(options, 7, f"{tmp}/{name}")
        bytes_by_step = straight.strategy.comm_counter.total_bytes
        first = _fit(options, 4, f"{tmp}/{name}")
        first.save_checkpoint(f"{tmp}/{name}/mid.ckpt")
        resumed = _fit(options, 7, f"{tmp}/{name}", ckpt_path=f"{tmp}/{name}/mid.ckpt", seed=1)
        with torch.no_grad():
            loss = nn.functional.mse_loss(straight.task(x), y).item()
        out[name] = {
            "loss": loss,
            "total_bytes": bytes_by_step,
            "weights": {k: v.clone() for k, v in straight.task.state_dict().items()},
            "resumed": {k: v.clone() for k, v in resumed.task.state_dict().items()},
        }
    return out


def test_torchs_relaxations_train_count_their_bytes_and_resume_exactly(tmp_path):
    results = run_distributed(_runs, world_size=2, args=(str(tmp_path),), timeout=240)
    params = 8 * 16 + 16 + 16 + 1
    for rank in (0, 1):
        # Post-local SGD resumes bit-exactly; torch's PowerSGD resumes its stage with fresh memories.
        run = results[rank]["post_local_sgd"]
        for key, value in run["weights"].items():
            assert torch.equal(run["resumed"][key], value), (rank, key)
        resumed, straight = results[rank]["powersgd"]["resumed"], results[rank]["powersgd"]["weights"]
        torch.testing.assert_close(resumed["net.0.weight"], straight["net.0.weight"], atol=0.05, rtol=0)
    powersgd, local = results[0]["powersgd"], results[0]["post_local_sgd"]
    # Two exact steps, then rank-1 factors of the 16x8 weight (16 + 8 values); the 1x16 weight (which a rank-1
    # factorization would not shrink) and the biases (16 + 1) are sent whole.
    assert powersgd["total_bytes"] == 4 * (2 * params + 5 * (16 + 8 + 16 + 16 + 1))
    assert powersgd["weights"]["net.0.weight"].equal(results[1]["powersgd"]["weights"]["net.0.weight"])
    # Post-local SGD sends nothing but the parameters, after steps 1, 4 and 7: the replicas agree after step 7.
    assert local["total_bytes"] == 3 * 4 * params
    assert local["weights"]["net.0.weight"].equal(results[1]["post_local_sgd"]["weights"]["net.0.weight"])


def test_bad_hooks_and_too_short_a_start_are_refused():
    with pytest.raises(OptionError, match="comm_hook='fp16'"):
        NativeDDP(comm_hook="fp16")
    with pytest.raises(OptionError, match="start_iter"):
        NativeDDP(comm_hook="powersgd", start_iter=1)
    assert NativeDDP(comm_hook="post_local_sgd").replicas_differ and not NativeDDP().replicas_differ
    assert "comm_hook='powersgd'" in NativeDDP(comm_hook="powersgd").manual_optimization_refused
