"""TensorFusion (Horovod's negotiated fusion) against BucketedDDP, in real gloo processes."""

from __future__ import annotations

import time

import pytest
import torch
from _averaging import fit, flat_params, straight_and_resumed
from torch import nn

from syncline.options import OptionError
from syncline.strategies import BucketedDDP, TensorFusion
from syncline.strategies.tensor_fusion import fusion_plan
from syncline.testing import run_distributed
from tests.trainer._tasks import Regressor


class SkewedRegressor(Regressor):
    """Rank 1's backward pauses between layers, so the ranks' gradients become ready at different times."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[1](self.net[0](x))
        if torch.distributed.get_rank() == 1 and hidden.requires_grad:
            hidden.register_hook(lambda grad: time.sleep(0.02) or grad)
        return self.net[3](self.net[2](hidden))


class AdamRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _partly_unused_step(strategy, rank: int) -> list[torch.Tensor | None]:
    """One synchronized backward where rank 1 does not use the second layer, and nobody uses the third."""
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)])
    strategy.setup_environment()
    strategy.setup(model)
    x = torch.full((2, 4), float(rank + 1))
    hidden = model[0](x)
    if rank == 0:
        hidden = model[1](hidden)
    strategy.backward(hidden.sum(), sync=True)
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _against_bucketed_ddp(rank: int, world_size: int, tmp: str) -> dict:
    results = {"resume": straight_and_resumed(rank, world_size, tmp, TensorFusion, 3, 6)}
    settings = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    for optimizer, task_class in (("sgd", SkewedRegressor), ("adam", AdamRegressor)):
        _, reference = fit(BucketedDDP(), task_class, max_steps=6, **settings)
        results[f"{optimizer}/reference"] = flat_params(reference)
        # Every gradient alone, negotiated continuously (many cycles); and the defaults (one fused flush).
        for label, strategy in (("alone", TensorFusion(0, cycle_time_ms=0)), ("fused", TensorFusion())):
            trainer, task = fit(strategy, task_class, max_steps=6, **settings)
            results[f"{optimizer}/{label}"] = flat_params(task)
            results[f"{optimizer}/{label}/stats"] = trainer.strategy.communication_stats()
    results["ddp_bytes"] = sum(p.numel() * 4 for p in reference.parameters())
    results["unused/reference"] = _partly_unused_step(BucketedDDP(find_unused_parameters=True), rank)
    results["unused/fusion"] = _partly_unused_step(TensorFusion(find_unused_parameters=True), rank)
    try:
        _partly_unused_step(TensorFusion(), rank)
    except RuntimeError as error:
        results["unused/error"] = str(error)
    return results


def test_same_parameters_as_bucketed_ddp_with_accumulation_clipping_momentum_adam_unused_parameters_and_resume(
    tmp_path,
):
    ranks = run_distributed(_against_bucketed_ddp, world_size=2, args=(str(tmp_path),), timeout=90)
    for result in ranks:
        resume = result["resume"]
        assert torch.equal(resume["resumed"]["weights"], resume["straight"]["weights"])
        assert resume["resumed"]["state"] == resume["straight"]["state"]
        for optimizer in ("sgd", "adam"):
            for label in ("alone", "fused"):
                got, want = result[f"{optimizer}/{label}"], result[f"{optimizer}/reference"]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
                stats = result[f"{optimizer}/{label}/stats"]
                # Every gradient once per optimizer step, as bucketed_ddp; the negotiation is not counted.
                assert stats["comm/bytes"] == result["ddp_bytes"]
                assert stats["comm/total_bytes"] == 6 * result["ddp_bytes"]
            assert result[f"{optimizer}/alone/stats"]["fusion/allreduces"] == 4  # one per parameter
            assert result[f"{optimizer}/fused/stats"]["fusion/allreduces"] <= 2
        # Used on rank 0 only: averaged with rank 1's zeros; used nowhere: no gradient, as bucketed_ddp.
        for got, want in zip(result["unused/fusion"], result["unused/reference"]):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert result["unused/fusion"][2] is not None and result["unused/fusion"][4] is None
        assert "1.weight (rank 1)" in result["unused/error"] and "2.weight (ranks 0, 1)" in result["unused/error"]
        assert "find_unused_parameters=True" in result["unused/error"]
    torch.testing.assert_close(ranks[0]["sgd/alone"], ranks[1]["sgd/alone"], rtol=0, atol=0)


def test_plan_fuses_in_the_coordinators_order_up_to_the_threshold():
    # Rank 0 saw gradients 2, 0, 1 ready; rank 1 has 3 not ready yet; gradient 4 is unused on rank 1.
    readiness = torch.tensor([[2, 3, 1, 4, 5], [1, 2, 3, 0, -1]])
    pending = torch.tensor([True, True, True, True, True])
    sizes, keys = [4, 4, 8, 4, 4], ["f32"] * 5
    buffers, nowhere, somewhere = fusion_plan(readiness, pending, sizes, keys, threshold_bytes=12)
    assert buffers == [[2, 0], [1, 4]] and nowhere == [] and somewhere == [4]
    pending[[2, 0]] = False
    assert fusion_plan(readiness, pending, sizes, keys, threshold_bytes=0)[0] == [[1], [4]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fusion_threshold_mb": -1}, r"TensorFusion\(fusion_threshold_mb=-1\): fusion_threshold_mb must be"),
        ({"cycle_time_ms": float("nan")}, r"TensorFusion\(cycle_time_ms=nan\): cycle_time_ms must be"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message):
    with pytest.raises(OptionError, match=message):
        TensorFusion(**kwargs)
