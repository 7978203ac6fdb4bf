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

With uint8 and ``prefetch=True`` the averaging overlaps the next forward (`comm/parameter_exchange.py`): the
differences are quantized right after the step, as before, and sent in segments of whole 4096-value chunks, each
on the wire at once; the next forward waits, layer by layer, for the segments that hold its parameters and applies
their update there. Every chunk keeps its minimum and step, and every other operation is elementwise, so the
weights, the estimates and the bytes equal the blocking exchange's to the bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.options import OptionError, check_int
from syncline.strategies.comm.compression import minmax_dequantize, minmax_quantize, pack_flat, unpack_flat
from syncline.strategies.comm.flat import flatten_by_dtype, unflatten_into, write_range
from syncline.strategies.comm.parameter_exchange import ParameterExchange, PrefetchedParameters
from syncline.strategies.comm.transfers import all_gather_in_pieces, all_to_all_in_pieces, exchange
from syncline.strategies.model_averaging import ModelAveraging, average_parameters

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["PEERS", "Decentralized", "shift_one_partner"]

#: The peer selections `Decentralized(peers=...)` accepts.
PEERS = ("shift_one", "all")
_COMPRESSIONS = (None, "uint8")
#: Values per quantization chunk: each chunk has its own minimum and step (its header).
_CHUNK = 4096
#: Chunks per segment sent on its own with `prefetch` (about 256 Ki values, 256 KiB on the wire).
SEGMENT_CHUNKS = 64


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


class Decentralized(PrefetchedParameters, ModelAveraging):
    """Local steps, then averaging with peers only (no global gradient all-reduce).

    Args:
        peers: "shift_one" (one peer per averaging, rotating) or "all" (every rank: an all-reduce).
        period: optimizer steps between two averagings.
        compression: None (send parameters) or "uint8" (send MinMax-quantized differences).
        prefetch: with "uint8", send the differences in segments without waiting, and let the next forward wait
            for each layer's segments (bit-identical to the blocking exchange).
        kwargs: passed to the core (`backend`, `timeout`, ...).
    """

    name = "decentralized"

    def __init__(
        self,
        peers: str = "shift_one",
        period: int = 1,
        compression: str | None = None,
        prefetch: bool = False,
        **kwargs: Any,
    ) -> None:
        if prefetch and compression != "uint8":
            raise OptionError(
                f"Decentralized(prefetch=True, compression={compression!r}): prefetch overlaps the uint8 exchange "
                "with the next forward; use compression='uint8', or drop prefetch."
            )
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
        self.prefetch = prefetch
        #: With `prefetch`, per segment: (dtype group, first value, end, chunks); and the exchanges in flight.
        self._segments: list[tuple[int, int, int, int]] = []
        self.exchange: ParameterExchange | None = None

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
        if self.prefetch:
            self._lay_out_segments()
            self.exchange = ParameterExchange(task)
            self.exchange.set_layout([self._segment_params(index) for index in range(len(self._segments))])

    # --------------------------------------------------------------- averaging
    def average_after_step(self, local_step: int) -> None:
        """Average with this round's peers every `period` local steps."""
        if local_step % self.period:
            return
        round_ = self.rounds - 1  # averagings before this one: how far the peers have rotated
        if self.exchange is not None:
            self._launch_segments(
                None if self.peers == "all" else shift_one_partner(self.global_rank, self.world_size, round_)
            )
        elif self.peers == "all" and self.compression is None:
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
        return exchange(tensor, partner, counter=self.comm_counter)

    def _average_all_quantized(self) -> None:
        """x += mean_j(x̂_j) - x̂_i, every rank's difference all-gathered as uint8."""
        rank, world = self.global_rank, self.world_size
        for index, (tensors, flat) in enumerate(flatten_by_dtype(self._params)):
            quantized = minmax_quantize(flat - self.estimates[str(rank)][index], chunks=_chunks(flat))
            payload = pack_flat(quantized)
            # Collective: every rank's quantized difference (all payloads have the same size).
            gathered = all_gather_in_pieces(payload, world, counter=self.comm_counter)[0].split(payload.numel())
            for peer, received in enumerate(gathered):
                self.estimates[str(peer)][index] += minmax_dequantize(
                    unpack_flat(received, quantized.sizes), flat.dtype
                )
            mean = torch.stack([self.estimates[str(peer)][index] for peer in range(world)]).mean(dim=0)
            unflatten_into(tensors, flat + mean - self.estimates[str(rank)][index])

    # ---------------------------------------------------------- prefetching
    def _lay_out_segments(self) -> None:
        """Cut every dtype's flat parameters into segments of whole quantization chunks (`SEGMENT_CHUNKS` each).

        `minmax_quantize(flat, chunks=n)` cuts as `torch.tensor_split`: the first ``N % n`` chunks hold one value
        more. A run of those chunks is again cut so by `tensor_split` (its longer chunks come first), so each
        segment, quantized on its own, has the chunks, minima and steps the whole had.
        """
        self._segments = []
        for group, (_, flat) in enumerate(flatten_by_dtype(self._params)):
            numel, chunks = flat.numel(), _chunks(flat)
            small, longer = divmod(numel, chunks)
            sizes = [small + 1] * longer + [small] * (chunks - longer)
            start = 0
            for first in range(0, chunks, SEGMENT_CHUNKS):
                count = min(SEGMENT_CHUNKS, chunks - first)
                end = start + sum(sizes[first : first + count])
                self._segments.append((group, start, end, count))
                start = end

    def _segment_params(self, index: int) -> list[Tensor]:
        """The parameters with values in segment `index`."""
        group, start, end, _ = self._segments[index]
        tensors, offset, found = flatten_by_dtype(self._params)[group][0], 0, []
        for tensor in tensors:
            if offset < end and offset + tensor.numel() > start:
                found.append(tensor)
            offset += tensor.numel()
        return found

    def _launch_segments(self, partner: int | None) -> None:
        """Quantize this step's differences and send every segment without waiting (`partner` None: peers="all").

        What the blocking exchange computes, cut at chunk boundaries: the own estimate moves now, the received
        differences move the others' and the parameters when the segment lands.
        """
        assert self.exchange is not None
        if partner is None and self.peers != "all":
            return  # this rank sits the round out
        rank, world = self.global_rank, self.world_size
        groups = flatten_by_dtype(self._params)
        for index, (group, start, end, chunks) in enumerate(self._segments):
            tensors, flat = groups[group]
            values = flat[start:end]
            mine_key = str(rank) if partner is None else f"mine@{partner}"
            quantized = minmax_quantize(values - self.estimates[mine_key][group][start:end], chunks=chunks)
            payload = pack_flat(quantized)
            if partner is None:
                # Collective (asynchronous): every rank's quantized difference of this segment.
                gathered, works = all_gather_in_pieces(payload, world, async_op=True, counter=self.comm_counter)
            else:
                self.estimates[mine_key][group][start:end] += minmax_dequantize(quantized, flat.dtype)
                gathered = torch.empty_like(payload)
                sends: list[Tensor | None] = [payload if peer == partner else None for peer in range(world)]
                receives: list[Tensor | None] = [gathered if peer == partner else None for peer in range(world)]
                # Collective (point to point, asynchronous): this segment's differences, both ways.
                works = all_to_all_in_pieces(sends, receives, async_op=True, counter=self.comm_counter)
            finish = self._landing(tensors, group, start, end, values, quantized.sizes, gathered, partner)
            self.exchange.launch(index, works, finish)

    def _landing(
        self,
        tensors: list[Tensor],
        group: int,
        start: int,
        end: int,
        values: Tensor,
        sizes: list[int],
        received: Tensor,
        partner: int | None,
    ) -> Any:
        """Return what lands a segment once `received` holds the peer's (peers="all": every rank's) payload."""
        dtype = values.dtype

        def land() -> None:
            if partner is None:
                estimates = [self.estimates[str(peer)][group] for peer in range(self.world_size)]
                for estimate, payload in zip(estimates, received.split(received.numel() // self.world_size)):
                    estimate[start:end] += minmax_dequantize(unpack_flat(payload, sizes), dtype)
                mean = torch.stack([estimate[start:end] for estimate in estimates]).mean(dim=0)
                new = values + mean - self.estimates[str(self.global_rank)][group][start:end]
            else:
                theirs, mine = self.estimates[str(partner)][group], self.estimates[f"mine@{partner}"][group]
                theirs[start:end] += minmax_dequantize(unpack_flat(received, sizes), dtype)
                new = values + (theirs[start:end] - mine[start:end]) / 2
            write_range(tensors, start, end, new)

        return land

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
        prefetch = ", prefetch=True" if self.prefetch else ""
        return f"Decentralized(peers={self.peers!r}, period={self.period}, compression={self.compression!r}{prefetch})"


def _chunks(flat: Tensor) -> int:
    return max(1, -(-flat.numel() // _CHUNK))
