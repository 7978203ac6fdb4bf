"""Bytes per step of every compressing strategy against bucketed_ddp's, on the same model (deterministic)."""

from __future__ import annotations

import torch
from torch import nn

from syncline.strategies import BucketedDDP, ByteGrad, NativeDDP, PowerSGD, QAdam
from syncline.testing import run_distributed

WIDTH = 256
PARAMETERS = 3 * (WIDTH * WIDTH + WIDTH)  # three 256x256 layers with biases


class _Layers(nn.Module):
    """Three 256x256 linear layers; `training_step` as a Task has it, so every strategy can run it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.head(self.net(batch)).pow(2).mean()


def _strategies() -> dict[str, object]:
    return {
        "bucketed_ddp": BucketedDDP(),
        "native_ddp": NativeDDP(),
        "native_ddp_unused": NativeDDP(find_unused_parameters=True),
        "fp16": BucketedDDP(comm_hook="fp16"),
        "bf16": BucketedDDP(comm_hook="bf16"),
        "bytegrad": ByteGrad(),
        "powersgd": PowerSGD(rank=4, start_iter=0),
        "qadam": QAdam(warmup_steps=1),
    }


def _bytes_per_step(rank: int, world_size: int) -> dict[str, list[tuple[float, float]]]:
    measured = {}
    for name, strategy in _strategies().items():
        model = _Layers()
        strategy.setup_environment()
        strategy.setup(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        steps = []
        for step in range(3):
            batch = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank * 10 + step))
            for micro in range(2):  # an accumulation window of two micro-batches
                sync = micro == 1
                strategy.sync_next_backward = sync
                loss = strategy.training_step(model, batch[micro * 4 : micro * 4 + 4], step)
                strategy.backward(loss, sync=sync)
                if not sync:
                    assert strategy.comm_counter.open_bytes == 0, f"{name} communicated inside the window"
            strategy.optimizer_step(optimizer, optimizer.step)
            strategy.zero_grad(optimizer)
            stats = strategy.communication_stats()
            steps.append((stats["comm/bytes"], stats["comm/total_bytes"]))
        strategy.teardown()
        measured[name] = steps
    return measured


def test_bytes_per_step_of_each_strategy_against_bucketed_ddp():
    results = run_distributed(_bytes_per_step, world_size=2, timeout=120)
    assert results[0] == results[1]  # every rank hands the same bytes to the collectives
    measured = {name: [step for step, _ in steps] for name, steps in results[0].items()}
    for name, steps in results[0].items():
        assert steps[-1][1] == sum(measured[name]), f"{name}: comm/total_bytes is the sum of the steps"
    exact = measured["bucketed_ddp"][-1]
    assert exact == 4 * PARAMETERS
    # torch's DDP, counted analytically, hands the same gradients; plus the used-parameter bitmap.
    assert measured["native_ddp"] == measured["bucketed_ddp"]
    assert measured["native_ddp_unused"][-1] == exact + 4 * 6
    assert measured["fp16"][-1] == measured["bf16"][-1] == exact / 2 <= 0.55 * exact
    # Two ranks, one bucket: half the uint8 codes to the other rank, then the own half gathered;
    # each chunk with an 8-byte header.
    assert measured["bytegrad"][-1] == (PARAMETERS / 2 + 8) + (PARAMETERS / 2 + 8) <= 0.35 * exact
    # Rank 4 on 256x256: P and Q (2 x 256 x 4 floats) per matrix, biases exact.
    assert measured["powersgd"][-1] == 4 * (3 * 2 * WIDTH * 4 + 3 * WIDTH) <= 0.2 * exact
    # QAdam: exact during its one warm-up step, then the 8-bit momentum, as ByteGrad sends a bucket.
    assert measured["qadam"] == [exact, measured["bytegrad"][-1], measured["bytegrad"][-1]]


def test_every_strategy_pickles_with_its_hook_and_state():
    """The launcher pickles the strategy to every worker process: hooks must be importable functions."""
    import pickle

    for name, strategy in _strategies().items():
        clone = pickle.loads(pickle.dumps(strategy))
        assert type(clone) is type(strategy), name
        assert getattr(clone, "comm_hook", None) is getattr(strategy, "comm_hook", None), name
