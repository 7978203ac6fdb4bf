"""BucketedDDP against single-process training on the global batch and against torch's DDP.

Every test starts real processes (gloo on 127.0.0.1, see `testing.py`); several checks share one run
because starting a process group costs more than the checks themselves.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from syncline.strategies import STRATEGIES, BucketedDDP, NativeDDP, resolve_strategy
from syncline.strategies.comm.process_group import init_process_group_from_env
from syncline.strategies.comm.reducer_errors import CollectiveError, UnusedParametersError
from syncline.testing import run_distributed, run_ranks

GLOBAL_BATCH = 12  # divisible by 2 and 3, so every world size shards it evenly
TINY_MB = 1e-9  # smaller than any parameter: one parameter per bucket
HUGE_MB = 1e3  # larger than the model: one bucket


class Net(nn.Module):
    """Parameters of several sizes, so bucket caps change the layout."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 16)
        self.l2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(self.l2(torch.tanh(self.l1(x))))), y)


class BranchNet(nn.Module):
    """A trunk with BatchNorm, a branch used only on some batches and ranks, a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.branch = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, bool], batch_idx: int) -> dict:
        x, y, use_branch = batch
        hidden = torch.tanh(self.norm(self.trunk(x)))
        if use_branch:
            hidden = hidden + torch.tanh(self.branch(hidden))
        return {"loss": F.mse_loss(self.head(hidden), y), "hidden": hidden.detach()}


def global_batch(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 4, generator=generator), torch.randn(size, 2, generator=generator)


def shard(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(world_size)[rank] for t in batch)


def uses_branch(rank: int, batch_idx: int) -> bool:
    """All ranks, only rank 0, or no rank use the branch, in turn."""
    phase = batch_idx % 3
    return phase == 0 or (phase == 1 and rank == 0)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def assert_same(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        if expected[name] is None or actual[name] is None:
            assert actual[name] is None and expected[name] is None, f"{name}: one .grad is None, the other not"
        else:
            torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0, msg=name)


def make_net(rank: int) -> Net:
    # A different initialization per rank: setup must replace it with rank 0's.
    torch.manual_seed(rank)
    return Net()


def reference_sgd(steps: int, accumulate: int = 1, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """Train on the whole global batch in one process (rank 0's initialization)."""
    model = make_net(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        batches = [global_batch(step * accumulate + i) for i in range(accumulate)]
        x, y = (torch.cat(parts) for parts in zip(*batches))
        model.training_step((x, y), step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


# ------------------------------------------------------------ vs single process
def _train_with_caps(rank: int, world_size: int, steps: int) -> dict:
    # One group for all strategies of the run: re-joining on the same port races with its teardown.
    init_process_group_from_env()
    results = {}
    for cap_name, cap in [("tiny", TINY_MB), ("default", None), ("huge", HUGE_MB)]:
        for as_view in (True, False):
            caps = {} if cap is None else {"bucket_cap_mb": cap, "first_bucket_mb": cap}
            strategy = BucketedDDP(gradient_as_bucket_view=as_view, **caps)
            strategy.setup_environment()
            model = make_net(rank)
            strategy.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(steps):
                batch = shard(global_batch(step), rank, world_size)
                strategy.backward(strategy.training_step(model, batch, step), sync=True)
                optimizer.step()
                strategy.zero_grad(optimizer)
            results[(cap_name, as_view)] = (params_of(model), len(strategy.reducer.buckets))
            strategy.teardown()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process_on_the_global_batch(world_size: int) -> None:
    steps = 3
    per_rank = run_distributed(_train_with_caps, world_size, args=(steps,), timeout=90)
    expected = reference_sgd(steps)
    num_params = len(expected)
    for results in per_rank:
        for (cap_name, as_view), (params, num_buckets) in results.items():
            assert_same(params, expected, atol=1e-5)
            if cap_name == "tiny":
                assert num_buckets == num_params, (cap_name, as_view)
            if cap_name == "huge":
                assert num_buckets == 1, (cap_name, as_view)


# ------------------------------------------------------------- accumulation
def _accumulate(rank: int, world_size: int, accumulate: int) -> dict:
    from torch.profiler import profile

    strategy = BucketedDDP(bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB)
    strategy.setup_environment()
    model = make_net(rank)
    strategy.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    launched_during_skipped = []
    gloo_ops_during_skipped = []
    gloo_ops_during_sync = 0
    for i in range(accumulate):
        sync = i == accumulate - 1
        batch = shard(global_batch(i), rank, world_size)
        loss = strategy.training_step(model, batch, i) / accumulate
        before = strategy.reducer.collectives_launched
        with profile() as prof:
            strategy.backward(loss, sync=sync)
        gloo_ops = sum(1 for event in prof.events() if event.name.startswith("gloo:"))
        if sync:
            gloo_ops_during_sync = gloo_ops
        else:
            launched_during_skipped.append(strategy.reducer.collectives_launched - before)
            gloo_ops_during_skipped.append(gloo_ops)
    strategy.optimizer_step(optimizer, optimizer.step)
    stats = strategy.communication_stats()
    return {
        "params": params_of(model),
        "launched_during_skipped": launched_during_skipped,
        "gloo_ops_during_skipped": gloo_ops_during_skipped,
        "gloo_ops_during_sync": gloo_ops_during_sync,
        "buckets": len(strategy.reducer.buckets),
        "stats": stats,
    }


def test_accumulation_equals_one_step_on_a_4x_batch_and_skipped_backwards_communicate_nothing() -> None:
    accumulate = 4
    per_rank = run_distributed(_accumulate, 2, args=(accumulate,), timeout=60)
    expected = reference_sgd(steps=1, accumulate=accumulate)
    for result in per_rank:
        assert_same(result["params"], expected, atol=1e-5)
        assert result["launched_during_skipped"] == [0] * (accumulate - 1)
        # The profiler sees the gloo collectives themselves, independently of the reducer's counter.
        assert result["gloo_ops_during_skipped"] == [0] * (accumulate - 1)
        assert result["gloo_ops_during_sync"] >= result["buckets"]
        assert result["stats"]["comm/collectives"] == result["buckets"]
        assert result["stats"]["comm/skipped_backwards"] == accumulate - 1
        assert result["stats"]["comm/bytes"] == 4 * sum(p.numel() for p in expected.values())
        assert result["stats"]["comm/exposed_ms"] >= 0


# ----------------------------------------------------- vs torch's DDP (unused)
def _branch_batch(rank: int, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    x, y = shard(global_batch(batch_idx, size=8), rank, 2)
    return x + rank, y, uses_branch(rank, batch_idx)  # different data per rank: BatchNorm stats differ


def _fit_branch_net(strategy, rank: int, accumulate: int, zero_grads_first: bool) -> dict:
    torch.manual_seed(rank)
    model = BranchNet()
    if zero_grads_first:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    strategy.setup_environment()
    strategy.setup(model)
    # Momentum and weight decay make a None gradient behave differently from a zero one.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    synced_grads, buffers = [], []
    for batch_idx in range(6 * accumulate):
        sync = (batch_idx + 1) % accumulate == 0
        strategy.sync_next_backward = sync
        output = strategy.training_step(model, _branch_batch(rank, batch_idx), batch_idx)
        strategy.backward(output["loss"] / accumulate, sync=sync)
        if sync:
            synced_grads.append(grads_of(model))
            buffers.append({name: b.clone() for name, b in model.named_buffers()})
            optimizer.step()
            strategy.zero_grad(optimizer)
    strategy.teardown()
    return {"params": params_of(model), "grads": synced_grads, "buffers": buffers}


def _compare_with_native(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    results = {}
    for accumulate in (1, 3):
        for as_view in (True, False):
            native = NativeDDP(find_unused_parameters=True, gradient_as_bucket_view=as_view)
            ours = BucketedDDP(find_unused_parameters=True, gradient_as_bucket_view=as_view, bucket_cap_mb=TINY_MB)
            # Gradients set before setup are kept (and turned into views) by both.
            zero_grads_first = accumulate == 3
            results[(accumulate, as_view)] = (
                _fit_branch_net(native, rank, accumulate, zero_grads_first),
                _fit_branch_net(ours, rank, accumulate, zero_grads_first),
            )
    # torch's DDP fixes synchronization in the forward: a backward that disagrees must raise.
    native, model = NativeDDP(), Net()
    native.setup(model)
    native.sync_next_backward = False
    loss = native.training_step(model, shard(global_batch(0), rank, world_size), 0)
    with pytest.raises(RuntimeError, match="sync_next_backward"):
        native.backward(loss, sync=True)
    return results


def test_matches_torch_ddp_with_unused_parameters() -> None:
    per_rank = run_distributed(_compare_with_native, 2, timeout=90)
    for results in per_rank:
        for native, ours in results.values():
            assert len(ours["grads"]) == len(native["grads"]) == 6
            for ours_grads, native_grads in zip(ours["grads"], native["grads"]):
                # Native's parameters are registered under the wrapper's "task." prefix.
                native_grads = {name.removeprefix("task."): g for name, g in native_grads.items()}
                assert_same(ours_grads, native_grads, atol=1e-6)
            for ours_buffers, native_buffers in zip(ours["buffers"], native["buffers"]):
                assert_same(ours_buffers, {n.removeprefix("task."): b for n, b in native_buffers.items()}, 1e-6)
            native_params = {name.removeprefix("task."): p for name, p in native["params"].items()}
            assert_same(ours["params"], native_params, atol=1e-6)
            # The never-used layer ends each step with .grad None, views or not, as in torch.
            assert ours["grads"][-1]["never.weight"] is None
    # After every synchronized step the replicas agree.
    for key in per_rank[0]:
        assert_same(per_rank[0][key][1]["params"], per_rank[1][key][1]["params"], atol=0)


# ------------------------------------------------------------------- errors
def _unused_without_detection(rank: int, world_size: int, divergent: bool) -> None:
    strategy = BucketedDDP(bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB, timeout=3.0)
    strategy.setup_environment()
    torch.manual_seed(0)
    model = BranchNet()
    if divergent:
        model.never.requires_grad_(False)  # leave the branch as the only unused layer
    strategy.setup(model)
    use_branch = rank == 0 if divergent else True
    x, y = shard(global_batch(0, size=8), rank, world_size)
    output = strategy.training_step(model, (x, y, use_branch), 0)
    try:
        strategy.backward(output["loss"], sync=True)
    finally:
        if divergent and rank == 1:
            time.sleep(5)  # stay in the group, so rank 0 runs into its timeout rather than a reset


def test_unused_parameter_without_detection_names_it() -> None:
    start = time.monotonic()
    outcomes = run_ranks(_unused_without_detection, 2, args=(False,), timeout=60)
    for outcome in outcomes:
        assert outcome.error is not None
        assert UnusedParametersError.__name__ in outcome.error
        assert "never.weight" in outcome.error and "never.bias" in outcome.error
        # Where the fix goes: the strategy's argument in code, its config key on the command line.
        assert "strategy=BucketedDDP(find_unused_parameters=True)" in outcome.error
        assert "strategy=bucketed_ddp strategy.find_unused_parameters=true" in outcome.error
    assert time.monotonic() - start < 30


def test_parameter_unused_on_one_rank_fails_both_within_the_timeout() -> None:
    outcomes = run_ranks(_unused_without_detection, 2, args=(True,), timeout=60)
    rank0, rank1 = (outcome.error or "" for outcome in outcomes)
    assert UnusedParametersError.__name__ in rank1 and "branch.weight" in rank1
    # Rank 0 used the branch and waits for a bucket rank 1 never launches, until the timeout.
    assert CollectiveError.__name__ in rank0
    assert "Rank 0" in rank0 and "gradient bucket" in rank0 and "allreduce_hook" in rank0


def _mismatched(rank: int, world_size: int, kind: str) -> None:
    strategy = BucketedDDP()
    strategy.setup_environment()
    model = make_net(rank)
    if rank == 1 and kind == "shape":
        model.l2 = nn.Linear(16, 17)
    if rank == 1 and kind == "extra":
        model.extra = nn.Linear(2, 2)
    strategy.setup(model)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("shape", "parameter 'l2.weight' is (shape=(16, 16)"),
        ("extra", "parameter 'extra.weight' exists on rank 1 but not on rank 0"),
    ],
)
def test_mismatched_models_fail_at_setup(kind: str, message: str) -> None:
    outcomes = run_ranks(_mismatched, 2, args=(kind,), timeout=60)
    for outcome in outcomes:
        assert outcome.error is not None and "ValueError" in outcome.error
        assert message in outcome.error and "rank 1" in outcome.error


# ------------------------------------------- interface: collectives, no_sync
def _interface(rank: int, world_size: int) -> dict:
    strategy = BucketedDDP()
    assert strategy.world_size == world_size and strategy.global_rank == rank  # from the environment
    strategy.setup_environment()
    model = make_net(rank)
    strategy.setup(model)
    value = torch.tensor([float(rank + 1)])
    result = {
        "mean": strategy.reduce(value, "mean").item(),
        "sum": strategy.reduce(value, "sum").item(),
        "max": strategy.reduce(value, "max").item(),
        "input_untouched": value.item(),
        "gathered": strategy.all_gather_object({"rank": rank}),
        "broadcast": strategy.broadcast_object(f"from {rank}", src=1),
        "sampler": strategy.distributed_sampler_kwargs,
    }
    strategy.barrier()

    batch = shard(global_batch(0), rank, world_size)
    with strategy.no_sync():
        strategy.backward(strategy.training_step(model, batch, 0), sync=True)
    result["launched_in_no_sync"] = strategy.reducer.collectives_launched
    result["local_grad"] = model.l1.weight.grad.clone()

    strategy.teardown()
    model.zero_grad()
    model.training_step(batch, 0).backward()
    result["grad_after_teardown"] = model.l1.weight.grad.clone()
    result["hooks_left"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return result


def test_collectives_no_sync_and_teardown() -> None:
    per_rank = run_distributed(_interface, 2, timeout=60)
    for rank, result in enumerate(per_rank):
        assert (result["mean"], result["sum"], result["max"]) == (1.5, 3.0, 2.0)
        assert result["input_untouched"] == rank + 1
        assert result["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert result["broadcast"] == "from 1"
        assert result["sampler"] == {"num_replicas": 2, "rank": rank}
        assert result["launched_in_no_sync"] == 0
        # Without synchronization and after teardown, each rank keeps its own local gradient.
        torch.testing.assert_close(result["grad_after_teardown"], result["local_grad"])
        assert result["hooks_left"] == 0
    assert not torch.equal(per_rank[0]["local_grad"], per_rank[1]["local_grad"])


def test_joining_without_a_launcher_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher variables: one process on one device (tests/strategies/test_process_group.py has more)."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    strategy = BucketedDDP()
    strategy.setup_environment()
    assert (strategy.global_rank, strategy.world_size) == (0, 1)


def test_registered_under_config_names() -> None:
    assert STRATEGIES["bucketed_ddp"] is BucketedDDP
    assert STRATEGIES["native_ddp"] is NativeDDP
    strategy = resolve_strategy("auto", devices=2, bucket_cap_mb=5)
    assert isinstance(strategy, BucketedDDP) and strategy.bucket_cap_mb == 5
    with pytest.raises(ValueError, match="Unknown comm_hook"):
        BucketedDDP(comm_hook="gzip")
