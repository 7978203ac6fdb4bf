"""Ranks whose training data run out at different times: one clear error on every rank, never a hang.

A loader that syncline shards (a `DistributedSampler`) gives every rank the same number of batches. Any
other one (an IterableDataset, a sampler of the user's own, `use_distributed_sampler=False`) may not,
and a rank that stops launching collectives leaves the others waiting in theirs. So before each
micro-batch of such a loader the ranks exchange, in one all-reduce of 2 x world_size flags, whether they
have a batch and whether it is their last; if they disagree, every rank raises the same error, naming
the rank(s) that run out first, before any of them launches a collective the others would not match.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DistributedSampler

from syncline.strategies.comm.join import Joinable

if TYPE_CHECKING:
    from syncline.strategies.strategy import Strategy

__all__ = ["JOINED", "UNEVEN_INPUTS", "UnevenInputsError", "agreed_batches", "needs_agreement"]

#: What `Trainer(uneven_inputs=...)` accepts: "check" ranks agree on every batch when the loader is not
#: sharded by syncline; "join": a rank whose data ran out shadows the others' steps until all ran out
#: (strategies that are `Joinable`); "off" trusts the data to give every rank the same number of batches.
UNEVEN_INPUTS = ("check", "join", "off")

#: The batch a joined rank gets: it shadows the others' step instead of running one.
JOINED = object()


class UnevenInputsError(RuntimeError):
    """The ranks' training data ran out at different batches; raised on every rank alike."""


def needs_agreement(loader: Any, strategy: Strategy, mode: str) -> bool:
    """Return whether the ranks must agree on every batch of `loader` (several ranks, not sharded by syncline)."""
    sharded = isinstance(getattr(loader, "sampler", None), DistributedSampler)
    return mode != "off" and strategy.world_size > 1 and not sharded


def agreed_batches(
    flagged: Iterator[tuple[int, Any, bool]], strategy: Strategy, epoch: int, join: bool = False
) -> Iterator[tuple[int, Any, bool]]:
    """Yield `flagged`'s (batch_idx, batch, is_last) once every rank has one, and ends the epoch with it.

    With `join`, a rank whose data ran out gets `JOINED` batches for as long as another rank has data,
    and is_last is true on every rank in the last round in which any rank has a batch.

    Raises:
        UnevenInputsError: some rank has no batch, or its last, while another has more (on every rank).
    """
    world, rank = strategy.world_size, strategy.global_rank
    batch_idx = 0
    while True:
        item = next(flagged, None)
        flags = torch.zeros(2 * world, device=strategy.root_device)
        if item is not None:
            batch_idx = item[0]
            flags[rank] = 1.0
            flags[world + rank] = float(item[2])
        # Collective: every rank learns which ranks have a batch, and which have their last.
        flags = strategy.reduce(flags, "sum").tolist()  # host sync: decides what every rank runs next
        have, last = flags[:world], flags[world:]
        if not any(have):
            if join and isinstance(strategy, Joinable):
                strategy.finish_join()  # collective
            return
        if join:
            if isinstance(strategy, Joinable):
                strategy.buffer_source = max(r for r in range(world) if have[r])
            final = all(not have[r] or last[r] for r in range(world))
            if item is None:
                batch_idx += 1
                yield batch_idx, JOINED, final
            else:
                yield item[0], item[1], final
            continue
        if all(have) and (all(last) or not any(last)):
            assert item is not None
            yield item
            continue
        first = [r for r in range(world) if not have[r] or last[r]]
        more = [r for r in range(world) if have[r] and not last[r]]
        raise UnevenInputsError(
            f"Rank(s) {', '.join(map(str, first))} ran out of training data first, at batch {batch_idx} of epoch "
            f"{epoch}, while rank(s) {', '.join(map(str, more))} still have batches: the ranks would launch "
            "different collectives and hang. Give every rank the same number of batches: let syncline shard a "
            "map-style dataset (use_distributed_sampler=True), make your sampler or IterableDataset yield "
            "equally many per rank, or cap the epoch with limit_train_batches."
        )
