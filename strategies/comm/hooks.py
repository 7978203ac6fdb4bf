"""Per-bucket gradient communication: plain functions `hook(state, bucket) -> Future[Tensor]`.

The reducer calls a comm hook once per bucket, as soon as every gradient in the bucket is ready. The
hook launches its collective asynchronously and returns a future whose value is the bucket's reduced
(averaged) flat gradient. Keeping the hook a plain function of a typed state object lets compression
wrap communication without either knowing about the other:

    hook = fp16_compress_wrapper(allreduce_hook)   # cast to fp16, allreduce, cast back

The design follows torch's `ddp_comm_hooks/default_hooks.py`; the bucket is syncline's own `GradBucket`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.counter import CommCounter, count_bytes

__all__ = [
    "COMM_HOOKS",
    "AllreduceState",
    "CommHook",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "low_precision_allreduce",
]


@dataclass(eq=False)
class GradBucket:
    """One bucket of gradients as a comm hook sees it.

    Attributes:
        index: position of the bucket in launch order; every rank launches bucket `i` as its `i`-th
            collective of the step.
        buffer: the flat gradient buffer. A hook may reduce it in place or return a new tensor of the
            same shape and dtype; the reducer copies a new tensor back into the buffer.
        parameters: the parameters whose gradients live in `buffer`, in buffer order.
        offsets: start of each parameter's gradient inside `buffer` (in elements).
        names: the qualified name of each parameter, to key per-parameter state (error feedback, factors).
    """

    index: int
    buffer: Tensor
    parameters: list[torch.nn.Parameter] = field(repr=False)
    offsets: list[int]
    names: list[str] = field(default_factory=list)

    def spans(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of each parameter's gradient in `buffer`."""
        sizes = [param.numel() for param in self.parameters]
        return [(name, offset, offset + size) for name, offset, size in zip(self.names, self.offsets, sizes)]


@dataclass
class AllreduceState:
    """What `allreduce_hook` needs: the group to reduce over.

    Attributes:
        process_group: the group to reduce over; None means the default group.
        counter: where the hook counts the bytes it hands to collectives; the reducer sets it to the
            strategy's counter. A state without a `counter` attribute is counted by the reducer at the
            bucket's own size.
    """

    process_group: dist.ProcessGroup | None = None
    counter: CommCounter | None = None

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return dist.get_world_size(self.process_group)


#: The signature of every comm hook: a typed state of the hook's choosing, and the bucket.
CommHook = Callable[[Any, GradBucket], Future[Tensor]]


def allreduce_hook(state: AllreduceState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket across the group with one asynchronous all-reduce.

    Returns:
        A future whose value is `bucket.buffer`, reduced in place.
    """
    buffer = bucket.buffer
    # Divide before the all-reduce so low-precision sums cannot overflow.
    buffer.div_(state.world_size)
    count_bytes(state.counter, buffer)
    # Collective: asynchronous all-reduce of the whole bucket; the reducer waits on the future.
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(_first_tensor)


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Wrap `hook` so that it communicates the bucket in float16 and returns it in the original dtype.

    The wrapped hook sees a copy of the bucket whose buffer is float16; its result is cast back into
    the original buffer. This halves the bytes sent for fp32 gradients at a loss of precision. The cast
    comes before `hook` runs, so a local gradient beyond float16's range (65504) becomes inf whatever
    `hook` does; `fp16_compress_hook` divides by the world size before its cast instead.
    """

    def fp16_hook(state: Any, bucket: GradBucket) -> Future[Tensor]:
        original = bucket.buffer
        compressed = replace(bucket, buffer=original.to(torch.float16))
        return hook(state, compressed).then(_cast_back_into(original))

    fp16_hook.__name__ = f"fp16_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    return fp16_hook


def low_precision_allreduce(state: AllreduceState, bucket: GradBucket, dtype: torch.dtype) -> Future[Tensor]:
    """Average the bucket across the group, communicating it in `dtype` (the fp16 and bf16 hooks).

    Unlike `fp16_compress_wrapper(allreduce_hook)` (and torch's hooks, which cast first), the division by
    the world size happens in the bucket's own dtype before the cast, so a local gradient up to the
    dtype's largest value times the world size survives the cast, and the all-reduced sum, being the
    average, overflows only if the average itself does. float16 keeps 10 mantissa bits and overflows
    above 65504; bfloat16 keeps 7 bits and float32's range, so it never overflows where float32 does not.

    Returns:
        A future whose value is `bucket.buffer`, holding the average.
    """
    original = bucket.buffer
    # Divide before the cast so local gradients above the dtype's range do not become inf.
    compressed = original.div_(state.world_size).to(dtype)
    count_bytes(state.counter, compressed)
    # Collective: asynchronous all-reduce of the low-precision copy; the reducer waits on the future.
    work = dist.all_reduce(compressed, group=state.process_group, async_op=True)
    return work.get_future().then(_first_tensor).then(_cast_back_into(original))


# Module-level functions, not closures: a strategy and its hook are pickled to every worker process.
def fp16_compress_hook(state: AllreduceState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket communicating float16: half the bytes of float32, overflow above 65504."""
    return low_precision_allreduce(state, bucket, torch.float16)


def bf16_compress_hook(state: AllreduceState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket communicating bfloat16: half the bytes of float32, float32's range, 3 fewer bits."""
    return low_precision_allreduce(state, bucket, torch.bfloat16)


#: The built-in hooks by the names a config may use.
COMM_HOOKS: dict[str, CommHook] = {
    "allreduce": allreduce_hook,
    "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook,
}


def _first_tensor(fut: Future[list[Tensor]]) -> Tensor:
    """Unwrap the single tensor of an all-reduce future."""
    return fut.value()[0]


def _cast_back_into(original: Tensor) -> Callable[[Future[Tensor]], Tensor]:
    """Return a `then` callback that copies a future's (compressed) tensor into `original`."""

    def cast_back(fut: Future[Tensor]) -> Tensor:
        # On CUDA, `then` runs this on a stream that already waits for the collective, so value() is
        # safe here; the copy is queued on that stream, and the returned future records it.
        compressed = fut.value()
        original.copy_(compressed)
        if compressed.is_cuda:
            # The compressed copy dies with this callback: keep its memory from being reused by
            # another stream before this stream's copy has read it.
            compressed.record_stream(torch.cuda.current_stream(compressed.device))
        return original

    return cast_back
