"""The compression family through the Trainer: learns like bucketed_ddp, resumes bit-exactly per rank."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from syncline.strategies import BucketedDDP, ByteGrad, PowerSGD, QAdam
from syncline.testing import run_distributed, run_ranks
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

STRATEGIES = {
    "bucketed_ddp": BucketedDDP,
    "bf16": lambda: BucketedDDP(comm_hook="bf16"),
    "bytegrad": ByteGrad,
    "powersgd": lambda: PowerSGD(rank=2, start_iter=2),
    "qadam": lambda: QAdam(warmup_steps=3),
}


def _learn(rank: int, world_size: int) -> dict[str, Any]:
    data = regression_data(256)
    results = {}
    for name, make in STRATEGIES.items():
        torch.manual_seed(0)
        task = Regressor(optimizer="adam", lr=0.05)
        x, y = data.tensors
        with torch.no_grad():
            initial = nn.functional.mse_loss(task(x), y).item()
        trainer = Trainer(
            max_steps=30,
            strategy=make(),
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
            precision="bf16-mixed",
            **quiet(seed=0),
        )
        trainer.fit(task, loader(data, batch_size=8, shuffle=True))
        with torch.no_grad():
            loss = nn.functional.mse_loss(task(x), y).item()
        results[name] = {"initial": initial, "loss": loss, **trainer.strategy.communication_stats()}
    return results


def test_every_strategy_learns_like_bucketed_ddp_with_accumulation_clipping_and_bf16():
    results = run_distributed(_learn, world_size=2, timeout=180)
    reference = results[0]["bucketed_ddp"]["loss"]
    assert reference < results[0]["bucketed_ddp"]["initial"] / 4
    for name, result in results[0].items():
        assert result["loss"] == results[1][name]["loss"]  # replicas agree
        assert result["loss"] <= 1.25 * reference, (name, result["loss"], reference)
        assert result["comm/total_bytes"] > 0 and result["comm/bytes"] > 0, name


RESUMABLE = {
    "bytegrad": ByteGrad,
    "powersgd": lambda: PowerSGD(rank=2, start_iter=1),
    "qadam": lambda: QAdam(warmup_steps=2),
}


def _fit(name: str, tmp: str, max_steps: int, ckpt_path: str | None = None, seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    task = Regressor(optimizer="adam", lr=0.02)
    trainer = Trainer(max_steps=max_steps, strategy=RESUMABLE[name](), **quiet(default_root_dir=tmp, seed=0))
    trainer.fit(task, loader(regression_data(64), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return trainer


def _straight_and_resumed(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    results = {}
    for name in RESUMABLE:
        straight = _fit(name, f"{tmp}/{name}", 6)
        first = _fit(name, f"{tmp}/{name}", 3)
        first.save_checkpoint(f"{tmp}/{name}/mid.ckpt")
        # Other initial weights: only the checkpoint can make the result equal.
        resumed = _fit(name, f"{tmp}/{name}", 6, ckpt_path=f"{tmp}/{name}/mid.ckpt", seed=1)
        results[name] = {
            run: {
                "weights": {k: v.clone() for k, v in trainer.task.state_dict().items()},
                "strategy": trainer.strategy.state_dict(),
            }
            for run, trainer in (("straight", straight), ("resumed", resumed))
        }
    return results


def _resume_alone(rank: int, world_size: int, path: str) -> None:
    _fit("bytegrad", str(path).rsplit("/", 1)[0], 6, ckpt_path=path)


def test_resume_is_bit_exact_with_every_ranks_error_feedback_factors_and_frozen_variance(tmp_path):
    results = run_distributed(_straight_and_resumed, world_size=2, args=(str(tmp_path),), timeout=180)
    for name in RESUMABLE:
        saved = torch.load(tmp_path / name / "mid.ckpt", weights_only=True)["strategy"]["by_rank"]
        memories = [state["error_feedback"] for state in saved]
        # The ranks' memories differ, so rank 0's alone could not have restored rank 1.
        assert memories[0] and any(not torch.equal(memories[0][k], memories[1][k]) for k in memories[0]), name
        for rank in (0, 1):
            straight, resumed = results[rank][name]["straight"], results[rank][name]["resumed"]
            for key, value in straight["weights"].items():
                assert torch.equal(resumed["weights"][key], value), (name, rank, key)
            for key, value in straight["strategy"]["error_feedback"].items():
                assert torch.equal(resumed["strategy"]["error_feedback"][key], value), (name, rank, key)
    factors = results[1]["powersgd"]
    assert factors["straight"]["strategy"]["factors"].keys() == factors["resumed"]["strategy"]["factors"].keys()
    # Another world size is refused, naming the strategy.
    outcome = run_ranks(_resume_alone, world_size=1, args=(str(tmp_path / "bytegrad" / "mid.ckpt"),), timeout=60)[0]
    assert outcome.error is not None and "ByteGrad keeps per-rank state" in outcome.error
