"""A NaN loss on one rank stops or skips the step on every rank alike (real processes, gloo)."""

from __future__ import annotations

import pytest
import torch

from syncline.options import OptionError
from syncline.testing import run_distributed, run_ranks
from syncline.trainer import Trainer
from syncline.trainer.launcher import WorkerFailedError
from syncline.trainer.nonfinite import NonfiniteLossError
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

BAD_BATCH = 2  # the first micro-batch of the second window with accumulate_grad_batches=2


class NanOnRankOne(Regressor):
    """Rank 1's loss is NaN at `BAD_BATCH` of epoch 0; with `zero_window`, every rank's loss of that window is 0."""

    def __init__(self, zero_window: bool = False) -> None:
        super().__init__()
        self.zero_window = zero_window

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.current_epoch == 0 and batch_idx // 2 == BAD_BATCH // 2 and self.zero_window:
            return loss * 0.0
        if self.current_epoch == 0 and batch_idx == BAD_BATCH and self.global_rank == 1 and not self.zero_window:
            return loss * float("nan")
        return loss

    def configure_optimizers(self):
        # Plain SGD: a step with zero gradients leaves the weights exactly as they are.
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _fit(rank, world_size, strategy, mode, zero_window, tmp):
    torch.manual_seed(0)
    task = NanOnRankOne(zero_window)
    trainer = Trainer(
        max_epochs=2, strategy=strategy, accumulate_grad_batches=2, nonfinite_loss=mode, **quiet(default_root_dir=tmp)
    )
    trainer.fit(task, loader(regression_data(64), 4))
    return {k: v.clone() for k, v in task.state_dict().items()}, trainer.global_step


def _fit_both(rank, world_size, mode, zero_window, tmp):
    return {
        strategy: _fit(rank, world_size, strategy, mode, zero_window, f"{tmp}/{strategy}") for strategy in STRATEGIES
    }


STRATEGIES = ("bucketed_ddp", "native_ddp")


def test_skip_drops_the_window_on_every_rank(tmp_path):
    skipped = run_distributed(_fit_both, 2, args=("skip", False, str(tmp_path / "a")), timeout=120)
    # Reference: the same run where that window's gradients are zero on every rank; plain SGD then leaves the
    # weights exactly as a skipped step does (one more step is counted).
    reference = run_distributed(_fit_both, 2, args=("raise", True, str(tmp_path / "b")), timeout=120)
    for strategy in STRATEGIES:
        # bucketed_ddp is bit-exact; torch's DDP rounds one ulp differently once its reducer saw a forward
        # without a backward (its own bucket bookkeeping), so it gets float32 rounding as tolerance.
        tolerance = {"atol": 0, "rtol": 0} if strategy == "bucketed_ddp" else {"atol": 1e-7, "rtol": 1e-6}
        for rank in range(2):
            (weights, steps), (expected, expected_steps) = skipped[rank][strategy], reference[rank][strategy]
            assert steps == expected_steps - 1, strategy
            for name, value in expected.items():
                torch.testing.assert_close(weights[name], value, **tolerance, msg=f"{strategy} {name}")
        for name, value in skipped[0][strategy][0].items():
            assert torch.equal(skipped[1][strategy][0][name], value), (strategy, name)


def test_raise_stops_every_rank_naming_the_rank_and_step(tmp_path):
    outcomes = run_ranks(_fit, 2, args=("bucketed_ddp", "raise", False, str(tmp_path)), timeout=90)
    for outcome in outcomes:
        assert outcome.error is not None, outcome.rank
        assert "NonfiniteLossError: The training loss was NaN or inf on rank 1 of 2 at global_step 1" in outcome.error


def test_bad_option_is_one_clear_error():
    with pytest.raises(OptionError, match=r"nonfinite_loss='ignore'.*raise, skip"):
        Trainer(nonfinite_loss="ignore")


def test_a_launch_headlines_the_rank_whose_loss_was_nan(tmp_path):
    # Every rank raises the same error; the headline names the rank that saw the NaN, not the first to report.
    trainer = Trainer(
        max_epochs=1, accelerator="cpu", devices=2, accumulate_grad_batches=2, **quiet(default_root_dir=str(tmp_path))
    )
    with pytest.raises(WorkerFailedError, match=r"^Worker rank 1 of 2 failed during fit: NonfiniteLossError"):
        trainer.fit(NanOnRankOne(), loader(regression_data(64), 4))


class NanAtBatchTwo(Regressor):
    """One process: the loss of batch 2 of the first epoch is NaN."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.current_epoch == 0 and batch_idx == 2 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_process_raises_before_the_step_or_skips_the_window_as_plain_torch_would(accumulate):
    """In one process the verdict is this process's own (no all-reduce): "raise" stops before the step that would
    apply the NaN, naming it; "skip" leaves the weights where plain torch leaves them when it skips that window
    (SGD, tolerance 0) and counts one step fewer."""
    data = regression_data(32)
    torch.manual_seed(0)
    raising = NanAtBatchTwo()
    trainer = Trainer(**quiet(max_epochs=1, accumulate_grad_batches=accumulate))
    with pytest.raises(NonfiniteLossError, match=f"rank 0 of 1 at global_step {2 // accumulate}"):
        trainer.fit(raising, loader(data, 4))
    assert trainer.global_step == 2 // accumulate

    torch.manual_seed(0)
    skipping, plain = NanAtBatchTwo(), Regressor()
    plain.load_state_dict(skipping.state_dict())
    trainer = Trainer(**quiet(max_epochs=1, accumulate_grad_batches=accumulate, nonfinite_loss="skip"))
    with pytest.warns(UserWarning, match="the step was skipped on every rank"):
        trainer.fit(skipping, loader(data, 4))
    optimizer = torch.optim.SGD(plain.parameters(), lr=plain.lr)
    batches = list(loader(data, 4))
    windows = [batches[i : i + accumulate] for i in range(0, len(batches), accumulate)]
    skipped_window = 2 // accumulate
    for w, window in enumerate(windows):
        if w == skipped_window:
            continue
        optimizer.zero_grad()
        for x, y in window:
            (torch.nn.functional.mse_loss(plain(x), y) / accumulate).backward()
        optimizer.step()
    assert trainer.global_step == len(windows) - 1
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(skipping.state_dict()[name], value, rtol=0, atol=0)
