"""Checkpoints and precision of the two parameter servers, through the Trainer, in real gloo processes; the sharded
server's loss-scaler agreement under manual optimization.

A checkpoint holds the whole optimizer state as one ordinary `state_dict`, whichever rank serves it and
however it is sharded: a run resumes bit-exactly on as many processes, and on another number of processes
(2 to 1, 1 to 2, same global batch) equal to the uninterrupted run within 1e-5.
"""

from __future__ import annotations

import torch
from torch import nn

from syncline.checkpoint_file import load_checkpoint
from syncline.strategies import BucketedDDP, ParameterServer, ShardedParameterServer
from syncline.testing import run_distributed
from syncline.trainer import Trainer
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


def _two_scaled_optimizers(rank: int, world_size: int, poison: bool) -> dict:
    """One manual step of two optimizers (one per layer) under one CPU loss scaler; with `poison`, rank 1's slice of
    the second layer's gradient gets an inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    initial = [p.detach().clone() for p in model.parameters()]
    strategy = ShardedParameterServer(bucket_cap_mb=0.0003)  # several buckets, parameters cut between ranks
    strategy.manual_optimization = True
    strategy.setup_environment()
    strategy.setup(model)
    optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    for optimizer in optimizers:
        strategy.setup_optimizer(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handle = None
    if poison and rank == 1:
        piece = next(s for p in model[2].parameters() for s in strategy._slices.get(id(p), []))

        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad.view(-1)[piece.start] = float("inf")
            return grad

        handle = piece.param.register_hook(hook)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    strategy.backward(scaler.scale(model(x).pow(2).mean()), sync=True)
    if handle is not None:
        handle.remove()
    for optimizer in optimizers:
        strategy.optimizer_step(optimizer, lambda optimizer=optimizer: scaler.step(optimizer))
    scaler.update()
    strategy.teardown()
    return {"initial": initial, "params": [p.detach().clone() for p in model.parameters()], "scale": scaler.get_scale()}


def _scaled_runs(rank: int, world_size: int) -> dict:
    return {"poisoned": _two_scaled_optimizers(rank, world_size, True), "clean": _two_scaled_optimizers(rank, 2, False)}


def test_under_manual_optimization_an_inf_skips_only_the_step_of_the_optimizer_whose_gradient_holds_it():
    """The ranks agree per parameter whether its gradient holds an inf (each sees only its slice): as one process's
    scaler, the first layer's optimizer steps as on clean gradients, the second layer's skips, the scale halves
    (tolerance 0; on both ranks)."""
    for run in run_distributed(_scaled_runs, 2, timeout=60):
        poisoned, clean = run["poisoned"], run["clean"]
        assert clean["scale"] == 1024.0 and poisoned["scale"] == 512.0
        for index in (0, 1):  # the first layer: stepped
            assert torch.equal(poisoned["params"][index], clean["params"][index])
            assert not torch.equal(poisoned["params"][index], poisoned["initial"][index])
        for index in (2, 3):  # the second layer: skipped
            assert torch.equal(poisoned["params"][index], poisoned["initial"][index])
