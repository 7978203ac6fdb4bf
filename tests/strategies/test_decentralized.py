"""Decentralized (D-PSGD, BAGUA's low-precision variant): pairings, exact averaging, quantized differences."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _averaging import PlainSGD, fit, flat_params, model_bytes, straight_and_resumed
from torch import nn

from syncline.callbacks import Callback
from syncline.lab.bound import wire_phases
from syncline.options import OptionError
from syncline.strategies import Decentralized, decentralized
from syncline.strategies.decentralized import shift_one_partner
from syncline.testing import run_distributed, run_ranks
from syncline.trainer import Task, Trainer
from tests.trainer._tasks import loader, quiet, regression_data


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6])
def test_shift_one_pairs_are_symmetric_rotate_and_leave_at_most_one_rank_out(world_size):
    met = set()
    for round_ in range(world_size + (world_size % 2) - 1):
        partners = [shift_one_partner(rank, world_size, round_) for rank in range(world_size)]
        for rank, partner in enumerate(partners):
            assert partner != rank
            if partner is not None:
                assert partners[partner] == rank
                met.add(frozenset((rank, partner)))
        assert partners.count(None) == world_size % 2  # even: everyone is paired every round
    # A full rotation pairs every two ranks once.
    assert len(met) == world_size * (world_size - 1) // 2


def _exact_and_shift(rank, world_size):
    steps = 6
    results = {}
    for peers in ("all", "shift_one"):
        trainer, task = fit(Decentralized(peers=peers, period=1), PlainSGD, max_steps=steps)
        results[peers] = (flat_params(task), trainer.strategy.communication_stats())
    return results, model_bytes(task)


def test_all_peers_period_one_equals_exact_averaging_and_shift_one_communicates_every_step():
    ranks = run_distributed(_exact_and_shift, world_size=3, timeout=120)
    reference = ranks[0][0]["all"][0]
    for results, nbytes in ranks:
        # Exact averaging every step keeps every replica equal, bit for bit.
        torch.testing.assert_close(results["all"][0], reference, rtol=0, atol=0)
        assert results["all"][1]["comm/total_bytes"] == 6 * nbytes
    # Three ranks: each round one rank sits out, so over 6 rounds every rank exchanged 4 times.
    assert [r[0]["shift_one"][1]["comm/total_bytes"] for r in ranks] == [4 * ranks[0][1]] * 3
    # The last round (5) paired ranks 0 and 1, whose models are now equal; rank 2 sat it out.
    assert torch.equal(ranks[0][0]["shift_one"][0], ranks[1][0]["shift_one"][0])
    assert not torch.equal(ranks[0][0]["shift_one"][0], ranks[2][0]["shift_one"][0])


def _one_step_by_hand(rank, world_size, peers, compression):
    """One local step and one averaging, against the mean of every rank's locally stepped model."""
    from tests.strategies.test_bucketed_ddp import Net, global_batch, shard

    torch.manual_seed(0)
    model = Net()
    strategy = Decentralized(peers=peers, period=1, compression=compression)
    strategy.setup_environment()
    strategy.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = strategy.training_step(model, shard(global_batch(step), rank, world_size), step)
        strategy.backward(loss, sync=True)
        stepped = torch.cat([p.detach().reshape(-1) - 0.1 * p.grad.reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(stepped) for _ in range(world_size)]
        dist.all_gather(everyone, stepped)  # the reference's own collective, not the strategy's
        strategy.optimizer_step(optimizer, optimizer.step)
        strategy.zero_grad(optimizer)
        if peers == "all":
            expected = torch.stack(everyone).mean(dim=0)
        else:
            partner = shift_one_partner(rank, world_size, step)
            expected = (everyone[rank] + everyone[partner]) / 2
        error = (flat_params(model) - expected).abs().max().item()
        spread = (stepped.max() - stepped.min()).item()
    return error, spread, strategy.communication_stats()["comm/bytes"], stepped.numel() * 4


@pytest.mark.parametrize("peers", ["all", "shift_one"])
def test_exact_and_uint8_averaging_against_the_mean_of_the_stepped_models(peers):
    for rank_error, _, sent, fp32 in run_distributed(_one_step_by_hand, 2, args=(peers, None), timeout=60):
        assert rank_error < 1e-6
        assert sent == fp32
    for rank_error, spread, sent, fp32 in run_distributed(_one_step_by_hand, 2, args=(peers, "uint8"), timeout=60):
        # Quantized differences: within a few quantization steps of the exact average, at ~1/4 of the bytes.
        assert rank_error < spread / 255
        assert sent < 0.27 * fp32


def test_bad_options_fail_at_construction_or_setup():
    with pytest.raises(OptionError, match="peers must be one of 'shift_one', 'all'"):
        Decentralized(peers="ring")
    with pytest.raises(OptionError, match=r"Decentralized\(period=0\)"):
        Decentralized(period=0)
    with pytest.raises(OptionError, match="compression must be None or 'uint8'"):
        Decentralized(compression="fp8")
    [outcome] = run_ranks(_fit_uint8, world_size=1, timeout=60)
    assert "Decentralized(compression='uint8') needs at least 2 processes" in outcome.error


def _fit_uint8(rank, world_size):
    fit(Decentralized(compression="uint8"), max_steps=1)


def _low_precision():
    return Decentralized(peers="shift_one", period=2, compression="uint8")


def test_resume_is_bit_exact_with_every_rank_s_model_optimizer_state_and_estimates(tmp_path):
    # Stopped after step 5, one local step after an averaging: the replicas differ.
    ranks = run_distributed(straight_and_resumed, 2, args=(str(tmp_path), _low_precision, 5, 9), timeout=120)
    assert not torch.equal(ranks[0]["at_checkpoint"], ranks[1]["at_checkpoint"])
    for runs in ranks:
        assert torch.equal(runs["resumed"]["weights"], runs["straight"]["weights"])
        straight, resumed = runs["straight"]["state"], runs["resumed"]["state"]
        assert resumed["rounds"] == straight["rounds"] == 4
        for key, flats in straight["estimates"].items():
            assert all(torch.equal(a, b) for a, b in zip(resumed["estimates"][key], flats)), key


class WideRegressor(Task):
    """About 26k parameters: 7 uneven quantization chunks (one of 3713 values, six of 3712), so segments of 2
    chunks end inside parameters and mix the two chunk sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 128),
            nn.Tanh(),
            nn.Linear(128, 128),
            nn.Tanh(),
            nn.Linear(128, 64),
            nn.Tanh(),
            nn.Linear(64, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SaveInFlight(Callback):
    """Save a checkpoint at the end of step `step`, its exchange still in flight (saving lands it)."""

    reads_parameters = False

    def __init__(self, step: int | None = None, path: str | None = None) -> None:
        self.step, self.path, self.in_flight = step, path, []

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        exchange = trainer.strategy.exchange
        self.in_flight.append(0 if exchange is None else exchange.in_flight)
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            assert not exchange.in_flight


def _wide_fit(peers: str, prefetch: bool, ckpt_path: str | None = None, save: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    task = WideRegressor()
    strategy = Decentralized(peers=peers, period=2, compression="uint8", prefetch=prefetch)
    recorder = SaveInFlight(4, save) if save else SaveInFlight()
    trainer = Trainer(
        max_steps=9, strategy=strategy, val_check_interval=3, limit_val_batches=2, callbacks=[recorder], **quiet(seed=0)
    )
    data = regression_data(96)
    trainer.fit(task, loader(data, 4, shuffle=True), loader(data, 8), ckpt_path=ckpt_path)
    optimizer = trainer.optim.optimizer
    return {
        "weights": flat_params(task),
        "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in task.parameters()],
        "estimates": strategy.state_dict()["estimates"],
        "bytes": strategy.communication_stats()["comm/total_bytes"],
        "in_flight": recorder.in_flight,
    }


def _blocking_and_prefetched(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    decentralized.SEGMENT_CHUNKS = 2  # 4 segments of this model
    out = {}
    for peers in ("shift_one", "all"):
        out[peers] = {
            "blocking": _wide_fit(peers, False),
            "prefetch": _wide_fit(peers, True),
            "saving": _wide_fit(peers, True, save=f"{tmp}/{peers}.ckpt"),
        }
        out[peers]["resumed"] = _wide_fit(peers, True, ckpt_path=f"{tmp}/{peers}.ckpt")
    return out


def test_prefetched_uint8_exchange_equals_the_blocking_one_to_the_bit_and_resumes_exactly(tmp_path):
    results = run_distributed(_blocking_and_prefetched, 2, args=(str(tmp_path),), timeout=300)
    for rank, result in enumerate(results):
        for peers, runs in result.items():
            blocking = runs["blocking"]
            for run in ("prefetch", "saving", "resumed"):
                assert torch.equal(runs[run]["weights"], blocking["weights"]), (rank, peers, run)
                for mine, theirs in zip(runs[run]["momentum"], blocking["momentum"]):
                    assert torch.equal(mine, theirs), (rank, peers, run)
                assert runs[run]["estimates"].keys() == blocking["estimates"].keys()
                for key, flats in blocking["estimates"].items():
                    assert all(torch.equal(a, b) for a, b in zip(runs[run]["estimates"][key], flats)), (rank, key)
                assert runs[run]["bytes"] == blocking["bytes"], (rank, peers, run)
            # Every second step averages: its 4 segments are still in flight at the step's end.
            assert runs["prefetch"]["in_flight"][1::2] == [4] * 4 and not any(runs["prefetch"]["in_flight"][::2])
            assert not any(blocking["in_flight"])
    # The replicas differ (decentralized): the ranks' weights are not each other's.
    assert not torch.equal(results[0]["all"]["blocking"]["weights"], results[1]["all"]["blocking"]["weights"])


def _blocking_and_prefetched_shift_one(rank: int, world_size: int) -> dict[str, Any]:
    decentralized.SEGMENT_CHUNKS = 2
    return {"blocking": _wide_fit("shift_one", False), "prefetch": _wide_fit("shift_one", True)}


def test_prefetch_on_three_ranks_equals_the_blocking_exchange_where_the_phantom_rank_sits_out_a_rank():
    """An odd world: `shift_one` pairs a phantom rank with one rank each round, and that rank exchanges nothing."""
    results = run_distributed(_blocking_and_prefetched_shift_one, 3, timeout=300)
    for rank, runs in enumerate(results):
        blocking, prefetch = runs["blocking"], runs["prefetch"]
        assert torch.equal(prefetch["weights"], blocking["weights"]), rank
        assert all(torch.equal(a, b) for a, b in zip(prefetch["momentum"], blocking["momentum"])), rank
        for key, flats in blocking["estimates"].items():
            assert all(torch.equal(a, b) for a, b in zip(prefetch["estimates"][key], flats)), (rank, key)
        assert prefetch["bytes"] == blocking["bytes"], rank
        # The averaging steps' segments were in flight at a step's end on some round (not every rank sits out).
        assert any(prefetch["in_flight"]), rank
    assert len({float(r["blocking"]["weights"].sum()) for r in results}) == 3  # three replicas, all different


def test_prefetch_needs_uint8():
    with pytest.raises(OptionError, match="prefetch=True, compression=None"):
        Decentralized(prefetch=True)
    assert wire_phases(Decentralized(compression="uint8", prefetch=True))[0].hides_behind == "forward"
