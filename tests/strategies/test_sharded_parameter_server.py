"""Checkpoints and precision of the two parameter servers, through the Trainer, in real gloo processes.

A checkpoint holds the whole optimizer state as one ordinary `state_dict`, whichever rank serves it and
however it is sharded: a run resumes bit-exactly on as many processes, and on another number of processes
(2 to 1, 1 to 2, same global batch) equal to the uninterrupted run within 1e-5.
"""

from __future__ import annotations

import torch

from syncline.strategies import BucketedDDP, ParameterServer, ShardedParameterServer
from syncline.strategies.comm.ranks import run_distributed
from syncline.trainer import Trainer
from syncline.trainer.checkpoint import load_checkpoint
from tests.strategies._averaging import fit, flat_params, straight_and_resumed
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

GLOBAL_BATCH = 8  # 64 samples: 8 steps an epoch, so step 8 is an epoch boundary


def _server_one() -> ParameterServer:
    return ParameterServer(server_rank=1)


def _adam_fit(strategy, world_size: int, max_steps: int, ckpt_path=None, save=None) -> torch.Tensor:
    """Fit Adam with clipping, the same global batch on any number of processes (unshuffled: same samples)."""
    torch.manual_seed(0)
    task = Regressor(lr=0.05, optimizer="adam")
    trainer = Trainer(strategy=strategy, max_steps=max_steps, num_sanity_val_steps=0, gradient_clip_val=0.5, **quiet())
    trainer.fit(task, loader(regression_data(64), GLOBAL_BATCH // world_size), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return flat_params(task)


def _on_two(rank: int, world_size: int, tmp: str) -> dict:
    out = {
        "sharded": straight_and_resumed(rank, world_size, f"{tmp}/sharded", ShardedParameterServer, 5, 11),
        "server": straight_and_resumed(rank, world_size, f"{tmp}/server", _server_one, 5, 11),
    }
    for name, make in (("ddp", BucketedDDP), ("server", ParameterServer), ("sharded", ShardedParameterServer)):
        _, task = fit(make(), max_steps=6, precision="bf16-mixed")
        out[f"bf16_{name}"] = flat_params(task)
    out["straight"] = _adam_fit(ShardedParameterServer(), world_size, 12)
    _adam_fit(ShardedParameterServer(), world_size, 8, save=f"{tmp}/two.ckpt")
    return out


def _on_one(rank: int, world_size: int, tmp: str) -> dict:
    resumed = _adam_fit(ShardedParameterServer(), world_size, 12, ckpt_path=f"{tmp}/two.ckpt")
    _adam_fit(ShardedParameterServer(), world_size, 8, save=f"{tmp}/one.ckpt")
    return {"two_to_one": resumed}


def _back_on_two(rank: int, world_size: int, tmp: str) -> torch.Tensor:
    return _adam_fit(ShardedParameterServer(), world_size, 12, ckpt_path=f"{tmp}/one.ckpt")


def test_resume_is_bit_exact_on_as_many_processes_and_exact_to_1e_5_on_another_number(tmp_path):
    two = run_distributed(_on_two, 2, args=(str(tmp_path),), timeout=120)
    for rank in two:
        for name in ("sharded", "server"):
            runs = rank[name]
            assert torch.equal(runs["resumed"]["weights"], runs["straight"]["weights"]), name
        for name in ("server", "sharded"):
            torch.testing.assert_close(rank[f"bf16_{name}"], rank["bf16_ddp"], atol=1e-5, rtol=0)
    # The checkpoint of a sharded run is an ordinary optimizer state: every parameter's moments, whole.
    saved = load_checkpoint(tmp_path / "two.ckpt")
    optimizer = saved["optimizer"]["optimizer"]
    shapes = [tuple(value.shape) for value in saved["state_dict"].values()]
    assert [tuple(optimizer["state"][i]["exp_avg"].shape) for i in range(len(shapes))] == shapes
    [one] = run_distributed(_on_one, 1, args=(str(tmp_path),), timeout=60)
    torch.testing.assert_close(one["two_to_one"], two[0]["straight"], atol=1e-5, rtol=0)
    back = run_distributed(_back_on_two, 2, args=(str(tmp_path),), timeout=60)
    torch.testing.assert_close(back[0], two[0]["straight"], atol=1e-5, rtol=0)
    assert torch.equal(back[0], back[1])
