"""The CharGPT example trains through the Trainer, and its data, sampling and schedule behave as documented."""

import math

import pytest
import torch

from syncline.examples.char_gpt import CharGPT, CharWindows, _warmup_cosine, load_stdlib_text
from syncline.trainer import Trainer

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=16, max_chars=40_000, sample_chars=0)


def _val_loss(task: CharGPT, batches: int = 4) -> float:
    training = task.training
    task.eval()
    losses = []
    with torch.no_grad():
        for i, (inputs, targets) in enumerate(task.val_dataloader()):
            if i == batches:
                break
            losses.append(task._loss(task(inputs), targets).item())
    # Back in the mode it had: the Trainer trains a task in the mode it is given, as Lightning does.
    task.train(training)
    return sum(losses) / len(losses)


def test_trains_through_the_trainer_and_beats_the_unigram_baseline(tmp_path):
    torch.manual_seed(0)
    task = CharGPT(**TINY, lr=1e-2, warmup_steps=5)
    initial = _val_loss(task)
    # An untrained model predicts nearly uniformly over the vocabulary.
    assert initial == pytest.approx(math.log(len(task.vocab)), abs=0.3)
    trainer = Trainer(
        max_steps=30,
        val_check_interval=15,
        limit_val_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        seed=0,
    )
    trainer.fit(task)
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train_loss"])
    final = _val_loss(task)
    assert final < initial - 1.0
    assert final < task.unigram_loss()
    # Perplexity is per character, so it is the exponential of the mean cross-entropy.
    assert float(metrics["val_ppl"]) == pytest.approx(math.exp(float(metrics["val_loss"])), rel=1e-3)


def test_stdlib_text_is_deterministic_ascii_and_capped():
    text = load_stdlib_text(10_000)
    assert len(text) == 10_000
    assert text.isascii()
    assert text == load_stdlib_text(10_000)
    assert load_stdlib_text(20_000).startswith(text)


def test_train_and_val_split_the_text_and_encoding_round_trips():
    task = CharGPT(**TINY)
    assert len(task.train_data) + len(task.val_data) == TINY["max_chars"]
    assert len(task.val_data) == pytest.approx(0.1 * TINY["max_chars"], abs=1)
    text = load_stdlib_text(200)
    assert task.decode(task.encode(text)) == text


def test_windows_are_consecutive_and_targets_are_shifted_by_one():
    data = torch.arange(100)
    windows = CharWindows(data, block_size=8)
    assert len(windows) == 12
    inputs, targets = windows[3]
    assert inputs.tolist() == list(range(24, 32))
    assert targets.tolist() == list(range(25, 33))


def test_generate_is_reproducible_and_leaves_the_global_rng_alone():
    task = CharGPT(**TINY)
    state = torch.get_rng_state()
    first = task.generate("def ", 20, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == task.generate("def ", 20, seed=3)
    assert first.startswith("def ") and len(first) == 24


def test_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="divisible"):
        CharGPT(**{**TINY, "n_head": 3})


def test_schedule_warms_up_then_decays_to_the_floor():
    factor = _warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55)
    assert factor(110) == pytest.approx(0.1)
    assert factor(500) == pytest.approx(0.1)
    assert _warmup_cosine(10, None, 0.1)(500) == 1.0
