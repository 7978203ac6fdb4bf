"""Verified checkpoints: SIGKILL mid-save keeps the previous file; damaged, foreign or code files are refused."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from syncline.checkpoint_file import CheckpointError, load_checkpoint, save_checkpoint
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

_SAVER = """
    import sys, torch
    from syncline.checkpoint_file import save_checkpoint
    target, step = sys.argv[1], int(sys.argv[2])
    while True:
        step += 1
        # 4 MB, so that most moments of the loop are inside a save.
        save_checkpoint({"syncline_format": 2, "step": step, "w": torch.full((1_000_000,), float(step))}, target)
        print(step, flush=True)
"""


def test_sigkill_at_random_moments_of_a_save_leaves_the_previous_file_loadable(tmp_path):
    target = tmp_path / "last.ckpt"
    save_checkpoint({"syncline_format": 2, "step": 0, "w": torch.zeros(1_000_000)}, target)
    rng, step = random.Random(10), 0
    for _ in range(5):
        saver = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_SAVER), str(target), str(step)], stdout=subprocess.PIPE, text=True
        )
        try:
            saver.stdout.readline()  # it has finished one save and is inside the next
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(saver.pid, signal.SIGKILL)
        finally:
            printed = [int(line) for line in saver.stdout.read().split()]
            saver.wait(timeout=30)
        assert saver.returncode == -signal.SIGKILL
        checkpoint = load_checkpoint(target)
        # The newest completed save (or, killed between rename and print, the one after it), never a mix.
        assert checkpoint["step"] >= (printed[-1] if printed else step + 1)
        assert torch.equal(checkpoint["w"], torch.full((1_000_000,), float(checkpoint["step"])))
        step = checkpoint["step"]
    assert step >= 5


def _good_checkpoint(tmp_path, **task_options):
    path = tmp_path / "good.ckpt"
    trainer = Trainer(max_steps=1, **quiet())
    trainer.fit(Regressor(**task_options), loader(regression_data(16)))
    trainer.save_checkpoint(path)
    return path


def test_a_changed_byte_fails_the_checksum(tmp_path):
    path = _good_checkpoint(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"Cannot read checkpoint {path}: the SHA-256 of its payload"):
        load_checkpoint(path)


def test_foreign_files_are_named(tmp_path):
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=f"Cannot read checkpoint {text}: it is not a syncline checkpoint"):
        load_checkpoint(text)
    bare = tmp_path / "bare.pt"
    torch.save({"weight": torch.zeros(2)}, bare)
    with pytest.raises(CheckpointError, match=f"{bare} is not a syncline checkpoint"):
        load_checkpoint(bare)


def test_model_shape_mismatch_names_file_parameter_and_shapes(tmp_path):
    path = _good_checkpoint(tmp_path)
    other = Regressor(features=4)
    message = (
        rf"{path} does not fit Regressor: parameter 'net.0.weight' was saved with shape \(16, 8\), "
        r"the task has \(16, 4\)"
    )
    with pytest.raises(CheckpointError, match=message):
        Trainer(max_steps=2, **quiet()).fit(other, loader(regression_data(16, features=4)), ckpt_path=path)


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["syncline", "torch.save"])
def test_a_pickle_that_runs_code_is_refused(tmp_path, writer):
    marker, path = tmp_path / "ran", tmp_path / "evil.ckpt"
    payload = {"syncline_format": 2, "state_dict": {}, "hook": _RunsCode(marker)}
    (save_checkpoint if writer == "syncline" else torch.save)(payload, path)
    with pytest.raises(CheckpointError, match=f"Refusing to load checkpoint {path}: .*never runs code"):
        load_checkpoint(path)
    assert not marker.exists()
