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

#: The test files that take longest (started processes, rendezvous, CLI runs), longest first, from the per-test
#: durations of whole-suite runs. They start first: `--dist loadfile` hands files to the workers in collection
#: order (pyproject turns xdist's own order, by count of tests, off), and a long file started last leaves one
#: worker busy alone at the end. Keep the longest few here; the order of the rest matters little.
SLOWEST_FILES = (
    "tests/trainer/test_cli_own_task.py",
    "tests/trainer/test_live_recovery.py",
    "tests/trainer/test_cli_resume.py",
    "tests/strategies/test_worker_guard.py",
    "tests/trainer/test_cli.py",
    "tests/trainer/test_preemption.py",
    "tests/benchmarks/test_benchmarks_smoke_curves.py",
    "tests/trainer/test_elastic_restart.py",
    "tests/trainer/test_distributed_trainer.py",
    "tests/benchmarks/test_lab_faults.py",
    "tests/trainer/test_manual_distributed.py",
    "tests/benchmarks/test_benchmarks_smoke_strategies.py",
    "tests/trainer/test_cli_stops.py",
    "tests/benchmarks/test_gpt2_study_smoke.py",
    "tests/trainer/test_datamodule.py",
    "tests/test_namespace.py",
    "tests/trainer/test_launcher.py",
    "tests/benchmarks/test_benchmarks_smoke_overhead.py",
    "tests/test_options.py",
    "tests/callbacks/test_checkpoint_monitor.py",
    "tests/benchmarks/test_cluster.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the slowest files first, then the rest by count of tests (most first), each file's tests together
    and in their own order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    counts: dict[str, int] = {}
    for item in items:
        counts[item.nodeid.split("::")[0]] = counts.get(item.nodeid.split("::")[0], 0) + 1

    def order(item: pytest.Item) -> tuple[int, int]:
        name = item.nodeid.split("::")[0]
        return rank.get(name, len(rank)), -counts[name]

    items.sort(key=order)
