"""Parameter exchanges in flight: each bucket's new values sent as soon as they exist, landed layer by layer.

A parameter server's step ends with a broadcast of the new parameters, a sharded one's with an all-gather, and
the next forward waits for the whole model (the lab measured `parameter_server` at 2.24x its algorithmic bound
at 100 Mbit/s). BytePS and ZeRO's prefetch do better, and `prefetch=True` does the same:

1. the optimizer steps one bucket at a time (`step_in_buckets`), front layers first, and each bucket's transfer
   is launched, asynchronously, as soon as its parameters are stepped, so the wire starts while the server is
   still stepping the rest;
2. nothing waits at the end of the step: the next forward's pre-hooks (`LayerWaits`) wait, module by module,
   for the buckets that hold its parameters, and write the received values into them;
3. what is not landed by a forward lands before the next backward, and before anything reads the parameters
   outside one (`Strategy.apply_pending_updates`: validation, checkpoints, callbacks, the end of the fit).

The values sent are those the blocking step sends (the optimizer updates each parameter of a per-parameter
optimizer alike in a subset as in the whole), so the weights equal the blocking path's to the bit; the bytes do
too, since the same tensors cross the wire in other cuts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from syncline.strategies.comm.deferred_update import step_subset
from syncline.strategies.comm.layer_waits import LayerWaits
from syncline.strategies.strategy import replace_step

__all__ = [
    "PER_PARAMETER_OPTIMIZERS",
    "PREFETCH_NEEDS_AUTOMATIC",
    "ParameterExchange",
    "PrefetchedParameters",
    "front_first",
    "step_in_buckets",
    "steps_per_parameter",
]

#: Optimizers whose update of a parameter depends on that parameter alone, so a bucket can be stepped alone.
PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def steps_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s step is one of torch's per-parameter steps (a subclass that overrides it is not)."""
    own = type(optimizer).step
    return any(own is kind.step for kind in PER_PARAMETER_OPTIMIZERS)


def front_first(groups: Sequence[Sequence[Tensor]], task: nn.Module) -> list[int]:
    """The indices of `groups` ordered by their front-most parameter in `task.parameters()` (the forward's order,
    as far as the registration order tells it); the same on every rank."""
    position = {id(param): index for index, param in enumerate(task.parameters())}
    return sorted(
        range(len(groups)), key=lambda i: min((position.get(id(p), len(position)) for p in groups[i]), default=0)
    )


def step_in_buckets(
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    buckets: Sequence[tuple[int, Iterable[Tensor]]],
    stepped: Callable[[int], None],
) -> None:
    """Run `step` (the loop's, with its loss scaler) so that ``optimizer.step()`` updates one bucket at a time.

    Args:
        optimizer: a per-parameter optimizer (`steps_per_parameter`).
        step: the loop's step function; it calls ``optimizer.step()`` once, or not at all (a skipped fp16 step).
        buckets: (index, the parameters the optimizer holds for it), in the order to step them.
        stepped: called with each index right after its parameters are updated (to launch its transfer).
    """
    own = optimizer.step

    def update() -> None:
        for index, params in buckets:
            step_subset(optimizer, {id(p) for p in params}, own)
            stepped(index)

    with replace_step(optimizer, update):
        step()


class ParameterExchange(LayerWaits):
    """Transfers of new parameter values in flight, one per bucket, each landed by the forward that needs it.

    Args:
        task: the module whose submodules get forward pre-hooks.
    """

    def __init__(self, task: nn.Module) -> None:
        super().__init__(task)
        self._buckets_of: dict[int, tuple[int, ...]] = {}
        self._works: dict[int, tuple[list[dist.Work], Callable[[], None]]] = {}
        #: Transfers no forward waits for (a server's sends of values its parameters hold already).
        self._sends: list[dist.Work] = []

    def set_layout(self, buckets: Sequence[Iterable[Tensor]]) -> None:
        """Say which parameters each bucket index writes (before launching; the layout may change between steps).
        A parameter may be in several buckets (a segment of a flat tensor may end inside it)."""
        self.land_all()
        owners: dict[int, list[int]] = {}
        for index, params in enumerate(buckets):
            for param in params:
                owners.setdefault(id(param), []).append(index)
        self._buckets_of = {key: tuple(indices) for key, indices in owners.items()}

    def launch(self, index: int, works: list[dist.Work], finish: Callable[[], None] | None) -> None:
        """Remember bucket `index`'s transfer: `finish` writes its result once `works` are complete; None when
        this rank's parameters hold the values already (a server's sends: waited for by `land_all` only)."""
        if finish is None:
            self._sends.extend(works)
            return
        if index in self.pending:
            self.land(index)
        self._works[index] = (works, finish)
        self.pending.add(index)

    def land_all(self) -> None:
        """Land every pending bucket, and wait for this rank's sends."""
        super().land_all()
        sends, self._sends = self._sends, []
        for work in sends:
            # Collective wait: a send launched after the step.
            work.wait()

    @property
    def in_flight(self) -> int:
        """The transfers not yet landed nor waited for (this rank's receives and sends)."""
        return len(self.pending) + len(self._sends)

    def buckets_of(self, param: Tensor) -> tuple[int, ...]:
        """The buckets whose transfers write `param`."""
        return self._buckets_of.get(id(param), ())

    @torch.no_grad()
    def land(self, index: int) -> None:
        """Wait for bucket `index`'s transfer and write what it received into the parameters."""
        works, finish = self._works.pop(index)
        self.pending.discard(index)
        for work in works:
            # Collective wait: the bucket's transfer, launched after its step.
            work.wait()
        finish()

    def forget(self) -> None:
        """Drop every pending transfer unlanded (a failed stage: its collectives may never complete)."""
        self._works.clear()
        self._sends.clear()
        self.pending.clear()


#: Why a prefetching strategy refuses manual optimization.
PREFETCH_NEEDS_AUTOMATIC = (
    "prefetch=True leaves each bucket's parameter transfer in flight until the next forward needs it, but a manual "
    "step may read the parameters, or step another optimizer over the same buckets, before that forward (a late "
    "transfer would then overwrite the newer values); drop prefetch"
)


class PrefetchedParameters:
    """Mixin of a strategy whose parameter transfers land per layer: `exchange` is the core's work in flight.

    The core (`ReducerStrategy`) lands it where the parameters are read outside a forward, and forgets it when the
    stage fails; this mixin names it and refuses manual optimization while prefetching.
    """

    #: The core's work in flight (`ReducerStrategy.in_flight`).
    in_flight: LayerWaits | None = None
    #: Whether the strategy was asked to prefetch (set by its constructor).
    prefetch: bool = False

    @property
    def exchange(self) -> ParameterExchange | None:
        """The transfers in flight; None without prefetching (or before setup)."""
        return cast("ParameterExchange | None", self.in_flight)

    @exchange.setter
    def exchange(self, exchange: ParameterExchange | None) -> None:
        self.in_flight = exchange

    @property
    def manual_optimization_refused(self) -> str:
        """Why these options cannot follow manual optimization ("" when they can): prefetching cannot."""
        if self.prefetch:
            return PREFETCH_NEEDS_AUTOMATIC
        return super().manual_optimization_refused  # type: ignore[misc]
