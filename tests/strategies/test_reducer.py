"""The reducer: bucket layout, gradient views, overlap, and the rebuild in observed gradient order."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from syncline.strategies.comm.buckets import assign_buckets
from syncline.strategies.comm.reducer import Reducer
from syncline.strategies.comm.reducer_errors import UnusedParametersError
from syncline.testing import run_distributed

TINY_MB = 1e-9


# ------------------------------------------------------------ assign_buckets
def test_buckets_walk_the_given_order_and_respect_the_caps() -> None:
    params = [torch.empty(n) for n in (10, 10, 10, 10, 30, 10)]  # float32: 40, 40, 40, 40, 120, 40 bytes
    order = list(reversed(range(len(params))))
    layout = assign_buckets(params, order, bucket_cap_bytes=80, first_bucket_cap_bytes=40)
    # First bucket capped at 40 bytes; the 120-byte parameter is never split and sits alone.
    assert layout == [[5], [4], [3, 2], [1, 0]]
    for bucket in layout:
        nbytes = sum(params[i].numel() * 4 for i in bucket)
        assert nbytes <= 80 or len(bucket) == 1


def test_buckets_separate_dtypes_and_sort_by_first_parameter() -> None:
    params = [torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4), torch.empty(4)]
    layout = assign_buckets(params, [3, 1, 2, 0], bucket_cap_bytes=1 << 20, first_bucket_cap_bytes=1 << 20)
    assert layout == [[3, 2, 0], [1]]
    for bucket in layout:
        assert len({params[i].dtype for i in bucket}) == 1


def test_a_tiny_cap_gives_one_parameter_per_bucket() -> None:
    params = [torch.empty(3) for _ in range(4)]
    assert assign_buckets(params, [0, 1, 2, 3], 1, 1) == [[0], [1], [2], [3]]


# ------------------------------------------------ one rank, in this process
@pytest.fixture
def single_rank_group():
    """Join a gloo group of one in this process; leave it and restore the environment afterwards."""
    saved = dict(os.environ)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


class Chain(nn.Module):
    def __init__(self, width: int = 6, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _backward(reducer: Reducer, loss: torch.Tensor, sync: bool = True) -> None:
    reducer.prepare_for_backward(sync=sync, loss=loss)
    loss.backward()
    reducer.finalize_backward()


def _in_buffer(grad: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() and start <= grad.data_ptr() < end


@pytest.mark.usefixtures("single_rank_group")
def test_gradients_are_views_into_the_buckets_and_stay_so() -> None:
    torch.manual_seed(0)
    model = Chain()
    reducer = Reducer(list(model.named_parameters()), bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB)
    buffers = {id(p): b.buffer for b in reducer.buckets for p in b.parameters}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # across the rebuild after the first step, and zero_grad(set_to_none=False)
        for p in model.parameters():
            assert p.grad is not None and _in_buffer(p.grad, buffers[id(p)])
        _backward(reducer, model(torch.randn(4, 6)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        buffers = {id(p): b.buffer for b in reducer.buckets for p in b.parameters}
    # A user who sets .grad to None gets the view back on the next synchronized backward.
    optimizer.zero_grad(set_to_none=True)
    _backward(reducer, model(torch.randn(4, 6)))
    assert all(_in_buffer(p.grad, buffers[id(p)]) for p in model.parameters())


@pytest.mark.usefixtures("single_rank_group")
def test_without_views_gradients_are_copied_in_and_out() -> None:
    torch.manual_seed(0)
    model = Chain()
    expected = Chain()
    expected.load_state_dict(model.state_dict())
    reducer = Reducer(list(model.named_parameters()), gradient_as_bucket_view=False)
    x = torch.randn(4, 6)
    _backward(reducer, model(x))
    expected(x).backward()
    bucket = reducer.buckets[0].buffer
    for p, q in zip(model.parameters(), expected.parameters()):
        assert not _in_buffer(p.grad, bucket)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # world size 1: the average is the grad


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_launches_buckets_during_the_backward(overlap: bool) -> None:
    torch.manual_seed(0)
    model = Chain()
    reducer = Reducer(list(model.named_parameters()), bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB, overlap=overlap)
    launched_while_computing = []  # after each gradient's arrival (these hooks run after the reducer's)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: launched_while_computing.append(reducer.collectives_launched))
    _backward(reducer, model(torch.randn(4, 6)))
    assert reducer.collectives_launched == len(reducer.buckets)
    if overlap:
        # Before the last gradient arrives, every other bucket is already on the wire.
        assert launched_while_computing[:-1] == list(range(1, len(reducer.buckets)))
    else:
        assert max(launched_while_computing) == 0


@pytest.mark.usefixtures("single_rank_group")
def test_an_unused_parameter_is_named_and_skipped_backwards_need_none() -> None:
    model = Chain()
    model.extra = nn.Linear(2, 2)
    reducer = Reducer(list(model.named_parameters()))
    loss = model(torch.randn(4, 6))
    _backward(reducer, loss, sync=False)  # a backward that does not sync checks nothing
    with pytest.raises(UnusedParametersError, match=r"extra\.weight, extra\.bias.*find_unused_parameters=True"):
        _backward(reducer, model(torch.randn(4, 6)))


@pytest.mark.usefixtures("single_rank_group")
def test_a_hook_returning_a_new_tensor_is_copied_into_the_bucket() -> None:
    def doubled(state: None, bucket) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(bucket.buffer * 2)
        return future

    model = Chain()
    expected = Chain()
    expected.load_state_dict(model.state_dict())
    reducer = Reducer(list(model.named_parameters()), comm_hook=doubled)
    x = torch.randn(4, 6)
    _backward(reducer, model(x))
    expected(x).backward()
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad)
    assert reducer.stats().collectives == len(reducer.buckets)


# ------------------------------------------------------- rebuild, two ranks
class Shuffled(nn.Module):
    """Three layers whose order of use depends on the rank, so gradients arrive in a rank's own order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        first, second, third = (self.b, self.a, self.c) if rank == 0 else (self.c, self.b, self.a)
        return third(torch.tanh(second(torch.tanh(first(x))))).square().mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(10 * step + rank))


def _rebuild(rank: int, world_size: int, steps: int) -> dict:
    from syncline.strategies.comm.process_group import init_process_group_from_env

    init_process_group_from_env()
    torch.manual_seed(0)
    model = Shuffled()
    reducer = Reducer(list(model.named_parameters()), bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB)
    initial = reducer.bucket_layout
    observed: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: observed.append(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layouts = []
    for step in range(steps):
        _backward(reducer, model(_batch(step, rank), rank))
        layouts.append(reducer.bucket_layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {
        "initial": initial,
        "observed_first_step": observed[: len(initial)],
        "layouts": layouts,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _reference_rebuild(steps: int) -> dict[str, torch.Tensor]:
    """Average the two ranks' gradients by hand, in one process."""
    torch.manual_seed(0)
    model = Shuffled()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        for rank in (0, 1):
            (model(_batch(step, rank), rank) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_buckets_are_rebuilt_once_in_rank_0s_observed_order() -> None:
    steps = 3
    rank0, rank1 = run_distributed(_rebuild, 2, args=(steps,), timeout=60)
    names = ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]
    assert [n for bucket in rank0["initial"] for n in bucket] == list(reversed(names))
    # The ranks saw different orders; both adopt rank 0's, one parameter per bucket.
    assert rank0["observed_first_step"] != rank1["observed_first_step"]
    expected = [[name] for name in rank0["observed_first_step"]]
    assert expected != rank0["initial"]
    for result in (rank0, rank1):
        assert result["layouts"] == [expected] * steps
    # The rebuild (at the end of the first step) kept the averaged gradients intact.
    reference = _reference_rebuild(steps)
    for result in (rank0, rank1):
        for name, value in reference.items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0)


@pytest.mark.usefixtures("single_rank_group")
def test_a_sparse_gradient_the_reducer_was_not_told_about_is_named() -> None:
    # Declared sparse by BucketedDDP for nn.Embedding(sparse=True); a bare Reducer is not told.
    embedding = nn.Embedding(10, 3, sparse=True)
    reducer = Reducer(list(embedding.named_parameters()), gradient_as_bucket_view=False)
    with pytest.raises(TypeError, match=r"weight received a torch.sparse_coo gradient.*sparse=True"):
        _backward(reducer, embedding(torch.tensor([1, 2])).sum())
