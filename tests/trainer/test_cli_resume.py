"""The README's resume recipe through the CLI: split runs end with the uninterrupted run's weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
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
    return torch.load(run / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def _run(run: Path, *overrides: str) -> None:
    result = _cli(f"hydra.run.dir={run}", *RECIPE, *overrides, cwd=run.parent, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("options", "first_stop"),
    [
        (["trainer.val_check_interval=1.0"], "trainer.max_epochs=1"),
        ([], "trainer.max_epochs=1"),  # the default: validate after every quarter, the last at the epoch end
        ([], "trainer.max_steps=24"),  # ends at the validation after batch 8 of epoch 1
        (["trainer.devices=2", "strategy=bucketed_ddp"], "trainer.max_epochs=1"),
    ],
    ids=["val-at-epoch-end", "val-within-epoch", "stopped-mid-epoch", "two-processes"],
)
def test_cli_resume_recipe_is_bit_exact(tmp_path, options, first_stop):
    _run(tmp_path / "straight", "trainer.max_epochs=2", *options)
    _run(tmp_path / "split", first_stop, *options)
    _run(tmp_path / "split", "trainer.max_epochs=2", "ckpt_path=last", "seed=5", *options)
    straight, resumed = _weights(tmp_path / "straight"), _weights(tmp_path / "split")
    worst = max((straight[name] - resumed[name]).abs().max().item() for name in straight)
    assert worst == 0.0, f"final weights differ by up to {worst:.4g}"
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
