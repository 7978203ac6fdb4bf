"""ByteGrad: BAGUA's centralized 8-bit gradient compression (Gan et al., VLDB 2022), as a comm hook.

For each bucket of gradients, on every one of the `W` ranks:

1. add back what the last compression dropped (error feedback, per parameter),
2. split the bucket into `W` chunks and MinMax-quantize each to uint8 (`comm.compression.minmax_quantize`),
3. scatter: send chunk `j` to rank `j` with one all-to-all (the own chunk stays home),
4. reduce: decompress the `W` versions of the own chunk and average them,
5. re-quantize the averaged own chunk and all-gather every rank's averaged chunk,
6. decompress: every rank now holds the same averaged bucket.

Steps 2-6 are `comm.compression.compressed_average`, which QAdam uses for its momentum too. A rank hands
about ``(W-1)/W + 1/W = 1`` byte per gradient value to collectives, against 4 for a float32 all-reduce.
The hook plugs into the core's reducer, so buckets, overlap with the backward, accumulation without
communication and `find_unused_parameters` are the reducer's; `ByteGrad` only fixes the bucket layout
(chunking depends on it, and a resumed run must chunk as the original did).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.compression import ErrorFeedback, compressed_average
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.hooks import GradBucket
from syncline.strategies.reducer_strategy import ReducerStrategy

__all__ = ["ByteGrad", "ByteGradState", "bytegrad_hook"]


@dataclass
class ByteGradState:
    """What `bytegrad_hook` needs.

    Attributes:
        process_group: the group to average over; None means the default group.
        error_feedback: the memory of what compression dropped, per parameter name; None sends without.
        counter: where the bytes handed to collectives are counted (set by the reducer).
    """

    process_group: dist.ProcessGroup | None = None
    error_feedback: ErrorFeedback | None = None
    counter: CommCounter | None = None


def bytegrad_hook(state: ByteGradState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket across the group, communicating it as 8-bit chunks (BAGUA's ByteGrad).

    Returns:
        A completed future whose value is `bucket.buffer`, holding the average.
    """
    buffer = bucket.buffer
    feedback = state.error_feedback
    if feedback is None:
        corrected = buffer
    else:
        # Error feedback keyed by parameter name: each gradient plus what its last compression dropped.
        corrected = torch.cat([feedback.compensate(name, buffer[start:end]) for name, start, end in bucket.spans()])
    average, sent = compressed_average(corrected, state.process_group, state.counter)
    if feedback is not None:
        for name, start, end in bucket.spans():
            feedback.remember(name, corrected[start:end], sent[start:end])
    buffer.copy_(average)
    future: Future[Tensor] = Future()
    future.set_result(buffer)
    return future


class ByteGrad(ReducerStrategy):
    """Average gradients with BAGUA's 8-bit scatter-reduce and all-gather, bucket by bucket.

    Args:
        bucket_cap_mb: the most MiB of gradients per bucket (one compressed scatter-reduce each).
        error_feedback: carry what quantization drops into the next step, per rank and parameter.
        find_unused_parameters: as in `BucketedDDP`.
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.

    Error-feedback memories differ per rank and are part of `state_dict`; they are keyed by parameter
    name, so a checkpoint resumes with the same number of processes only (each rank takes its own).
    """

    name = "bytegrad"
    manual_optimization_refused = (
        "its error feedback carries each bucket's quantization error from one synchronized backward per "
        "optimizer step to the next"
    )
    blocking_hook = True
    # Chunks follow the bucket layout: keep the layout of construction so a resumed run chunks alike.
    fixed_layout = True

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        error_feedback: bool = True,
        find_unused_parameters: bool = False,
        backend: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        state = ByteGradState(error_feedback=ErrorFeedback() if error_feedback else None)
        super().__init__(
            bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            comm_hook=bytegrad_hook,
            comm_state=state,
            backend=backend,
            timeout=timeout,
        )
        self.error_feedback = error_feedback

    def algorithm_state_dict(self) -> dict[str, Any]:
        """Return this rank's error-feedback memory."""
        feedback = self.comm_state.error_feedback
        return {"error_feedback": {} if feedback is None else feedback.state_dict()}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's error-feedback memory."""
        if self.comm_state.error_feedback is not None:
            self.comm_state.error_feedback.load_state_dict(state["error_feedback"])

    def __repr__(self) -> str:
        return f"ByteGrad(bucket_cap_mb={self.bucket_cap_mb}, error_feedback={self.error_feedback})"
