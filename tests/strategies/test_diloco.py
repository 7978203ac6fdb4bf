"""DiLoCo and streaming DiLoCo against data parallel, local SGD and the papers' algorithm boxes (real gloo ranks)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from _averaging import PlainSGD, fit, flat_params, model_bytes, straight_and_resumed
from torch import nn

from syncline.options import OptionError
from syncline.strategies import BucketedDDP, DiLoCo, LocalSGD
from syncline.testing import run_distributed
from tests.trainer._tasks import Regressor, regression_data


def _equivalences(rank: int, world_size: int) -> dict[str, Any]:
    _, ddp = fit(BucketedDDP(), PlainSGD, max_steps=16)
    _, every = fit(DiLoCo(period=1, outer_lr=1.0, outer_momentum=0.0), PlainSGD, max_steps=16)
    _, local = fit(LocalSGD(period=4), max_steps=14)
    diloco, delayed = fit(DiLoCo(period=4, outer_lr=1.0, outer_momentum=0.0), max_steps=14)
    halved, bf16 = fit(DiLoCo(period=4, outer_lr=1.0, outer_momentum=0.0, compression="bf16"), max_steps=14)
    streaming, _ = fit(DiLoCo(period=4, fragments=2, overlap_steps=0, outer_lr=1.0, outer_momentum=0.0), max_steps=14)
    return {
        "ddp": flat_params(ddp),
        "every": flat_params(every),
        "local": flat_params(local),
        "delayed": flat_params(delayed),
        "bytes": diloco.strategy.communication_stats()["comm/total_bytes"],
        "bf16": flat_params(bf16),
        "bf16_bytes": halved.strategy.communication_stats()["comm/total_bytes"],
        "streaming_bytes": streaming.strategy.communication_stats()["comm/total_bytes"],
        "model_bytes": model_bytes(delayed),
    }


def test_period_one_is_data_parallel_and_outer_sgd_at_rate_one_is_local_sgd():
    ranks = run_distributed(_equivalences, world_size=2, timeout=120)
    for result in ranks:
        # Plain SGD: the mean weight delta of one inner step is the learning rate times the mean gradient.
        torch.testing.assert_close(result["every"], result["ddp"], rtol=1e-5, atol=1e-5)
        # Outer SGD at rate 1 without momentum replaces the weights by the mean of the replicas (momentum SGD inside,
        # each rank's own), after local steps 4, 8, 12 as local SGD; steps 13-14 are local in both.
        torch.testing.assert_close(result["delayed"], result["local"], rtol=1e-5, atol=1e-5)
        assert result["bytes"] == 3 * result["model_bytes"]
        # bfloat16 outer gradients (8 bits of mantissa; error feedback carries what they drop): half the bytes, weights
        # within 2e-2 of float32's after 14 steps (about 4e-3 apart here).
        assert result["bf16_bytes"] == 3 * result["model_bytes"] // 2
        torch.testing.assert_close(result["bf16"], result["delayed"], rtol=0, atol=2e-2)
        assert not torch.equal(result["bf16"], result["delayed"])
        # The 161 values cut in fragments of 81 and 80, exchanged at offsets 0 and 2 of 4: fragment 0 after steps 4, 8,
        # 12, fragment 1 after steps 2, 6, 10, 14.
        assert result["streaming_bytes"] == 3 * 81 * 4 + 4 * 80 * 4
    torch.testing.assert_close(ranks[0]["every"], ranks[1]["every"], rtol=0, atol=0)


def _composed(rank: int, world_size: int) -> dict[str, Any]:
    mixed = {"accumulate_grad_batches": 2, "precision": "bf16-mixed"}
    _, ddp = fit(BucketedDDP(), PlainSGD, max_steps=6, **mixed)
    _, every = fit(DiLoCo(period=1, outer_lr=1.0, outer_momentum=0.0), PlainSGD, max_steps=6, **mixed)
    clipped = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    _, local = fit(LocalSGD(period=3), max_steps=7, **clipped)
    _, delayed = fit(DiLoCo(period=3, outer_lr=1.0, outer_momentum=0.0), max_steps=7, **clipped)
    return {
        name: flat_params(task)
        for name, task in [("ddp", ddp), ("every", every), ("local", local), ("delayed", delayed)]
    }


def test_accumulation_clipping_and_mixed_precision_compose():
    for result in run_distributed(_composed, world_size=2, timeout=120):
        # Two micro-batches per inner step under bf16 autocast: still data parallel at period 1.
        torch.testing.assert_close(result["every"], result["ddp"], rtol=1e-5, atol=1e-5)
        # Each replica clips its own accumulated gradient, as local SGD's do.
        torch.testing.assert_close(result["delayed"], result["local"], rtol=1e-5, atol=1e-5)


def _algorithm_box(world: int, steps: int, period: int, fragments: int, overlap: int, alpha: float, carry=False):
    """Streaming DiLoCo as the paper's algorithm box, `world` replicas in one process (DiLoCo: one fragment, no
    overlap, alpha 0); with `carry`, the merge is the global fragment plus each replica's steps since the launch.
    Replica m trains on samples m, m + world, ... in batches of 4 (the unshuffled shard it gets
    in `fit`), with its own momentum SGD; fragment p is part p of the flat parameters (`tensor_split`); the outer
    step is torch's Nesterov SGD at the paper's 0.7 and 0.9."""
    data = regression_data(64)
    replicas = []
    for _ in range(world):
        torch.manual_seed(0)
        task = Regressor(lr=0.05)
        replicas.append((task, task.configure_optimizers()))

    def flat(task: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in task.parameters()])

    parts = [part.clone() for part in flat(replicas[0][0]).tensor_split(fragments)]
    bounds = [0, *torch.tensor([part.numel() for part in parts]).cumsum(0).tolist()]
    outer = [torch.optim.SGD([part], lr=0.7, momentum=0.9, nesterov=True) for part in parts]
    in_flight = None
    for t in range(1, steps + 1):
        for m, (task, optimizer) in enumerate(replicas):
            shard = list(range(m, 64, world))
            x, y = data[shard[4 * ((t - 1) % 8) :][:4]]
            optimizer.zero_grad()
            nn.functional.mse_loss(task(x), y).backward()
            optimizer.step()
        for p in range(fragments):
            if t % period == p * period // fragments:
                # Δ_p = mean_m(θ̃_p - θ_m,p), summed in rank order as the all-reduce of the pre-divided deltas.
                span = slice(bounds[p], bounds[p + 1])
                in_flight = (p, t + overlap, sum((parts[p] - flat(task)[span]) / world for task, _ in replicas))
                launched = [flat(task)[span] for task, _ in replicas]
        if in_flight is not None and in_flight[1] == t:
            p, _, parts[p].grad = in_flight
            in_flight = None
            outer[p].step()
            for m, (task, _) in enumerate(replicas):
                merged = flat(task)
                span = slice(bounds[p], bounds[p + 1])
                if carry:
                    merged[span] = parts[p] + (merged[span] - launched[m])
                else:
                    merged[span] = torch.lerp(parts[p], merged[span], alpha)
                torch.nn.utils.vector_to_parameters(merged, task.parameters())
    return [flat(task) for task, _ in replicas]


def _boxes(rank: int, world_size: int) -> dict[str, Any]:
    _, diloco = fit(DiLoCo(period=4), max_steps=14)
    _, streaming = fit(DiLoCo(period=4, fragments=2), max_steps=14)
    _, carried = fit(DiLoCo(period=6, fragments=2, overlap_steps=2, merge="carry"), max_steps=14)
    return {"diloco": flat_params(diloco), "streaming": flat_params(streaming), "carried": flat_params(carried)}


def test_one_fragment_is_the_diloco_box_and_two_the_streaming_box():
    ranks = run_distributed(_boxes, world_size=2, timeout=120)
    diloco = _algorithm_box(2, 14, 4, fragments=1, overlap=0, alpha=0.0)
    streaming = _algorithm_box(2, 14, 4, fragments=2, overlap=1, alpha=0.5)
    carried = _algorithm_box(2, 14, 6, fragments=2, overlap=2, alpha=0.0, carry=True)
    mixed = _algorithm_box(2, 14, 6, fragments=2, overlap=2, alpha=0.5)
    for rank, result in enumerate(ranks):
        # Every operation is the box's, in the same order: the same bits.
        torch.testing.assert_close(result["diloco"], diloco[rank], rtol=0, atol=0)
        torch.testing.assert_close(result["streaming"], streaming[rank], rtol=0, atol=0)
        torch.testing.assert_close(result["carried"], carried[rank], rtol=0, atol=0)
        assert not torch.equal(carried[rank], mixed[rank])  # the merges differ where steps overlapped
    assert not torch.equal(ranks[0]["streaming"], ranks[1]["streaming"])  # steps 13-14 are local


def _overlapped_and_blocking(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[Any, Any] = {}
    for merge in ("mix", "carry"):
        for thread in (True, False):
            strategy = DiLoCo(
                period=6, fragments=3, overlap_steps=1, compression="uint8", comm_thread=thread, merge=merge
            )
            trainer, task = fit(strategy, max_steps=14)
            results[merge, thread] = {
                "weights": flat_params(task),
                "bytes": trainer.strategy.communication_stats()["comm/total_bytes"],
                "feedback": trainer.strategy.state_dict()["error_feedback"],
            }
        results["healed", merge] = _healed(trainer.strategy, task)
    return results


def _healed(strategy: DiLoCo, task: nn.Module) -> dict[str, Any]:
    """Live recovery's healing on this rank's trained strategy, from a source state whose outer state differs from
    its own (as where an exchange completed on the source only): first as a survivor, then as a replacement."""
    own = strategy.state_dict()
    source = {
        **own,
        "steps": own["steps"] + 6,
        "globals": [[glob + 1 for glob in fragment] for fragment in own["globals"]],
        "outer": [
            {**outer, "state": {i: {"momentum_buffer": 2 * m["momentum_buffer"]} for i, m in outer["state"].items()}}
            for outer in own["outer"]
        ],
        "in_flight": {
            **own["in_flight"],
            "averages": [a + 1 for a in own["in_flight"]["averages"]],
            "launched_from": own["in_flight"]["launched_from"] and [t + 1 for t in own["in_flight"]["launched_from"]],
        },
        "error_feedback": {key: memory + 1 for key, memory in own["error_feedback"].items()},
    }
    before = flat_params(task)
    strategy.heal_from(source, replacement=False)
    survivor = {"weights": flat_params(task), "state": strategy.state_dict()}
    strategy.heal_from(source, replacement=True)
    replacement = {"weights": flat_params(task), "state": strategy.state_dict()}
    return {"own": own, "source": source, "before": before, "survivor": survivor, "replacement": replacement}


@pytest.fixture(scope="module")
def overlapped_and_blocking() -> list[dict[str, Any]]:
    # Three ranks: the 8-bit scatter-reduce cuts every fragment unevenly; the exchange on the thread runs behind the
    # next inner step, the blocking one at launch.
    return run_distributed(_overlapped_and_blocking, world_size=3, timeout=120)


def test_the_overlapped_exchange_equals_the_blocking_one_to_the_bit(overlapped_and_blocking):
    ranks = overlapped_and_blocking
    for merge in ("mix", "carry"):
        for result in ranks:
            thread, blocking = result[merge, True], result[merge, False]
            assert torch.equal(thread["weights"], blocking["weights"]), merge
            assert thread["bytes"] == blocking["bytes"] > 0
            assert thread["feedback"].keys() == blocking["feedback"].keys() == {"0.0", "1.0", "2.0"}
            for key, memory in thread["feedback"].items():
                assert torch.equal(memory, blocking["feedback"][key])
        assert not torch.equal(ranks[0][merge, True]["weights"], ranks[1][merge, True]["weights"])
    assert not torch.equal(ranks[0]["mix", True]["weights"], ranks[0]["carry", True]["weights"])


def test_live_healing_takes_the_outer_state_and_a_replacement_starts_at_the_global_copies(overlapped_and_blocking):
    for result in overlapped_and_blocking:
        healed = result["healed", "mix"]
        own, source, survivor, replacement = healed["own"], healed["source"], healed["survivor"], healed["replacement"]
        assert own["in_flight"] is not None, "fragment 1, exchanged after step 14, merges after step 15"
        # Both take the source's global copies, outer momentum, step count and exchange in flight.
        for state in (survivor["state"], replacement["state"]):
            _assert_same({k: state[k] for k in ("globals", "outer", "steps", "in_flight")},
                         {k: source[k] for k in ("globals", "outer", "steps", "in_flight")})  # fmt: skip
        # A survivor keeps its replica and its error feedback (its own residuals, not the source's).
        assert torch.equal(survivor["weights"], healed["before"])
        _assert_same(survivor["state"]["error_feedback"], own["error_feedback"])
        assert own["error_feedback"]
        # A replacement starts at θ̃ (the fragments are consecutive ranges of the one float32 group), and has sent
        # nothing, so remembers no residual.
        assert torch.equal(replacement["weights"], torch.cat([g for fragment in source["globals"] for g in fragment]))
        assert replacement["state"]["error_feedback"] == {}


def test_under_carry_a_survivor_keeps_its_launch_point_and_a_replacement_counts_from_the_global_copies(
    overlapped_and_blocking,
):
    for result in overlapped_and_blocking:
        healed = result["healed", "carry"]
        own, source = healed["own"]["in_flight"], healed["source"]
        survivor, replacement = healed["survivor"]["state"]["in_flight"], healed["replacement"]["state"]["in_flight"]
        exchange = ("fragment", "apply_at", "averages", "bytes")
        for state in (survivor, replacement):  # the exchange itself is the source's
            _assert_same({k: state[k] for k in exchange}, {k: source["in_flight"][k] for k in exchange})
        # The launch point is a replica's own: a survivor that launched the same exchange keeps its own, not the
        # source's; a replacement, started at θ̃, counts its steps from there.
        _assert_same(survivor["launched_from"], own["launched_from"])
        _assert_same(replacement["launched_from"], source["globals"][own["fragment"]])


def _resumed(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    def diloco():
        return DiLoCo(period=4)

    def streaming():
        return DiLoCo(period=4, fragments=2, compression="uint8")

    def carried():
        return DiLoCo(period=6, fragments=2, overlap_steps=2, merge="carry")

    # DiLoCo stopped after inner step 5 of 11: one step into its second period. Streaming DiLoCo stopped after step
    # 6, with fragment 1 (exchanged after steps 2, 6, 10) in flight until step 7.
    return {
        "diloco": straight_and_resumed(rank, world_size, f"{tmp}/diloco", diloco, 5, 11),
        "streaming": straight_and_resumed(rank, world_size, f"{tmp}/streaming", streaming, 6, 11),
        # Fragment 1 (exchanged after steps 3, 9) launched after step 9 and merged after 11: in flight at the stop.
        "carried": straight_and_resumed(rank, world_size, f"{tmp}/carried", carried, 10, 13),
    }


def _assert_same(saved: Any, expected: Any, where: str = "state") -> None:
    """Equal to the bit, through dicts, lists and tensors."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(saved, expected), where
    elif isinstance(expected, dict):
        assert saved.keys() == expected.keys(), where
        for key, value in expected.items():
            _assert_same(saved[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(saved) == len(expected), where
        for index, value in enumerate(expected):
            _assert_same(saved[index], value, f"{where}[{index}]")
    else:
        assert saved == expected, where


def test_resume_mid_period_is_bit_exact_for_one_and_two_fragments(tmp_path):
    ranks = run_distributed(_resumed, 2, args=(str(tmp_path),), timeout=180)
    for runs in ranks:
        for name in ("diloco", "streaming", "carried"):
            assert torch.equal(runs[name]["resumed"]["weights"], runs[name]["straight"]["weights"]), name
            _assert_same(runs[name]["resumed"]["state"], runs[name]["straight"]["state"], name)
    for name in ("diloco", "streaming"):
        assert not torch.equal(ranks[0][name]["at_checkpoint"], ranks[1][name]["at_checkpoint"])
    checkpoint = torch.load(tmp_path / "streaming" / "resumed" / "mid.ckpt", weights_only=True)
    in_flight = [part["in_flight"] for part in checkpoint["strategy"]["by_rank"]]
    assert [part["fragment"] for part in in_flight] == [1, 1] and [part["apply_at"] for part in in_flight] == [7, 7]
    assert torch.equal(in_flight[0]["averages"][0], in_flight[1]["averages"][0])  # the average is every rank's
    carried = torch.load(tmp_path / "carried" / "resumed" / "mid.ckpt", weights_only=True)
    launched = [part["in_flight"]["launched_from"][0] for part in carried["strategy"]["by_rank"]]
    assert not torch.equal(launched[0], launched[1])  # each replica's own launch point is in its part


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 0}, "DiLoCo(period=0): period must be an int >= 1"),
        ({"outer_momentum": 1.0}, "DiLoCo(outer_momentum=1.0): outer_momentum must be below 1"),
        ({"period": 10, "fragments": 4}, "DiLoCo(period=10, fragments=4): fragments must divide period"),
        ({"period": 8, "fragments": 4, "overlap_steps": 2}, "overlap_steps must be below period / fragments = 2"),
        ({"alpha": 1.5}, "DiLoCo(alpha=1.5): alpha must be between 0 and 1"),
        ({"merge": "blend"}, "DiLoCo(merge='blend'): merge must be one of 'mix', 'carry'"),
        ({"merge": "carry", "alpha": 0.5}, "DiLoCo(merge='carry', alpha=0.5): alpha is the weight of the mix"),
        ({"compression": "fp4"}, "DiLoCo(compression='fp4'): compression must be one of 'none', 'bf16', 'uint8'"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        DiLoCo(**kwargs)
