"""The MinMax uint8 quantizer and error feedback that every compressing strategy shares."""

from __future__ import annotations

import pytest
import torch

from syncline.strategies.comm.compression import (
    LEVELS,
    ErrorFeedback,
    dequantize_payloads,
    minmax_dequantize,
    minmax_quantize,
    pack,
    pack_flat,
    quantize_packed,
    unpack,
    unpack_flat,
)


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_round_trip_error_is_within_half_a_step_of_each_chunk(chunks):
    values = torch.randn(1001, generator=torch.Generator().manual_seed(0)) * 3 + 1
    quantized = minmax_quantize(values, chunks)
    assert quantized.codes.dtype == torch.uint8 and quantized.codes.numel() == 1001
    assert quantized.sizes == [part.numel() for part in torch.tensor_split(values, chunks)]
    decoded = minmax_dequantize(quantized)
    steps = torch.repeat_interleave(quantized.step, torch.tensor(quantized.sizes))
    error = (decoded - values).abs()
    # Half a step, plus float32 rounding of the arithmetic.
    assert bool((error <= steps / 2 * (1 + 1e-4) + 1e-6).all()), float((error - steps / 2).max())
    for part, low, step in zip(torch.tensor_split(values, chunks), quantized.minimum, quantized.step):
        assert float(low) == float(part.min())
        assert float(step) == pytest.approx(float(part.max() - part.min()) / LEVELS, rel=1e-6)


def test_extremes_and_constant_chunks_decode_exactly():
    values = torch.tensor([2.0, 2.0, 2.0, -1.0, 0.5, 4.0])
    decoded = minmax_dequantize(minmax_quantize(values, chunks=2))
    assert decoded[:3].tolist() == [2.0, 2.0, 2.0]
    assert decoded[3] == -1.0 and decoded[5] == pytest.approx(4.0, abs=1e-6)


def test_pack_and_unpack_carry_chunks_between_ranks():
    values = torch.randn(50, generator=torch.Generator().manual_seed(1))
    quantized = minmax_quantize(values, chunks=3)
    payloads = pack(quantized)
    assert [p.dtype for p in payloads] == [torch.uint8] * 3
    assert sum(p.numel() for p in payloads) == quantized.nbytes == 50 + 3 * 8
    # A receiver that holds chunks 2 and 0 of someone's payload decodes just those.
    rebuilt = unpack([payloads[2], payloads[0]])
    expected = torch.cat([minmax_dequantize(quantized)[34:], minmax_dequantize(quantized)[:17]])
    torch.testing.assert_close(minmax_dequantize(rebuilt), expected, rtol=0, atol=0)


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_packed_quantizing_and_decoding_are_pack_and_unpack_without_copies_to_the_bit(chunks):
    """What `compressed_average` uses: the same bytes as pack(minmax_quantize(...)), the same values as
    minmax_dequantize(unpack(...)); uneven chunks, a constant chunk and tiny spreads included."""
    generator = torch.Generator().manual_seed(3)
    for values in (torch.randn(1001, generator=generator) * 40, torch.tensor([5.0] * 4 + [1e-30, -1e-38, 1e-45])):
        payloads = quantize_packed(values, chunks)
        for got, want in zip(payloads, pack(minmax_quantize(values, chunks)), strict=True):
            assert torch.equal(got, want)
        decoded = dequantize_payloads(payloads, torch.empty(values.numel()))
        assert torch.equal(decoded, minmax_dequantize(unpack(payloads)))
    # Into a larger buffer: the payloads come first, the rest is left as it was (the all-gather's padding).
    buffer = torch.full((values.numel() + 8 * chunks + 5,), 7, dtype=torch.uint8)
    quantize_packed(values, chunks, out=buffer)
    assert buffer[-5:].tolist() == [7] * 5


@pytest.mark.parametrize("chunks", [1, 5, 782, 1200])
def test_many_chunks_quantize_and_decode_as_each_chunk_alone_to_the_bit(chunks):
    """The quantizer handles chunks of one size together (decentralized's 4,096-value chunks); every chunk must get
    what quantizing it alone gives: its min, its step, round((x - min) / step). 1200 chunks of 1001 values
    leaves some of one value and some empty."""
    values = torch.randn(1001 if chunks == 1200 else 3_000_003, generator=torch.Generator().manual_seed(4)) * 7
    quantized = minmax_quantize(values, chunks)
    decoded = minmax_dequantize(quantized)
    parts = torch.tensor_split(values, chunks)
    assert quantized.sizes == [part.numel() for part in parts]
    for index in sorted({0, 1, len(parts) // 2, len(parts) - 1} & set(range(len(parts)))):
        part = parts[index]
        if part.numel() == 0:
            assert float(quantized.step[index]) == 1.0
            continue
        low, high = torch.aminmax(part)
        step = (high - low) / LEVELS if high > low else torch.tensor(1.0)  # a constant chunk: step 1, codes 0
        codes = ((part - low) / step).round().clamp(0, LEVELS).to(torch.uint8)
        start = sum(quantized.sizes[:index])
        assert torch.equal(quantized.minimum[index], low) and torch.equal(quantized.step[index], step)
        assert torch.equal(quantized.codes[start : start + part.numel()], codes)
        assert torch.equal(decoded[start : start + part.numel()], codes.float() * step + low)
    assert torch.equal(unpack_flat(pack_flat(quantized), quantized.sizes).codes, quantized.codes)


def test_error_feedback_sends_everything_eventually():
    generator = torch.Generator().manual_seed(2)
    feedback = ErrorFeedback()
    intended_total = torch.zeros(300)
    sent_total = torch.zeros(300)
    for _ in range(20):
        gradient = torch.randn(300, generator=generator)
        corrected = feedback.compensate("b0", gradient)
        sent = minmax_dequantize(minmax_quantize(corrected))
        feedback.remember("b0", corrected, sent)
        intended_total += gradient
        sent_total += sent
    # What was sent plus the one memory still held is what was meant, to float32 rounding.
    torch.testing.assert_close(sent_total + feedback.memory["b0"], intended_total, rtol=0, atol=1e-4)
    restored = ErrorFeedback()
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.memory["b0"], feedback.memory["b0"])
    feedback.reset()
    assert feedback.memory == {}


def test_bad_chunk_count_is_named():
    with pytest.raises(ValueError, match="chunks >= 1"):
        minmax_quantize(torch.ones(3), chunks=0)
