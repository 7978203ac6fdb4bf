"""Reusable pieces of compressed communication: BAGUA's MinMax uint8 quantizer, its average, and error feedback.

Every compressing strategy or comm hook (ByteGrad's scatter-reduce, low-precision decentralized SGD,
QAdam's momentum) quantizes with the same `minmax_quantize` / `minmax_dequantize`, averages with the same
`compressed_average` and remembers what it dropped with the same `ErrorFeedback`, so each strategy file
only says *what* it compresses and *when*.

MinMax quantization (BAGUA, Gan et al. 2022, section 4): a chunk of values is sent as its minimum, its step
``(max - min) / 255`` and one byte per value, ``round((x - min) / step)``; decoding gives back every value
to within half a step. A chunk whose values are all equal decodes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.transfers import all_gather_in_pieces, all_to_all_in_pieces

__all__ = [
    "HEADER_BYTES",
    "LEVELS",
    "ErrorFeedback",
    "Quantized",
    "Scatter",
    "compressed_average",
    "dequantize_payloads",
    "finish_average",
    "minmax_dequantize",
    "minmax_quantize",
    "pack",
    "pack_flat",
    "quantize_packed",
    "start_scatter",
    "unpack",
    "unpack_flat",
]

#: The largest code of a uint8 value; a chunk spans LEVELS steps from its minimum to its maximum.
LEVELS = 255
#: Bytes of a packed chunk's header: its minimum and its step, two float32.
HEADER_BYTES = 8


@dataclass
class Quantized:
    """A tensor quantized in chunks: one byte per value, and each chunk's minimum and step.

    Attributes:
        codes: uint8 codes, one per value, flat, chunk after chunk.
        minimum: float32, one per chunk.
        step: float32, one per chunk; 1 for a chunk whose values are all equal (their codes are 0).
        sizes: number of values in each chunk.
    """

    codes: Tensor
    minimum: Tensor
    step: Tensor
    sizes: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes this takes on the wire: the codes and each chunk's header."""
        return self.codes.numel() + HEADER_BYTES * len(self.sizes)


def minmax_quantize(values: Tensor, chunks: int = 1) -> Quantized:
    """Quantize `values` (any shape, read flat) to uint8 in `chunks` near-equal chunks.

    Chunks are `torch.tensor_split`'s: the first ``numel % chunks`` hold one value more. A scatter-reduce
    splits a bucket into one chunk per rank this way.
    """
    flat, sizes, lows, steps = _chunk_bounds(values, chunks)
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    offsets = _offsets(sizes)
    _encode(flat, sizes, lows, steps, lambda first, rows, size: codes[offsets[first] :][: rows * size].view(rows, size))
    return Quantized(codes, lows, steps, sizes)


def quantize_packed(values: Tensor, chunks: int = 1, out: Tensor | None = None) -> list[Tensor]:
    """Return ``pack(minmax_quantize(values, chunks))`` without its copies: the codes go straight into the payloads.

    The payloads are consecutive views of `out` (uint8, at least their total size; the rest is left alone) or of
    a new buffer. Byte for byte what `pack` returns.
    """
    flat, sizes, lows, steps = _chunk_bounds(values, chunks)
    total = flat.numel() + HEADER_BYTES * chunks
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=flat.device)
    payloads = list(out[:total].split([HEADER_BYTES + size for size in sizes]))
    headers = torch.stack([lows, steps], dim=1).view(torch.uint8)
    for payload, header in zip(payloads, headers):
        payload[:HEADER_BYTES].copy_(header)
    starts = _offsets([HEADER_BYTES + size for size in sizes])

    def codes_of(first: int, rows: int, size: int) -> Tensor:
        # Chunks of one size lie at a fixed stride: a (rows, size) view that skips their headers.
        return out[starts[first] :][: rows * (HEADER_BYTES + size)].view(rows, HEADER_BYTES + size)[:, HEADER_BYTES:]

    _encode(flat, sizes, lows, steps, codes_of)
    return payloads


def dequantize_payloads(payloads: list[Tensor], out: Tensor) -> Tensor:
    """Decode `pack`ed chunks (possibly from several ranks) into the float32 `out`, one after the other; return it.

    `minmax_dequantize(unpack(payloads))` without the copies, to the bit.
    """
    headers = torch.stack([payload[:HEADER_BYTES] for payload in payloads]).view(torch.float32)
    sizes = [payload.numel() - HEADER_BYTES for payload in payloads]
    for payload, piece, (low, step) in zip(payloads, out.split(sizes), headers):
        piece.copy_(payload[HEADER_BYTES:]).mul_(step).add_(low)
    return out


#: Values a quantizer step handles at once: small chunks go many to a step (few calls), large ones one at a time
#: through a scratch buffer that stays in cache.
BLOCK_VALUES = 1 << 18


def _chunk_bounds(values: Tensor, chunks: int) -> tuple[Tensor, list[int], Tensor, Tensor]:
    """`values` flat in float32, the sizes of its `chunks` parts (`torch.tensor_split`'s), and each part's minimum and
    step. Parts of one size are reduced together, as the rows of one view."""
    if chunks < 1:
        raise ValueError(f"minmax_quantize needs chunks >= 1, got {chunks}.")
    flat = values.detach().reshape(-1).float()
    size, extra = divmod(flat.numel(), chunks)
    sizes = [size + 1] * extra + [size] * (chunks - extra)
    lows, highs = [], []
    offsets = _offsets(sizes)
    for first, rows, size in _runs(sizes):
        if size == 0:
            lows.append(flat.new_zeros(rows))
            highs.append(flat.new_zeros(rows))
            continue
        low, high = torch.aminmax(flat[offsets[first] :][: rows * size].view(rows, size), dim=1)
        lows.append(low)
        highs.append(high)
    low, high = torch.cat(lows), torch.cat(highs)
    # A constant chunk has no spread: any positive step encodes it exactly as code 0.
    steps = torch.where(high > low, (high - low) / LEVELS, torch.ones_like(low))
    return flat, sizes, low, steps


def _encode(
    flat: Tensor, sizes: list[int], lows: Tensor, steps: Tensor, codes_of: Callable[[int, int, int], Tensor]
) -> None:
    """Write each chunk's uint8 codes, ``round((x - min) / step)``, into ``codes_of(first chunk, rows, size)``, the
    (rows, size) view of the chunks of one size: `BLOCK_VALUES` at a time through one float scratch buffer.

    Row by row or many rows at once, every value goes through the same float32 operations, so the codes are the
    same to the bit."""
    scratch = torch.empty(min(flat.numel(), max(BLOCK_VALUES, max(sizes))), device=flat.device)
    for chunk, count, start, size in _blocks(sizes):
        part = flat[start:][: count * size].view(count, size)
        code = torch.sub(part, lows[chunk : chunk + count, None], out=scratch[: count * size].view(count, size))
        code.div_(steps[chunk : chunk + count, None]).round_().clamp_(0, LEVELS)
        codes_of(chunk, count, size).copy_(code)


def minmax_dequantize(quantized: Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
    """Return the flat values `quantized` stands for, in `dtype` (chunks of one size decoded together)."""
    codes, sizes = quantized.codes, quantized.sizes
    values = torch.empty(codes.numel(), device=codes.device)
    for chunk, count, start, size in _blocks(sizes):
        out = values[start:][: count * size].view(count, size)
        out.copy_(codes[start:][: count * size].view(count, size))
        out.mul_(quantized.step[chunk : chunk + count, None]).add_(quantized.minimum[chunk : chunk + count, None])
    return values.to(dtype)


def _offsets(sizes: list[int]) -> list[int]:
    """Where each chunk starts, for chunks of `sizes` one after the other (and the end, last)."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def _blocks(sizes: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """(first chunk, number of chunks, first value, size) of each block of chunks of one size, about `BLOCK_VALUES`
    values (or one chunk, if larger); empty chunks are skipped."""
    offsets = _offsets(sizes)
    for first, rows, size in _runs(sizes):
        if size == 0:
            continue
        step_rows = max(1, BLOCK_VALUES // size)
        for chunk in range(first, first + rows, step_rows):
            count = min(step_rows, first + rows - chunk)
            yield chunk, count, offsets[chunk], size


def _runs(sizes: list[int]) -> list[tuple[int, int, int]]:
    """(first chunk, number of chunks, size) of each run of consecutive chunks of one size."""
    runs: list[tuple[int, int, int]] = []
    for index, size in enumerate(sizes):
        if runs and runs[-1][2] == size:
            first, count, _ = runs[-1]
            runs[-1] = (first, count + 1, size)
        else:
            runs.append((index, 1, size))
    return runs


def pack(quantized: Quantized) -> list[Tensor]:
    """Return one uint8 tensor per chunk: its minimum and step (8 bytes), then its codes.

    What a collective sends: chunk `i` of a rank's bucket goes to rank `i` in an all-to-all.
    """
    headers = torch.stack([quantized.minimum, quantized.step], dim=1).float().contiguous().view(torch.uint8)
    codes = torch.split(quantized.codes, quantized.sizes)
    return [torch.cat([header, chunk]) for header, chunk in zip(headers, codes)]


def unpack(payloads: list[Tensor]) -> Quantized:
    """Rebuild a `Quantized` from chunks packed by `pack` (possibly from several ranks)."""
    headers = torch.stack([payload[:HEADER_BYTES] for payload in payloads]).contiguous().view(torch.float32)
    codes = torch.cat([payload[HEADER_BYTES:] for payload in payloads])
    sizes = [p.numel() - HEADER_BYTES for p in payloads]
    return Quantized(codes, headers[:, 0].clone(), headers[:, 1].clone(), sizes)


def pack_flat(quantized: Quantized) -> Tensor:
    """Return every chunk `pack`ed, one after the other, as one uint8 tensor (what one transfer sends).

    The bytes of ``torch.cat(pack(quantized))``, written run by run: chunks of one size are the rows of one view."""
    sizes = quantized.sizes
    payload = quantized.codes.new_empty(quantized.nbytes)
    headers = torch.stack([quantized.minimum, quantized.step], dim=1).float().view(torch.uint8)
    for first, rows, packed, codes in _packed_runs(payload, quantized.codes, sizes):
        packed[:, :HEADER_BYTES].copy_(headers[first : first + rows])
        packed[:, HEADER_BYTES:].copy_(codes)
    return payload


def unpack_flat(payload: Tensor, sizes: list[int]) -> Quantized:
    """Rebuild a `Quantized` of chunks of `sizes` values from `pack_flat`'s tensor (run by run, as `pack_flat`)."""
    codes = payload.new_empty(sum(sizes))
    headers = payload.new_empty((len(sizes), HEADER_BYTES))
    for first, rows, packed, out in _packed_runs(payload, codes, sizes):
        headers[first : first + rows].copy_(packed[:, :HEADER_BYTES])
        out.copy_(packed[:, HEADER_BYTES:])
    bounds = headers.view(torch.float32)
    return Quantized(codes, bounds[:, 0].clone(), bounds[:, 1].clone(), list(sizes))


def _packed_runs(payload: Tensor, codes: Tensor, sizes: list[int]) -> list[tuple[int, int, Tensor, Tensor]]:
    """Per run of chunks of one size: (first chunk, rows, its (rows, header + size) view of `payload`, its
    (rows, size) view of the flat `codes`)."""
    starts, offsets = _offsets([HEADER_BYTES + size for size in sizes]), _offsets(sizes)
    return [
        (
            first,
            rows,
            payload[starts[first] :][: rows * (HEADER_BYTES + size)].view(rows, HEADER_BYTES + size),
            codes[offsets[first] :][: rows * size].view(rows, size),
        )
        for first, rows, size in _runs(sizes)
    ]


def compressed_average(
    values: Tensor, group: dist.ProcessGroup | None, counter: CommCounter | None
) -> tuple[Tensor, Tensor]:
    """Average flat `values` across `group` with BAGUA's 8-bit scatter-reduce and all-gather (ByteGrad's).

    1. split `values` into one chunk per rank and quantize each, 2. send chunk `j` to rank `j` (all-to-all;
    the own chunk stays home), 3. decode the versions of the own chunk and average them, 4. re-quantize the
    averaged own chunk and all-gather every rank's, 5. decode: every rank holds the same average.
    Steps 1-2 are `start_scatter`, 3-5 `finish_average`; a caller may run other work between them.

    Args:
        values: this rank's flat tensor; the same size on every rank.
        group: the process group.
        counter: where the bytes handed to collectives are counted; None counts nothing.

    Returns:
        The average, in `values`' dtype, identical on every rank; and what this rank's quantization
        made of `values` (its contribution as the others decoded it), for error feedback.
    """
    return finish_average(start_scatter(values, group, counter), group, counter)


@dataclass
class Scatter:
    """A `compressed_average` whose scatter (steps 1-2) is on the wire: what `finish_average` needs.

    Attributes:
        values: the tensor being averaged.
        payloads: this rank's packed chunks, chunk `j` for rank `j`.
        versions: where every rank's version of this rank's chunk arrives (this rank's own payload at its index).
        works: the transfers to wait for before reading `versions`.
    """

    values: Tensor
    payloads: list[Tensor]
    versions: list[Tensor]
    works: list[dist.Work]


def start_scatter(values: Tensor, group: dist.ProcessGroup | None, counter: CommCounter | None) -> Scatter:
    """Steps 1-2 of `compressed_average`: quantize `values` in one chunk per rank and post the all-to-all."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # Quantized straight into the payloads, decoded straight from them (`quantize_packed`, `dequantize_payloads`):
    # the bytes and values of pack / unpack / minmax_dequantize, without their copies.
    payloads = quantize_packed(values, world)
    size = payloads[rank].numel()
    # Scatter: chunk j goes to rank j; the own chunk is not handed to the collective.
    versions = [payload if j == rank else payload.new_empty(size) for j, payload in enumerate(payloads)]
    # Collective: all-to-all of the uint8 chunks, in pieces, posted without waiting (the others' chunks counted).
    works = all_to_all_in_pieces(payloads, versions, group=group, async_op=True, counter=counter)
    return Scatter(values, payloads, versions, works)


def finish_average(
    scatter: Scatter, group: dist.ProcessGroup | None, counter: CommCounter | None
) -> tuple[Tensor, Tensor]:
    """Steps 3-5 of `compressed_average` after `start_scatter`; `group` runs the all-gather (the scatter's ranks)."""
    values, payloads = scatter.values, scatter.payloads
    world, rank = len(payloads), dist.get_rank(group)
    sizes = [payload.numel() for payload in payloads]
    for work in scatter.works:
        # Host sync: this rank's chunk has arrived from every rank.
        work.wait()
    decoded = values.new_empty((world, sizes[rank] - HEADER_BYTES), dtype=torch.float32)
    dequantize_payloads(scatter.versions, decoded.view(-1))
    own_chunk = decoded.mean(dim=0)

    # Gather: all-gather needs equal sizes; pad to the largest chunk (tensor_split puts it first) with zeros.
    requantized = values.new_zeros(sizes[0], dtype=torch.uint8)
    quantize_packed(own_chunk, 1, out=requantized)
    # Collective: all-gather of every rank's averaged, re-quantized chunk, in pieces.
    gathered = all_gather_in_pieces(requantized, world, group=group, counter=counter)[0].split(requantized.numel())
    flat = values.new_empty(values.numel(), dtype=torch.float32)
    average = dequantize_payloads([chunk[:size] for chunk, size in zip(gathered, sizes)], flat)
    sent = dequantize_payloads(payloads, values.new_empty(values.numel(), dtype=torch.float32))
    return average.to(values.dtype), sent.to(values.dtype)


class ErrorFeedback:
    """Remember, per key, what compression dropped, and add it back before the next compression.

    With error feedback (Seide et al. 2014; BAGUA's ByteGrad; PowerSGD's memory), the error of each
    compressed step is carried into the next, so over many steps every gradient is eventually sent whole:
    the sum of what was sent equals the sum of what was meant, less the one memory still held.

        corrected = feedback.compensate("bucket3", gradient)   # gradient + what was dropped last time
        sent = decompress(compress(corrected))
        feedback.remember("bucket3", corrected, sent)          # keep corrected - sent for next time

    The memory is per rank (each rank drops something else), so strategies checkpoint every rank's
    `state_dict`.
    """

    def __init__(self) -> None:
        self.memory: dict[str, Tensor] = {}

    def compensate(self, key: str, values: Tensor) -> Tensor:
        """Return `values` plus the error remembered under `key` (a new tensor; `values` is untouched)."""
        held = self.memory.get(key)
        return values.clone() if held is None else values + held.to(values.dtype)

    def compensate_into(self, key: str, values: Tensor, out: Tensor) -> None:
        """Write `compensate`'s result into `out` (a slice of a bucket-sized buffer: no copy to join them)."""
        held = self.memory.get(key)
        if held is None:
            out.copy_(values)
        else:
            torch.add(values, held.to(values.dtype), out=out)

    def remember(self, key: str, intended: Tensor, sent: Tensor) -> None:
        """Keep ``intended - sent`` under `key`: what this step's compression dropped.

        Entries that are inf or NaN are kept as 0: they come from a step that fp16's loss scaler skips,
        and carried on they would poison every later step.
        """
        self.memory[key] = (intended - sent.to(intended.dtype)).detach().nan_to_num_(0.0, 0.0, 0.0)

    def reset(self) -> None:
        """Forget every memory (e.g. when a warm-up ends or the world size changes)."""
        self.memory.clear()

    def state_dict(self) -> dict[str, Tensor]:
        """Return the memories, for a checkpoint (plain tensors, so ``weights_only`` loading works)."""
        return {key: value.detach().clone() for key, value in self.memory.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Replace the memories by `state` (as `state_dict` returned them)."""
        self.memory = {key: value.detach().clone() for key, value in state.items()}
