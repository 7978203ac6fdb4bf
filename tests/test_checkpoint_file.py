"""Checkpoint files: an empty or truncated one is named clearly; a full disk leaves the previous file intact."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from syncline.callbacks import ModelCheckpoint
from syncline.checkpoint_file import CheckpointError, load_checkpoint, save_checkpoint
from syncline.trainer import Trainer
from syncline.trainer.launcher import WorkerFailedError
from tests.trainer._tasks import Regressor, loader, quiet, regression_data
from tests.trainer.test_cli import SMALL, _assert_short_error, _cli


def _good_checkpoint(tmp_path):
    path = tmp_path / "good.ckpt"
    trainer = Trainer(max_steps=1, **quiet())
    trainer.fit(Regressor(), loader(regression_data(16)))
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("keep", [0, 10, 0.5, -1], ids=["empty", "10-bytes", "half", "last-byte-missing"])
def test_truncated_checkpoint_is_the_clear_unreadable_error(tmp_path, keep):
    data = _good_checkpoint(tmp_path).read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=f"Cannot read checkpoint {truncated}: .*truncated"):
        load_checkpoint(truncated)
    with pytest.raises(CheckpointError, match=f"Cannot read checkpoint {truncated}"):
        Trainer(max_steps=2, **quiet()).fit(Regressor(), loader(regression_data(16)), ckpt_path=truncated)


def test_cli_zero_byte_checkpoint_is_one_short_error(tmp_path):
    empty = tmp_path / "empty.ckpt"
    empty.touch()
    result = _cli(f"hydra.run.dir={tmp_path / 'run'}", f"ckpt_path={empty}", *SMALL, cwd=tmp_path, timeout=60)
    _assert_short_error(result, 1, str(empty), "empty (0 bytes)")


_FULL_DISK = """
    import sys, torch
    from pathlib import Path
    from syncline.checkpoint_file import CheckpointError, save_checkpoint
    target = Path(sys.argv[1]) / "last.ckpt"
    save_checkpoint({"w": torch.zeros(10)}, target)  # small: fits
    before = target.read_bytes()
    try:
        save_checkpoint({"w": torch.zeros(200_000)}, target)  # 800 kB on a 256 kB disk
    except CheckpointError as error:
        print(error)
    assert target.read_bytes() == before, "the previous last.ckpt changed"
    print("left:", sorted(p.name for p in target.parent.iterdir()))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a small tmpfs")
def test_full_disk_names_the_path_and_the_bytes_and_keeps_the_previous_file(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # A private mount namespace with a 256 kB tmpfs: a real full disk, without touching the machine's.
    code = textwrap.dedent(_FULL_DISK)
    script = f"mount -t tmpfs -o size=256k tmpfs {disk} && exec {sys.executable} -c '{code}' {disk}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "mount" in result.stderr and "Traceback" not in result.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"Cannot write checkpoint {disk / 'last.ckpt'}: the disk is full. It needs 80" in lines[0]
    assert "bytes are free" in lines[0]
    assert lines[1] == "left: ['last.ckpt']"  # no temporary file left behind


def test_save_checkpoint_reports_the_exact_size(tmp_path):
    """The byte count in the full-disk message is the size the file would have had."""
    from syncline.checkpoint_file import _ByteCounter

    checkpoint = {"w": torch.arange(1000.0)}
    save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    counter = _ByteCounter()
    torch.save(checkpoint, counter)
    assert counter.size == (tmp_path / "a.ckpt").stat().st_size


@contextlib.contextmanager
def _read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder nothing can be written into: by its mode, or (for root, which ignores modes) a read-only mount."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        yield Path("/sys/kernel/syncline-checkpoints")  # no mount allowed: sysfs refuses new folders, even to root
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


class _NeverTrains(Regressor):
    def training_step(self, batch, batch_idx):
        raise AssertionError("trained although the checkpoint folder cannot be written")


def test_a_read_only_checkpoint_folder_is_refused_at_setup_on_every_rank(tmp_path: Path) -> None:
    with _read_only_folder(tmp_path) as folder:
        trainer = Trainer(
            max_steps=2,
            accelerator="cpu",
            devices=2,
            logger=False,
            enable_progress_bar=False,
            callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)],
        )
        with pytest.raises(WorkerFailedError) as raised:
            trainer.fit(_NeverTrains(), loader(regression_data(16)))
    message = str(raised.value)
    assert "failed during fit: CheckpointError" in message, message
    assert f"ModelCheckpoint cannot write checkpoints into {folder}: " in message, message
    assert "trained although" not in message
