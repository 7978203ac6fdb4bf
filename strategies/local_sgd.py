"""Post-local SGD (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020).

Algorithm (communication delay, H = `period`):

    for t = 0, 1, ...:
        if t < warmup_steps:   x = step(x, allreduce_mean(g))        # exact data parallel
        else:                  x = step(x, g_local)                  # each rank on its own gradients
                               if (t + 1 - warmup_steps) % H == 0:   x = allreduce_mean(x)

One flat, coalesced all-reduce of the parameters every H steps replaces H gradient all-reduces, so the
bytes sent fall to about 1/H of data parallel. The optimizer state (momentum) stays each rank's own, as
in torch's `PostLocalSGDOptimizer` + `PeriodicModelAverager`, which average parameters alone. With H=1
and plain SGD this is exactly data parallel (the mean of the steps is the step of the mean).
"""

from __future__ import annotations

from typing import Any

from syncline.options import check_int
from syncline.strategies.model_averaging import ModelAveraging, average_parameters

__all__ = ["LocalSGD"]


class LocalSGD(ModelAveraging):
    """Data parallel for `warmup_steps` steps, then local steps with parameters averaged every `period`.

    Args:
        period: optimizer steps between two averagings of the parameters (H in the paper).
        warmup_steps: optimizer steps of exact gradient all-reduce first (post-local SGD's warm-up).
        kwargs: passed to the core, whose reducer runs the warm-up (`bucket_cap_mb`, `backend`, ...).
    """

    name = "local_sgd"
    live_recovery_refused = ""  # each survivor keeps its replica; a replacement copies a healthy one

    def __init__(self, period: int = 4, warmup_steps: int = 0, **kwargs: Any) -> None:
        check_int("LocalSGD", "period", period, 1, meaning="optimizer steps between parameter averagings")
        super().__init__(warmup_steps=warmup_steps, **kwargs)
        self.period = period

    def average_after_step(self, local_step: int) -> None:
        """Average every parameter across ranks at the end of each period; nothing in between."""
        if local_step % self.period == 0:
            # Collective: one coalesced all-reduce of the parameters (per dtype).
            average_parameters(self._params, counter=self.comm_counter)

    def __repr__(self) -> str:
        return f"LocalSGD(period={self.period}, warmup_steps={self.warmup_steps})"
