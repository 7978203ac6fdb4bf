"""Fixtures shared by the whole suite, and a check that no test touched the checkout's run folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

#: The folders a run writes into its working directory (the command line's `outputs/` and `multirun/`, a
#: Trainer's `logs/`, `lightning_logs/`, `checkpoints/`, `last.ckpt`), and the committed benchmark results.
#: Every test works in its own temporary folder, so none of these may change while the suite runs.
RUN_FOLDERS = ("outputs", "multirun", "logs", "lightning_logs", "checkpoints", "runs", "benchmarks/results")


@pytest.fixture(autouse=True)
def _restore_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run each test in its own temporary working directory; afterwards restore environment variables, the
    default process group and torch's thread count."""
    monkeypatch.chdir(tmp_path)
    environ = dict(os.environ)
    threads = torch.get_num_threads()
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


def run_folder_files(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """Every file under the checkout's run folders (and ``last*.ckpt`` at its top), with size and mtime."""
    found = {}
    paths = [p for name in RUN_FOLDERS if (root / name).is_dir() for p in (root / name).rglob("*")]
    paths += list(root.glob("*.ckpt"))
    for path in paths:
        if path.is_file():
            stat = path.stat()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller, not an xdist worker
        session.config.stash[_BEFORE] = run_folder_files()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    after = run_folder_files()
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    if changed:
        listed = "\n  ".join(changed[:20])
        session.config.get_terminal_writer().line(
            f"\nThe suite wrote into the checkout's run folders (a test must work in tmp_path):\n  {listed}",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[dict]()
