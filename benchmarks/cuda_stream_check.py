"""Check the reducer's CUDA stream synchronization: one process, NCCL, gradients equal to local ones.

NCCL runs each bucket's all-reduce on its own stream; the reducer's `future.wait()` must make the
compute stream wait for it before the optimizer reads the bucket. On one GPU (a world of one, where the
all-reduce of a bucket returns it unchanged) BucketedDDP's parameters must then equal plain local
training's bit for bit after every step, even when the compute stream is kept busy (a long
`torch.cuda._sleep` queued right after the backward) so that a missing wait would let the optimizer read
buffers NCCL has not written yet. Run it with ``TORCH_CUDA_SANITIZER=1`` as well: torch's CUDA sanitizer
then reports any kernel that touches a tensor another stream is still writing.

    python -m benchmarks cuda-stream-check [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(2048, 2048), nn.GELU())], nn.Linear(2048, 1))


def check(steps: int, bucket_cap_mb: float) -> dict[str, object]:
    """Train a local copy and a BucketedDDP copy side by side; return the largest difference after each step."""
    from syncline.strategies import BucketedDDP

    device = torch.device("cuda")
    local = _model().to(device)
    reduced = copy.deepcopy(local)
    strategy = BucketedDDP(bucket_cap_mb=bucket_cap_mb)
    strategy.setup_environment()
    strategy.setup(reduced)
    opt_local = torch.optim.SGD(local.parameters(), lr=1e-3)
    opt_reduced = torch.optim.SGD(reduced.parameters(), lr=1e-3)
    generator = torch.Generator(device=device).manual_seed(0)
    differences = []
    for _ in range(steps):
        x = torch.randn(256, 2048, device=device, generator=generator)
        local(x).square().mean().backward()
        opt_local.step()
        opt_local.zero_grad(set_to_none=True)
        strategy.backward(reduced(x).square().mean(), sync=True)
        # Keep the compute stream busy: without the reducer's wait, the step below would be queued on it
        # while NCCL's stream may still be writing the buckets.
        torch.cuda._sleep(50_000_000)
        opt_reduced.step()
        opt_reduced.zero_grad(set_to_none=True)
        # Host sync: read the difference back.
        differences.append(
            max((a - b).abs().max().item() for a, b in zip(local.parameters(), reduced.parameters(), strict=True))
        )
    buckets = strategy.communication_stats().get("comm/buckets")
    strategy.teardown()
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "backend": torch.distributed.get_backend(),
        "steps": steps,
        "buckets_per_step": buckets,
        "max_abs_difference_per_step": differences,
        "bit_identical": all(d == 0.0 for d in differences),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)


def command(args: argparse.Namespace) -> int | None:
    """``python -m benchmarks cuda-stream-check``: exit 1 unless every step is bit-identical."""
    if not torch.cuda.is_available():
        print("cuda_stream_check: skipped: no CUDA device")
        return 0
    result = check(args.steps, args.bucket_cap_mb)
    print(json.dumps(result, indent=2))
    return 0 if result["bit_identical"] else 1
