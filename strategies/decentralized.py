"""Decentralized SGD (D-PSGD, Lian et al., NeurIPS 2017) and BAGUA's low-precision variant.

Algorithm (every `period` optimizer steps; W a doubly stochastic mixing matrix):

    x_i = step(x_i, g_i)                             # local gradient, no all-reduce
    x_i = sum_j W_ij x_j                             # average with peers only

`peers="shift_one"`: W pairs every rank with one peer that changes each averaging (a round-robin
tournament: after w-1 averagings every pair has met once), x_i = (x_i + x_peer) / 2, sent by
`isend`/`irecv`. `peers="all"`: W = 1/w everywhere, an all-reduce of the parameters.

`compression="uint8"` (BAGUA's low-precision decentralized SGD; CHOCO-gossip, Koloskova et al. 2019)
sends MinMax-quantized *differences* instead of parameters. Each side keeps an estimate x̂ of every model
it exchanges with, which both ends update with the same decoded difference, so they stay equal:

    q_i = Q(x_i - x̂_i);   x̂_i += deq(q_i);   x̂_j += deq(q_j)          # for the peer j
    x_i = x_i + sum_j W_ij (x̂_j - x̂_i)

Without quantization error this is exactly the update above; with it, the error is not lost but sent
again in the next difference. With shift_one a rank holds two estimates per peer (what it believes of
the peer, what the peer believes of it): 2 (w-1) copies of the model; with all, w copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.options import OptionError, check_int
from syncline.strategies.comm.compression import minmax_dequantize, minmax_quantize, pack_flat, unpack_flat
from syncline.strategies.comm.flat import flatten_by_dtype, unflatten_into
from syncline.strategies.comm.transfers import all_gather_in_pieces, exchange
from syncline.strategies.model_averaging import ModelAveraging, average_parameters

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["PEERS", "Decentralized", "shift_one_partner"]

#: The peer selections `Decentralized(peers=...)` accepts.
PEERS = ("shift_one", "all")
_COMPRESSIONS = (None, "uint8")
#: Values per quantization chunk: each chunk has its own minimum and step (its header).
_CHUNK = 4096


def shift_one_partner(rank: int, world_size: int, round_: int) -> int | None:
    """Return `rank`'s peer in averaging round `round_`, or None when it sits this round out.

    The circle method of round-robin tournaments: the pairing is symmetric (my partner's partner is me),
    every rank is paired in every round when `world_size` is even, and over w-1 rounds every pair meets
    once. With an odd world size a phantom rank completes the circle; whoever meets it sits out.
    """
    n = world_size + world_size % 2
    if n == 2:
        partner = 1 - rank
    else:
        r = round_ % (n - 1)
        if rank == n - 1:
            partner = r
        elif rank == r:
            partner = n - 1
        else:
            partner = (2 * r - rank) % (n - 1)
    return None if partner >= world_size else partner


class Decentralized(ModelAveraging):
    """Local steps, then averaging with peers only (no global gradient all-reduce).

    Args:
        peers: "shift_one" (one peer per averaging, rotating) or "all" (every rank: an all-reduce).
        period: optimizer steps between two averagings.
        compression: None (send parameters) or "uint8" (send MinMax-quantized differences).
        kwargs: passed to the core (`backend`, `timeout`, ...).
    """

    name = "decentralized"

    def __init__(
        self, peers: str = "shift_one", period: int = 1, compression: str | None = None, **kwargs: Any
    ) -> None:
        if peers not in PEERS:
            raise OptionError(f"Decentralized(peers={peers!r}): peers must be one of {', '.join(map(repr, PEERS))}.")
        if compression not in _COMPRESSIONS:
            raise OptionError(f"Decentralized(compression={compression!r}): compression must be None or 'uint8'.")
        check_int("Decentralized", "period", period, 1, meaning="optimizer steps between averagings")
        super().__init__(warmup_steps=0, **kwargs)
        self.peers = peers
        self.period = period
        self.compression = compression
        #: uint8 only: estimates of models, by key ("mine@<peer>", "<peer>"; "<rank>" for peers="all").
        self.estimates: dict[str, list[Tensor]] = {}

    @property
    def rounds(self) -> int:
        """Averagings so far: the local steps over `period` (the core's `steps`, as no warm-up precedes them)."""
        return self.steps // self.period

    def check_world_size(self, world_size: int) -> None:
        """Refuse compression="uint8" on one process (there is no peer to send differences to)."""
        if self.compression == "uint8" and world_size < 2:
            raise OptionError(
                "Decentralized(compression='uint8') needs at least 2 processes (there is no peer to send "
                "quantized differences to); run with trainer.devices >= 2 or compression=None."
            )

    def after_setup(self, task: Task) -> None:
        """Start every estimate from the common initial parameters (uint8): rank 0's, on every rank."""
        super().after_setup(task)
        self.estimates = {}
        if self.compression == "uint8":
            rank, world = self.global_rank, self.world_size
            keys = (
                [str(r) for r in range(world)]
                if self.peers == "all"
                else [key for peer in range(world) if peer != rank for key in (f"mine@{peer}", str(peer))]
            )
            self.estimates = {key: [flat.clone() for _, flat in flatten_by_dtype(self._params)] for key in keys}

    # --------------------------------------------------------------- averaging
    def average_after_step(self, local_step: int) -> None:
        """Average with this round's peers every `period` local steps."""
        if local_step % self.period:
            return
        round_ = self.rounds - 1  # averagings before this one: how far the peers have rotated
        if self.peers == "all" and self.compression is None:
            # Collective: one coalesced all-reduce of the parameters.
            average_parameters(self._params, counter=self.comm_counter)
        elif self.peers == "all":
            self._average_all_quantized()
        else:
            partner = shift_one_partner(self.global_rank, self.world_size, round_)
            if partner is not None:
                self._average_with(partner)

    def _average_with(self, partner: int) -> None:
        """x = (x + x_partner) / 2, or its quantized-difference form."""
        for index, (tensors, flat) in enumerate(flatten_by_dtype(self._params)):
            if self.compression is None:
                theirs = self._exchange(flat, partner)
                unflatten_into(tensors, (flat + theirs) / 2)
                continue
            mine_there, theirs_here = self.estimates[f"mine@{partner}"][index], self.estimates[str(partner)][index]
            quantized = minmax_quantize(flat - mine_there, chunks=_chunks(flat))
            received = unpack_flat(self._exchange(pack_flat(quantized), partner), quantized.sizes)
            mine_there += minmax_dequantize(quantized, flat.dtype)
            theirs_here += minmax_dequantize(received, flat.dtype)
            unflatten_into(tensors, flat + (theirs_here - mine_there) / 2)

    def _exchange(self, tensor: Tensor, partner: int) -> Tensor:
        """Send `tensor` to `partner` and receive its tensor of the same shape."""
        # Collective (point to point): both ends post their sends and receives before waiting on any.
        received = exchange(tensor, partner)
        self.comm_counter.add(tensor.numel() * tensor.element_size())
        return received

    def _average_all_quantized(self) -> None:
        """x += mean_j(x̂_j) - x̂_i, every rank's difference all-gathered as uint8."""
        rank, world = self.global_rank, self.world_size
        for index, (tensors, flat) in enumerate(flatten_by_dtype(self._params)):
            quantized = minmax_quantize(flat - self.estimates[str(rank)][index], chunks=_chunks(flat))
            payload = pack_flat(quantized)
            # Collective: every rank's quantized difference (all payloads have the same size).
            gathered = all_gather_in_pieces(payload, world)[0].split(payload.numel())
            self.comm_counter.add(payload.numel())
            for peer, received in enumerate(gathered):
                self.estimates[str(peer)][index] += minmax_dequantize(
                    unpack_flat(received, quantized.sizes), flat.dtype
                )
            mean = torch.stack([self.estimates[str(peer)][index] for peer in range(world)]).mean(dim=0)
            unflatten_into(tensors, flat + mean - self.estimates[str(rank)][index])

    # ------------------------------------------------------------- checkpoints
    def algorithm_state_dict(self) -> dict[str, Any]:
        """This rank's estimates (they differ per rank), and the averagings so far (`rounds`, from `steps`)."""
        return {
            **super().algorithm_state_dict(),
            "rounds": self.rounds,
            "estimates": {key: [t.detach().cpu().clone() for t in flats] for key, flats in self.estimates.items()},
        }

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `algorithm_state_dict` returned ("rounds" follows from the restored `steps`)."""
        super().load_algorithm_state_dict(state)
        device = self.root_device
        self.estimates = {key: [t.to(device) for t in flats] for key, flats in state["estimates"].items()}

    def __repr__(self) -> str:
        return f"Decentralized(peers={self.peers!r}, period={self.period}, compression={self.compression!r})"


def _chunks(flat: Tensor) -> int:
    return max(1, -(-flat.numel() // _CHUNK))
