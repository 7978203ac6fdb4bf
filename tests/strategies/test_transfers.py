"""Transfers in pieces: every rank receives exactly what each peer sent it, whatever the sizes and pieces."""

from __future__ import annotations

import torch
import torch.distributed as dist

from syncline.strategies.comm.transfers import PIECE_BYTES, all_gather_in_pieces, all_to_all_in_pieces, exchange
from syncline.testing import run_distributed


def _payload(src: int, dst: int) -> torch.Tensor:
    """What rank `src` sends rank `dst`: a size of its own (2.5 to 3.5 pieces) and values naming the pair."""
    numel = (5 * PIECE_BYTES // 2 + (src * 3 + dst) * PIECE_BYTES // 4) // 4
    return torch.arange(numel, dtype=torch.float32) + 1000 * src + 10 * dst


def _transfers(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo")
    sends = [None if peer == rank else _payload(rank, peer) for peer in range(world_size)]
    receives = [None if peer == rank else torch.empty_like(_payload(peer, rank)) for peer in range(world_size)]
    all_to_all_in_pieces(sends, receives)
    for peer, received in enumerate(receives):
        if peer != rank:
            torch.testing.assert_close(received, _payload(peer, rank), rtol=0, atol=0)
    # The same again, waited on by the caller.
    receives = [None if peer == rank else torch.zeros_like(_payload(peer, rank)) for peer in range(world_size)]
    for work in all_to_all_in_pieces(sends, receives, async_op=True):
        work.wait()
    assert all(r is None or torch.equal(r, _payload(p, rank)) for p, r in enumerate(receives))
    # A pairwise exchange of a non-contiguous tensor (ranks 0 and 1; rank 2 sits out).
    if rank < 2:
        mine = _payload(rank, 9)[: 3 * 4096].view(3, 4096).t()
        theirs = exchange(mine, 1 - rank)
        torch.testing.assert_close(theirs, _payload(1 - rank, 9)[: 3 * 4096].view(3, 4096).t(), rtol=0, atol=0)
    # An all-gather of 2.5 pieces from every rank, rank after rank.
    mine = torch.arange(5 * PIECE_BYTES // 8, dtype=torch.float32) + 1000 * rank
    gathered, _ = all_gather_in_pieces(mine, world_size)
    for peer, part in enumerate(gathered.split(mine.numel())):
        torch.testing.assert_close(part, mine + 1000 * (peer - rank), rtol=0, atol=0)


def test_pieces_arrive_whole_and_in_order_between_three_ranks():
    run_distributed(_transfers, 3, timeout=120)
