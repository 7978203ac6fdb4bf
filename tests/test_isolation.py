"""Every test runs in its own temporary folder, and the suite notices a write into the checkout's run folders."""

from __future__ import annotations

from pathlib import Path

from syncline.trainer import Trainer
from tests.conftest import ROOT, SLOWEST_FILES, run_folder_files


def test_a_test_works_in_its_own_temporary_folder(tmp_path):
    assert Path.cwd() == tmp_path
    assert Trainer(logger=False, enable_progress_bar=False).default_root_dir == str(tmp_path)


def test_the_run_folder_check_sees_a_new_or_rewritten_file(tmp_path):
    (tmp_path / "outputs" / "2026-01-01").mkdir(parents=True)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.py").write_text("code, not a run folder")
    before = run_folder_files(tmp_path)
    (tmp_path / "outputs" / "2026-01-01" / "config.yaml").write_text("a")
    (tmp_path / "last.ckpt").write_bytes(b"b")
    (tmp_path / "src" / "model.py").write_text("edited")
    after = run_folder_files(tmp_path)
    assert set(after) - set(before) == {"outputs/2026-01-01/config.yaml", "last.ckpt"}


def test_the_slowest_files_that_start_first_exist():
    assert [name for name in SLOWEST_FILES if not (ROOT / name).is_file()] == []
