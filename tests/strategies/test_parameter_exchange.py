"""Both parameter servers with `prefetch=True`: the blocking broadcast's (all-gather's) weights, optimizer state and
bytes, to the bit, on 2 real gloo processes; the step is still in flight where nobody reads the weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from syncline.callbacks import Callback
from syncline.strategies import ParameterServer, ShardedParameterServer
from syncline.testing import run_distributed
from syncline.trainer import Task, Trainer
from tests.strategies.test_deferred_update import DeepRegressor
from tests.trainer._tasks import loader, quiet, regression_data

STEPS = 9


class InFlight(Callback):
    """Record, at each step's end, whether broadcasts were still in flight; save a checkpoint at step `save_at`."""

    reads_parameters = False  # so the step stays in flight here

    def __init__(self, save_at: int | None = None, path: str | None = None) -> None:
        self.save_at, self.path = save_at, path
        self.pending: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop.accumulated_grads():
            return
        exchange = trainer.strategy.exchange
        self.pending.append(0 if exchange is None else exchange.in_flight)
        if trainer.global_step == self.save_at and self.path:
            trainer.save_checkpoint(self.path)  # lands every bucket first
            assert exchange is None or not exchange.in_flight


class ReadsWeights(Callback):
    """A callback that reads the weights at a step's end: the loop lands the step before it."""

    def __init__(self) -> None:
        self.pending: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        exchange = trainer.strategy.exchange
        self.pending.append(0 if exchange is None else exchange.in_flight)


def _fit(
    make: Any, prefetch: bool, ckpt_path: str | None = None, save: str | None = None, reading: bool = False
) -> dict[str, Any]:
    torch.manual_seed(0)
    task = DeepRegressor()
    strategy = make(prefetch)
    in_flight, reads = InFlight(4, save), ReadsWeights()
    trainer = Trainer(
        max_steps=STEPS,
        strategy=strategy,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        val_check_interval=3,
        limit_val_batches=2,
        callbacks=[reads] if reading else [in_flight],
        **quiet(seed=0),
    )
    data = regression_data(128)
    trainer.fit(task, loader(data, batch_size=4, shuffle=True), loader(data, batch_size=8), ckpt_path=ckpt_path)
    optimizer = trainer.optim.optimizer
    state = strategy.optimizer_state_dict(optimizer)["state"]  # collective: the whole state, on every rank
    return {
        "weights": {k: v.clone() for k, v in task.state_dict().items()},
        "state": [t.clone() for key in sorted(state) for t in state[key].values() if torch.is_tensor(t)],
        "bytes": strategy.communication_stats()["comm/total_bytes"],
        "in_flight": in_flight.pending,
        "read_pending": reads.pending,
    }


def _server(prefetch: bool) -> ParameterServer:
    return ParameterServer(server_rank=1, bucket_cap_mb=0, prefetch=prefetch)


def _sharded(prefetch: bool) -> ShardedParameterServer:
    return ShardedParameterServer(bucket_cap_mb=0, prefetch=prefetch)


def _scaled_steps(make: Any, prefetch: bool, rank: int) -> torch.Tensor:
    """A hand-written loop with SGD+momentum and fp16's loss scaler, rank 1's gradient inf at step 1 (skipped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    strategy = make(prefetch)
    strategy.setup_environment()
    strategy.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy.setup_optimizer(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    generator = torch.Generator().manual_seed(rank)
    for step in range(4):
        x = torch.randn(6, 8, generator=generator)
        loss = model(x).pow(2).mean()
        handle = None
        if step == 1 and rank == 1:
            handle = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        strategy.backward(scaler.scale(loss), sync=True)
        if handle is not None:
            handle.remove()
        scaler.unscale_(optimizer)
        strategy.optimizer_step(optimizer, lambda: (scaler.step(optimizer), scaler.update()))
        strategy.zero_grad(optimizer)
    strategy.apply_pending_updates()  # a hand-written loop lands the last step before reading the weights
    params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    strategy.teardown()
    return params


def _runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, make in (("server", _server), ("sharded", _sharded)):
        out[name] = {
            "blocking": _fit(make, False),
            "prefetch": _fit(make, True),
            "reading": _fit(make, True, reading=True),
            "saving": _fit(make, True, save=f"{tmp}/{name}.ckpt"),
        }
        out[name]["resumed"] = _fit(make, True, ckpt_path=f"{tmp}/{name}.ckpt")
        out[name]["scaled"] = {
            "blocking": _scaled_steps(make, False, rank),
            "prefetch": _scaled_steps(make, True, rank),
        }
    return out


def test_prefetched_parameters_equal_the_blocking_step_to_the_bit_and_resume_exactly(tmp_path):
    results = run_distributed(_runs, world_size=2, args=(str(tmp_path),), timeout=300)
    for rank, result in enumerate(results):
        for name, runs in result.items():
            blocking = runs["blocking"]
            for run in ("prefetch", "reading", "saving", "resumed"):
                for key, value in blocking["weights"].items():
                    assert torch.equal(runs[run]["weights"][key], value), (rank, name, run, key)
                assert len(runs[run]["state"]) == len(blocking["state"]) > 0, (rank, name, run)
                for mine, theirs in zip(runs[run]["state"], blocking["state"]):
                    assert torch.equal(mine, theirs), (rank, name, run)
                assert runs[run]["bytes"] == blocking["bytes"], (rank, name, run)
            # Where nobody reads the weights, every step ends with its buckets in flight; where a callback
            # reads them, the loop lands them first. The blocking path has nothing in flight.
            assert all(runs["prefetch"]["in_flight"]), (rank, name, runs["prefetch"]["in_flight"])
            assert runs["reading"]["read_pending"] and not any(runs["reading"]["read_pending"])
            assert not any(blocking["in_flight"])
            scaled = runs["scaled"]
            assert torch.equal(scaled["prefetch"], scaled["blocking"]), (rank, name)
    for name in ("server", "sharded"):
        assert torch.equal(results[0][name]["scaled"]["prefetch"], results[1][name]["scaled"]["prefetch"])
