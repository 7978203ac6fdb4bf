"""Comm hooks on real gloo groups: averaging, fp16 compression, and composition of wrappers."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from syncline.strategies.bucketed_ddp import BucketedDDP
from syncline.strategies.comm.hooks import (
    AllreduceState,
    GradBucket,
    allreduce_hook,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from syncline.strategies.comm.process_group import init_process_group_from_env
from syncline.testing import run_distributed

FP16_RTOL = 1e-3  # float16 keeps 11 significant bits: about 5e-4 relative error per rounding


def _bucket(values: torch.Tensor) -> GradBucket:
    return GradBucket(index=0, buffer=values, parameters=[], offsets=[0])


def _hooks(rank: int, world_size: int) -> dict:
    init_process_group_from_env()
    state = AllreduceState()
    local = torch.linspace(-1, 1, 101) * (rank + 1) / 3

    bucket = _bucket(local.clone())
    reduced = allreduce_hook(state, bucket).wait()

    fp16_bucket = _bucket(local.clone())
    fp16_reduced = fp16_compress_hook(state, fp16_bucket).wait()

    # Summing first would overflow float16 (max 65504); dividing before the all-reduce does not.
    large = fp16_compress_hook(state, _bucket(torch.full((4,), 40000.0))).wait()
    # A local gradient beyond float16's range whose average is within it: dividing before the cast keeps it.
    beyond_fp16 = fp16_compress_hook(state, _bucket(torch.full((4,), 70000.0 if rank == 0 else 0.0))).wait()

    seen_dtypes = []

    def recording_hook(state: AllreduceState, bucket: GradBucket) -> torch.futures.Future:
        seen_dtypes.append(bucket.buffer.dtype)
        return allreduce_hook(state, bucket)

    composed = fp16_compress_wrapper(recording_hook)(state, _bucket(local.clone())).wait()
    return {
        "local": local,
        "reduced": reduced,
        "reduced_in_place": reduced.data_ptr() == bucket.buffer.data_ptr(),
        "fp16": fp16_reduced,
        "fp16_dtype_and_place": (fp16_reduced.dtype, fp16_reduced.data_ptr() == fp16_bucket.buffer.data_ptr()),
        "large": large,
        "beyond_fp16": beyond_fp16,
        "seen_dtypes": seen_dtypes,
        "composed": composed,
    }


def test_allreduce_averages_and_fp16_stays_close() -> None:
    world_size = 3
    per_rank = run_distributed(_hooks, world_size, timeout=60)
    average = sum(result["local"] for result in per_rank) / world_size
    for result in per_rank:
        torch.testing.assert_close(result["reduced"], average, atol=1e-7, rtol=1e-6)
        assert result["reduced_in_place"]
        torch.testing.assert_close(result["fp16"], average, atol=1e-4, rtol=FP16_RTOL)
        assert not torch.equal(result["fp16"], average)  # it really went through float16
        assert result["fp16_dtype_and_place"] == (torch.float32, True)
        torch.testing.assert_close(result["large"], torch.full((4,), 40000.0))
        beyond = torch.full((4,), 70000.0 / world_size)
        torch.testing.assert_close(result["beyond_fp16"], beyond, rtol=FP16_RTOL, atol=0)
        assert result["seen_dtypes"] == [torch.float16]
        torch.testing.assert_close(result["composed"], average, atol=1e-4, rtol=FP16_RTOL)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 32)
        self.l2 = nn.Linear(32, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.l2(torch.relu(self.l1(x))), y)


def _train(rank: int, world_size: int, comm_hook: str) -> dict[str, torch.Tensor]:
    init_process_group_from_env()
    strategy = BucketedDDP(comm_hook=comm_hook, bucket_cap_mb=1e-3, first_bucket_mb=1e-3)
    torch.manual_seed(0)
    model = Net()
    strategy.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        generator = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(8, 4, generator=generator)
        strategy.backward(strategy.training_step(model, (x, x.sum(1, keepdim=True)), step), sync=True)
        optimizer.step()
        strategy.zero_grad(optimizer)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_fp16_training_stays_close_to_fp32() -> None:
    fp32 = run_distributed(_train, 2, args=("allreduce",), timeout=60)
    fp16 = run_distributed(_train, 2, args=("fp16",), timeout=60)
    for name in fp32[0]:
        torch.testing.assert_close(fp16[0][name], fp32[0][name], atol=1e-3, rtol=FP16_RTOL)
        torch.testing.assert_close(fp16[0][name], fp16[1][name], atol=0, rtol=0)
    assert any(not torch.equal(fp16[0][name], fp32[0][name]) for name in fp32[0])
