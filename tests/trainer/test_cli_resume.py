"""The README's resume recipe through the CLI: split runs end with the uninterrupted run's weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.trainer.test_cli import _cli

#: A tiny CharGPT with dropout: 16 training batches and 2 validation batches per epoch.
RECIPE = [
    "task.n_layer=1",
    "task.n_embd=32",
    "task.n_head=2",
    "task.max_chars=40000",
    "task.dropout=0.1",
    "task.sample_chars=0",
    "trainer.limit_train_batches=16",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    last = run / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    return torch.load(last, weights_only=True)["state_dict"]


def _run(run: Path, *overrides: str) -> None:
    result = _cli(f"hydra.run.dir={run}", *RECIPE, *overrides, cwd=run.parent, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def _assert_same_weights(straight: Path, split: Path) -> None:
    expected, resumed = _weights(straight), _weights(split)
    worst = max((expected[name] - resumed[name]).abs().max().item() for name in expected)
    assert worst == 0.0, f"{split.name}: final weights differ by up to {worst:.4g}"
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name


def test_cli_resume_recipe_is_bit_exact_on_two_processes_stopped_mid_epoch(tmp_path):
    """Two processes, validation after every quarter epoch (the default); one uninterrupted run, one split run.

    The split stops mid-epoch, at the validation after the second epoch's batch 8, and resumes under another
    seed: the loader's position, the sampler's shuffle, the RNG states and the log version all come from
    last.ckpt. (Stops at an epoch end, and one process, are resumed in-process by
    tests/trainer/test_resume*.py; this test is the recipe's command line.)
    """
    options = ["trainer.devices=2", "trainer.accelerator=cpu", "strategy=bucketed_ddp"]
    _run(tmp_path / "straight", "trainer.max_epochs=2", *options)
    _run(tmp_path / "split", "trainer.max_steps=24", *options)
    _run(tmp_path / "split", "trainer.max_epochs=2", "ckpt_path=last", "seed=5", *options)
    assert not (tmp_path / "split" / "lightning_logs" / "version_1").exists()  # resumed in the same log version
    _assert_same_weights(tmp_path / "straight", tmp_path / "split")
