"""Large transfers in pieces: point-to-point exchanges and all-gathers that keep a link busy in both directions.

gloo moves one large buffer over TCP as one message. When a rank sends and receives a large buffer at the
same time (a pairwise exchange, an all-gather), that runs at about 60% of a shaped link's rate: measured in
the network lab at 100 Mbit/s (docs/performance.md, §9), exchanging 12.8 MB took 1.76 s and all-gathering it
1.77 s, where an all-reduce of the same bytes (which gloo already cuts into pieces) took 1.08 s. Posted
as 1 MiB pieces, both took 1.11-1.12 s. A one-way transfer (a broadcast) is not affected.

Every receive is posted before any send. gloo writes a piece only once the receiver has announced the
matching receive, and on a shaped link that announcement queues behind the receiver's own outgoing data:
posted after the sends, it stalls them. In the lab at 100 Mbit/s, posting the receives first took
ByteGrad's step from 0.549 to 0.437 s and the sharded parameter server's from 1.576 to 1.210 s.

Every wrapper here takes the strategy's `CommCounter` and counts what this rank hands to the collective (the
payload it passes in, as `comm/counter.py` defines it), so an algorithm never counts bytes itself: it sends
through these wrappers (or `broadcast_coalesced`, or a comm hook that counts in its state) and its bytes are
counted once, where they leave.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.counter import CommCounter, count_bytes

__all__ = [
    "PIECE_BYTES",
    "all_gather_in_pieces",
    "all_reduce",
    "all_to_all_in_pieces",
    "broadcast",
    "exchange",
    "future_of",
    "pieces",
]

#: The size of one piece.
PIECE_BYTES = 1 << 20


def pieces(flat: Tensor, piece_bytes: int = PIECE_BYTES) -> tuple[Tensor, ...]:
    """Split the 1-D contiguous tensor `flat` into consecutive views of at most `piece_bytes` bytes."""
    return flat.split(max(1, piece_bytes // flat.element_size()))


def all_reduce(
    tensor: Tensor,
    counter: CommCounter | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    """All-reduce `tensor` in place with `op`, counting its bytes in `counter`."""
    count_bytes(counter, tensor)
    # Collective: the caller's all-reduce.
    dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: Tensor, src: int, counter: CommCounter | None) -> dist.Work:
    """Start broadcasting rank `src`'s `tensor` to every rank, counting its bytes; return the work to wait on."""
    count_bytes(counter, tensor)
    # Collective (asynchronous): the caller's broadcast.
    return dist.broadcast(tensor, src=src, async_op=True)


def exchange(
    tensor: Tensor, partner: int, group: dist.ProcessGroup | None = None, counter: CommCounter | None = None
) -> Tensor:
    """Send `tensor` to `partner` and return the tensor of the same shape and dtype that `partner` sends."""
    flat = tensor.reshape(-1)
    received = torch.empty_like(flat)
    world_size = dist.get_world_size(group)
    sends = [flat if peer == partner else None for peer in range(world_size)]
    receives = [received if peer == partner else None for peer in range(world_size)]
    all_to_all_in_pieces(sends, receives, group=group, counter=counter)
    return received.view_as(tensor)


def all_to_all_in_pieces(
    sends: list[Tensor | None],
    receives: list[Tensor | None],
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    counter: CommCounter | None = None,
) -> list[dist.Work]:
    """Send ``sends[j]`` to rank j and receive rank j's tensor into ``receives[j]``, for every other rank j.

    An all-to-all as point-to-point transfers, every piece posted before waiting on any. Entries for this
    rank (and None) are skipped; ``receives[j]`` must have the size of what rank j sends here.

    Returns:
        With `async_op`, the works to wait on before reading `receives`; else an empty list (all complete).
    """
    rank = dist.get_rank(group)
    works = []
    # Receives first (see the module's docstring), then sends; every piece is posted before any wait.
    for peer, receive in enumerate(receives):
        if peer != rank and receive is not None:
            for piece in pieces(receive.view(-1)):
                # Collective (point to point): `peer`'s pieces for this rank.
                works.append(dist.irecv(piece, src=peer, group=group))
    for peer, send in enumerate(sends):
        if peer != rank and send is not None:
            count_bytes(counter, send)
            for piece in pieces(send.reshape(-1)):
                # Collective (point to point): this rank's pieces for `peer`.
                works.append(dist.isend(piece, dst=peer, group=group))
    if async_op:
        return works
    for work in works:
        work.wait()
    return []


def all_gather_in_pieces(
    tensor: Tensor,
    world_size: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    counter: CommCounter | None = None,
) -> tuple[Tensor, list[dist.Work]]:
    """All-gather the contiguous `tensor` of every rank into one flat tensor, rank after rank.

    Returns:
        The gathered tensor (`world_size` times `tensor`'s elements) and, with `async_op`, the works to wait
        on before reading it (with `async_op=False` they are already complete).
    """
    flat = tensor.reshape(-1)
    count_bytes(counter, flat)
    gathered = flat.new_empty(world_size * flat.numel())
    per_rank = [pieces(part) for part in gathered.split(flat.numel())]
    works = []
    for index, piece in enumerate(pieces(flat)):
        # Collective: one all-gather per piece, all in flight at once.
        works.append(dist.all_gather([mine[index] for mine in per_rank], piece, group=group, async_op=True))
    if not async_op:
        for work in works:
            work.wait()
        works = []
    return gathered, works


def future_of(works: list[dist.Work]) -> Future[Any]:
    """Return a future that completes when every one of `works` has (a thread waits; gloo's p2p has none)."""
    future: Future[Any] = Future()

    def wait() -> None:
        try:
            for work in works:
                # Host sync (in this thread only, without the GIL): the transfer has completed.
                work.wait()
        except RuntimeError as error:
            future.set_exception(error)
            return
        future.set_result(None)

    threading.Thread(target=wait, name="syncline-transfer", daemon=True).start()
    return future
