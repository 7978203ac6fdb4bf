"""ProgressBar: plain lines off a terminal, throttled bars on one, silence on other ranks."""

from __future__ import annotations

import io
import re
import sys

import pytest

import syncline.callbacks.progress as progress
from syncline.callbacks import ProgressBar
from tests.callbacks._tasks import FakeRank, Scripted, make_loader, make_trainer


class FakeTerminal(io.StringIO):
    """A stderr that claims to be a terminal, so tqdm bars are drawn into it."""

    def isatty(self) -> bool:
        return True


class CountingBar(ProgressBar):
    """Counts how often metrics are read and formatted (each read is a host sync for tensors)."""

    formatted = 0

    def _postfix(self, trainer):
        CountingBar.formatted += 1
        return super()._postfix(trainer)


def _fit(tmp_path, bar, epochs=1, batches=20, validate=True, **kwargs):
    trainer = make_trainer(tmp_path, max_epochs=epochs, callbacks=[bar], enable_progress_bar=True, **kwargs)
    task = Scripted(prog_bar=True)
    trainer.fit(task, make_loader(batches), make_loader(2) if validate else None)
    return trainer, task


def test_plain_lines_every_n_steps_when_not_a_terminal(tmp_path, capsys):
    _fit(tmp_path, ProgressBar(print_every_n_steps=5), epochs=2)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    epoch_0 = [line for line in lines if line.startswith("Epoch 0")]
    assert [re.search(r"\[(\d+)/20\]", line).group(1) for line in epoch_0] == ["5", "10", "15", "20"]
    # The loss once: the task shows it as train_loss, so the bar adds no loss= of its own.
    assert all(" train_loss=" in line and " loss=" not in line and "it/s" in line for line in epoch_0)
    # The epoch's last line comes after its validation and shows the validation metric.
    validation = [i for i, line in enumerate(lines) if line.startswith("Validation [2 batches] val_loss=")]
    assert len(validation) == 2
    assert lines[validation[0] + 1].startswith("Epoch 0 [20/20]") and "val_loss=" in lines[validation[0] + 1]
    assert len(lines) == 2 * (4 + 1)


def test_default_is_about_ten_lines_per_epoch(tmp_path, capsys):
    _fit(tmp_path, ProgressBar(), batches=40, validate=False)
    lines = capsys.readouterr().err.splitlines()
    assert [re.search(r"\[(\d+)/40\]", line).group(1) for line in lines] == [str(n) for n in range(4, 41, 4)]


def test_standalone_validate_and_test_print_one_line_each(tmp_path, capsys):
    trainer = make_trainer(tmp_path, callbacks=[ProgressBar()], enable_progress_bar=True)
    task = Scripted(prog_bar=True)
    trainer.validate(task, make_loader(3))
    trainer.test(task, make_loader(2))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("Validation [3 batches] val_loss=")
    assert lines[1].startswith("Testing [2 batches] test_loss=")


def test_terminal_bar_is_redrawn_only_when_due(tmp_path, monkeypatch):
    """With 0.03 s per batch and a 0.1 s refresh, 40 batches format metrics about 10 times, not 40."""
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    clock = [0.0]
    monkeypatch.setattr(progress, "monotonic", lambda: clock[0])

    class Slow(Scripted):
        def training_step(self, batch, batch_idx):
            clock[0] += 0.03
            return super().training_step(batch, batch_idx)

    CountingBar.formatted = 0
    trainer = make_trainer(tmp_path, callbacks=[CountingBar()], enable_progress_bar=True)
    trainer.fit(Slow(prog_bar=True), make_loader(40))

    assert 9 <= CountingBar.formatted <= 14
    output = terminal.getvalue()
    assert "Epoch 0" in output and "40/40" in output
    assert re.search(r"it/s, train_loss=[\d.]+\]", output) and " loss=" not in output


def test_step_loss_is_shown_when_the_task_shows_nothing_of_its_own(tmp_path, capsys):
    bar = ProgressBar(print_every_n_steps=5)
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[bar], enable_progress_bar=True)
    trainer.fit(Scripted(prog_bar=False), make_loader(10))
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(re.search(r"\] loss=[\d.]+ \(", line) for line in lines), lines


def test_refresh_rate_zero_disables_output(tmp_path, capsys):
    _fit(tmp_path, ProgressBar(refresh_rate=0))
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("terminal", [True, False])
def test_nothing_at_all_on_a_non_zero_rank(tmp_path, monkeypatch, capsys, terminal):
    stderr = FakeTerminal() if terminal else sys.stderr
    monkeypatch.setattr(sys, "stderr", stderr)
    if terminal:
        monkeypatch.setenv("RANK", "1")
    # Off a terminal the env stays unset, so only the trainer's own rank can silence the lines.
    trainer, task = _fit(tmp_path, ProgressBar(print_every_n_steps=1), strategy=FakeRank(rank=1))
    trainer.test(task, make_loader(2))
    assert capsys.readouterr() == ("", "")
    if terminal:
        assert stderr.getvalue() == ""
