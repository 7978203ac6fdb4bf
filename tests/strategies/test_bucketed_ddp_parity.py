"""BucketedDDP on the cases real models hit, against torch's DDP and single-process training.

Each test names the difference from torch's DDP it closes. Every run starts real processes (gloo on
127.0.0.1, see `testing.py`) and compares parameters or gradients with a stated tolerance.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from syncline.strategies import BucketedDDP, NativeDDP
from syncline.strategies.comm.process_group import init_process_group_from_env
from syncline.testing import run_distributed, run_ranks

GLOBAL_BATCH = 8
STEPS = 4
FREEZE_AT = 2  # the step at which a "callback" freezes the first layer


class Net(nn.Module):
    """Three layers; the first can be frozen, the auxiliary head's output never enters the loss."""

    def __init__(self, return_aux: bool = False) -> None:
        super().__init__()
        self.return_aux = return_aux
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 3)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict:
        x, y = batch
        hidden = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        loss = F.mse_loss(self.head(hidden), y)
        if not self.return_aux:
            return {"loss": loss}  # `aux` is never used
        # A tensor the task returns for logging: computed from parameters, but not part of the loss.
        return {"loss": loss, "aux": self.aux(hidden)}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 4, generator=generator), torch.randn(GLOBAL_BATCH, 2, generator=generator)


def shard(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(world_size)[rank] for t in batch)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name.removeprefix("task."): p.detach().clone() for name, p in model.named_parameters()}


def make_strategy(kind: str, **kwargs):
    return BucketedDDP(**kwargs) if kind == "bucketed" else NativeDDP(**kwargs)


# -------------------------------------------------- 1. frozen parameters stay put
def _freeze_during_training(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    results = {}
    for kind in ("bucketed", "native"):
        for as_view in (True, False):
            torch.manual_seed(0)
            model = Net()
            strategy = make_strategy(kind, find_unused_parameters=True, gradient_as_bucket_view=as_view)
            strategy.setup_environment()
            strategy.setup(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
            frozen_grad_is_none = []
            for step in range(STEPS):
                if step == FREEZE_AT:
                    model.l1.requires_grad_(False)  # what a fine-tuning callback does
                output = strategy.training_step(model, shard(global_batch(step), rank, world_size), step)
                strategy.backward(output["loss"], sync=True)
                if step >= FREEZE_AT:
                    frozen_grad_is_none.append(model.l1.weight.grad is None and model.l1.bias.grad is None)
                optimizer.step()
                strategy.zero_grad(optimizer)
            strategy.teardown()
            results[(kind, as_view)] = {"params": params_of(model), "frozen_grad_is_none": frozen_grad_is_none}
    return results


def _reference_freeze() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        if step == FREEZE_AT:
            model.l1.requires_grad_(False)
        model.training_step(global_batch(step), step)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


def test_a_layer_frozen_during_training_stays_put_under_adamw() -> None:
    per_rank = run_distributed(_freeze_during_training, 2, timeout=90)
    expected = _reference_freeze()
    for results in per_rank:
        for key, result in results.items():
            # As in torch, a parameter no rank used in a step ends it with .grad None ...
            assert result["frozen_grad_is_none"] == [True] * (STEPS - FREEZE_AT), key
            # ... so AdamW's weight decay and momentum leave it where single-process training does.
            for name, value in expected.items():
                torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0, msg=f"{key} {name}")


# ------------------------------------- 3. an output that does not enter the loss
def _aux_output(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    results = {}
    for kind in ("native", "bucketed"):
        torch.manual_seed(0)
        model = Net(return_aux=True)
        strategy = make_strategy(kind, find_unused_parameters=True)
        strategy.setup_environment()
        strategy.setup(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        aux_grad_is_none = []
        for step in range(STEPS):
            output = strategy.training_step(model, shard(global_batch(step), rank, world_size), step)
            strategy.backward(output["loss"], sync=True)
            aux_grad_is_none.append(model.aux.weight.grad is None)
            optimizer.step()
            strategy.zero_grad(optimizer)
        strategy.teardown()
        results[kind] = {"params": params_of(model), "aux_grad_is_none": aux_grad_is_none}
    return results


def _reference_aux() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(return_aux=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        model.training_step(global_batch(step), step)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


def test_an_output_outside_the_loss_is_not_mistaken_for_a_used_parameter() -> None:
    per_rank = run_distributed(_aux_output, 2, timeout=60)
    expected = _reference_aux()
    for results in per_rank:
        for kind, result in results.items():
            assert result["aux_grad_is_none"] == [True] * STEPS, kind
            for name, value in expected.items():
                torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0, msg=f"{kind} {name}")


# ------------------------------------------- 6. a bare loss.backward() is caught
def _hand_written_loop(rank: int, world_size: int, bare: bool) -> dict:
    strategy = BucketedDDP(find_unused_parameters=True)  # `aux` is never used
    strategy.setup_environment()
    torch.manual_seed(0)
    model = Net()
    strategy.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first, second = (shard(global_batch(step), rank, world_size) for step in (0, 1))
    if bare:
        model.training_step(first, 0)["loss"].backward()  # the mistake: the strategy never sees it
        optimizer.step()
        return {}
    # Local accumulation with a bare backward inside no_sync, then a synchronized one: allowed.
    with strategy.no_sync():
        (model.training_step(first, 0)["loss"] / 2).backward()
    strategy.backward(model.training_step(second, 1)["loss"] / 2, sync=True)
    optimizer.step()
    strategy.zero_grad(optimizer)
    # A deliberate local step inside no_sync is allowed too (and changes nothing here: lr 0).
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    with strategy.no_sync():
        model.training_step(first, 0)["loss"].backward()
        optimizer.step()
    strategy.teardown()
    return params_of(model)


def test_an_optimizer_step_after_a_bare_loss_backward_raises() -> None:
    outcomes = run_ranks(_hand_written_loop, 2, args=(True,), timeout=60)
    for outcome in outcomes:
        assert outcome.error is not None and "never averaged" in outcome.error, outcome.error
        assert "l1.weight" in outcome.error and "strategy.backward(loss, sync=True)" in outcome.error
    # The same loop through strategy.backward, with local accumulation, trains as one process does.
    per_rank = run_distributed(_hand_written_loop, 2, args=(False,), timeout=60)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (torch.cat(parts) for parts in zip(global_batch(0), global_batch(1)))
    model.training_step((x, y), 0)["loss"].backward()
    optimizer.step()
    for params in per_rank:
        for name, value in params_of(model).items():
            torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0, msg=name)


# ------------------------------------------------------------- 7. smaller ones
def _retain_graph(rank: int, world_size: int) -> dict:
    strategy = BucketedDDP()
    strategy.setup_environment()
    torch.manual_seed(0)
    model = Net()
    model.aux.requires_grad_(False)
    strategy.setup(model)
    loss = strategy.training_step(model, shard(global_batch(0), rank, world_size), 0)["loss"]
    strategy.backward(loss, sync=True, retain_graph=True)
    strategy.backward(loss, sync=True)  # the graph is still there, and this backward is averaged too
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def test_backward_takes_retain_graph() -> None:
    per_rank = run_distributed(_retain_graph, 2, timeout=60)
    torch.manual_seed(0)
    model = Net()
    loss = model.training_step(global_batch(0), 0)["loss"]
    loss.backward(retain_graph=True)
    loss.backward()
    for grads in per_rank:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, atol=1e-6, rtol=0)


class LazyNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.LazyLinear(8)


def _setup_lazy(rank: int, world_size: int) -> None:
    strategy = BucketedDDP()
    strategy.setup_environment()
    strategy.setup(LazyNet())


def test_uninitialized_lazy_parameters_fail_at_setup_saying_so() -> None:
    for outcome in run_ranks(_setup_lazy, 2, timeout=60):
        assert outcome.error is not None and "ValueError" in outcome.error
        assert "l1.weight, l1.bias are not initialized yet" in outcome.error
        assert "Run one forward on a sample batch" in outcome.error


def _thaw_or_freeze(rank: int, world_size: int, change: str) -> None:
    strategy = BucketedDDP()
    strategy.setup_environment()
    torch.manual_seed(0)
    model = Net()
    model.aux.requires_grad_(False)
    if change == "thaw":
        model.l1.requires_grad_(False)  # frozen at setup: left out of the buckets
    strategy.setup(model)
    for step in range(2):
        if step == 1:
            model.l1.requires_grad_(change == "thaw")
        loss = strategy.training_step(model, shard(global_batch(step), rank, world_size), step)["loss"]
        strategy.backward(loss, sync=True)


def test_a_parameter_frozen_at_setup_and_thawed_later_raises() -> None:
    # torch's DDP silently stops averaging such a parameter, and the replicas drift apart.
    for outcome in run_ranks(_thaw_or_freeze, 2, args=("thaw",), timeout=60):
        assert outcome.error is not None and "l1.weight, l1.bias did not require grad when" in outcome.error
        assert "replicas would drift apart" in outcome.error


def test_a_layer_frozen_after_setup_without_detection_is_named_as_frozen() -> None:
    for outcome in run_ranks(_thaw_or_freeze, 2, args=("freeze",), timeout=60):
        assert outcome.error is not None and "UnusedParametersError" in outcome.error
        assert "Frozen (requires_grad=False) after the strategy was set up: l1.weight, l1.bias" in outcome.error
        assert "strategy.find_unused_parameters=true" in outcome.error


# ------------------------------------------------------------ 2. sparse gradients
class Bag(nn.Module):
    """A sparse embedding (trained by SparseAdam) under a dense head (trained by SGD with momentum)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict:
        tokens, y = batch
        return {"loss": F.mse_loss(self.head(self.embedding(tokens).mean(1)), y)}


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(700 + step)
    # Ranks see different rows of the table; some rows no rank sees.
    tokens = torch.randint(0, 16, (GLOBAL_BATCH, 3), generator=generator)
    return tokens, torch.randn(GLOBAL_BATCH, 2, generator=generator)


def bag_optimizers(model: Bag) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.05),
        torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9),
    ]


def _sparse(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    results = {}
    for kind, as_view, find_unused in [
        ("native", False, False),
        ("bucketed", True, False),
        ("bucketed", False, False),
        ("bucketed", True, True),
    ]:
        torch.manual_seed(0)
        model = Bag()
        strategy = make_strategy(kind, gradient_as_bucket_view=as_view, find_unused_parameters=find_unused)
        strategy.setup_environment()
        strategy.setup(model)
        optimizers = bag_optimizers(model)
        stays_sparse = []
        for step in range(STEPS):
            output = strategy.training_step(model, shard(token_batch(step), rank, world_size), step)
            strategy.backward(output["loss"], sync=True)
            stays_sparse.append(model.embedding.weight.grad.is_sparse)
            for optimizer in optimizers:
                optimizer.step()
                strategy.zero_grad(optimizer)
        strategy.teardown()
        results[(kind, as_view, find_unused)] = {"params": params_of(model), "stays_sparse": stays_sparse}
    return results


def test_sparse_gradients_are_reduced_sparse_and_train_like_one_process() -> None:
    per_rank = run_distributed(_sparse, 2, timeout=90)
    torch.manual_seed(0)
    model = Bag()
    optimizers = bag_optimizers(model)
    for step in range(STEPS):
        model.training_step(token_batch(step), step)["loss"].backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    expected = params_of(model)
    for results in per_rank:
        for key, result in results.items():
            assert result["stays_sparse"] == [True] * STEPS, key
            for name, value in expected.items():
                torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0, msg=f"{key} {name}")


# ------------------------------------------------------------------ static_graph
def _static_graph(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    results = {}
    for kind in ("bucketed", "native"):
        torch.manual_seed(0)
        model = Net()  # `aux` is never used: the static graph has an unused layer
        strategy = make_strategy(kind, static_graph=True)
        strategy.setup_environment()
        strategy.setup(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        collectives = []
        for step in range(STEPS):
            output = strategy.training_step(model, shard(global_batch(step), rank, world_size), step)
            strategy.backward(output["loss"], sync=True)
            collectives.append(strategy.communication_stats().get("comm/collectives"))
            optimizer.step()
            strategy.zero_grad(optimizer)
        strategy.teardown()
        results[kind] = {"params": params_of(model), "collectives": collectives}
    return results


def test_static_graph_finds_unused_parameters_once_and_trains_like_torch() -> None:
    per_rank = run_distributed(_static_graph, 2, timeout=60)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        model.training_step(global_batch(step), step)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = params_of(model)
    for results in per_rank:
        for kind, result in results.items():
            for name, value in expected.items():
                torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0, msg=f"{kind} {name}")
        # The used-parameter map is all-reduced in the first step only; then one collective per bucket.
        first, *rest = results["bucketed"]["collectives"]
        assert first == rest[0] + 1 and len(set(rest)) == 1


# ------------------------- checkpointing, gradient penalty, rank-dependent gradient order
class Tricky(nn.Module):
    """Activation checkpointing, a gradient penalty, and layers used in a rank-dependent order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict:
        x, y = batch
        x = x.clone().requires_grad_(True)
        hidden = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
        first, second = (self.b, self.c) if torch.distributed.get_rank() == 0 else (self.c, self.b)
        out = self.head(torch.tanh(second(torch.tanh(first(hidden)))))
        loss = F.mse_loss(out, y)
        (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
        return {"loss": loss + 0.1 * grad_x.square().sum()}


def _tricky(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    results = {}
    for kind, kwargs in [
        ("native", {}),
        ("bucketed", {}),
        ("bucketed", {"bucket_cap_mb": 1e-9, "first_bucket_mb": 1e-9}),
    ]:
        torch.manual_seed(0)
        model = Tricky()
        strategy = make_strategy(kind, **kwargs)
        strategy.setup_environment()
        strategy.setup(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            output = strategy.training_step(model, shard(global_batch(step), rank, world_size), step)
            strategy.backward(output["loss"], sync=True)
            optimizer.step()
            strategy.zero_grad(optimizer)
        strategy.teardown()
        results[(kind, bool(kwargs))] = params_of(model)
    return results


def test_checkpointing_gradient_penalty_and_rank_dependent_order_match_torch_ddp() -> None:
    per_rank = run_distributed(_tricky, 2, timeout=90)
    for results in per_rank:
        native = results[("native", False)]
        for key in [("bucketed", False), ("bucketed", True)]:
            for name, value in native.items():
                torch.testing.assert_close(results[key][name], value, atol=1e-6, rtol=0, msg=f"{key} {name}")
    assert all(torch.equal(per_rank[0][key][n], per_rank[1][key][n]) for key in per_rank[0] for n in per_rank[0][key])


# --------------------- a gradient the user keeps (no zero_grad) survives a step that does not use it
class Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.branch = nn.Linear(8, 2)
        self.head = nn.Linear(8, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict:
        x, y = batch
        hidden = torch.tanh(self.trunk(x))
        out = self.branch(hidden) if batch_idx == 0 else self.head(hidden)
        return {"loss": F.mse_loss(out, y)}


def _kept_gradients(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    results = {}
    for kind in ("bucketed", "native"):
        for as_view in (True, False):
            torch.manual_seed(0)
            model = Switch()
            strategy = make_strategy(kind, find_unused_parameters=True, gradient_as_bucket_view=as_view)
            strategy.setup_environment()
            strategy.setup(model)
            for step in range(2):  # the user accumulates across synchronized steps: no zero_grad
                output = strategy.training_step(model, shard(global_batch(step), rank, world_size), step)
                strategy.backward(output["loss"], sync=True)
            strategy.teardown()
            results[(kind, as_view)] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return results


def test_a_kept_gradient_survives_a_step_that_does_not_use_it() -> None:
    for results in run_distributed(_kept_gradients, 2, timeout=60):
        for as_view in (True, False):
            native = {n.removeprefix("task."): g for n, g in results[("native", as_view)].items()}
            for name, grad in results[("bucketed", as_view)].items():
                torch.testing.assert_close(grad, native[name], atol=1e-6, rtol=0, msg=f"{as_view} {name}")


def test_native_ddp_leaves_torchs_default_broadcast_buffers_out() -> None:
    """broadcast_buffers=True (the Hydra config's value, torch's default) is not passed: torch deprecates the
    argument and warned on every rank; False, a real choice, still reaches DistributedDataParallel."""
    assert "broadcast_buffers" not in NativeDDP(broadcast_buffers=True).ddp_kwargs
    assert NativeDDP(broadcast_buffers=False).ddp_kwargs == {"broadcast_buffers": False}
