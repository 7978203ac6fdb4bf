"""One import namespace: syncline installs under `syncline` only, and a user's own files cannot shadow it."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: File names a user's project commonly holds; each raises if Python ever imports it.
SHADOWS = ("trainer", "callbacks", "strategies", "examples")


def _run(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE", "PYTHONPATH")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def shadowing_folder(tmp_path: Path) -> Path:
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"raise RuntimeError('the user\\'s own {name}.py was imported')\n")
    return tmp_path


def test_user_files_named_like_the_folders_do_not_shadow_the_import(shadowing_folder):
    code = (
        "from syncline import Task, Trainer; import syncline.callbacks, syncline.strategies; print(Trainer.__module__)"
    )
    result = _run("-c", code, cwd=shadowing_folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "syncline.trainer.trainer"


def test_user_files_named_like_the_folders_do_not_shadow_the_cli(shadowing_folder):
    result = _run(
        "-m",
        "syncline",
        f"hydra.run.dir={shadowing_folder / 'run'}",
        "trainer.max_steps=2",
        "task.n_layer=1",
        "task.n_embd=16",
        "task.n_head=2",
        "task.max_chars=20000",
        "task.sample_chars=10",
        "trainer.limit_val_batches=1",
        cwd=shadowing_folder,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sample after 2 steps" in result.stdout
    assert (shadowing_folder / "run" / "config.yaml").is_file()


def test_the_wheel_puts_only_syncline_at_the_top_level(tmp_path):
    """Build the wheel (no isolation, no download) and list what it would put in site-packages."""
    # From a copy: setuptools writes build/ and *.egg-info/ into the tree it builds.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "runs"))
    result = _run(
        "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source), cwd=tmp_path
    )
    if result.returncode != 0 and "No module named" in result.stderr:
        pytest.skip(f"cannot build a wheel here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = tmp_path.glob("syncline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"syncline"}
    for module in ("__init__.py", "__main__.py", "trainer/cli.py", "trainer/conf/config.yaml", "examples/char_gpt.py"):
        assert f"syncline/{module}" in names, module
    # The network lab installs (it runs a user's task from their folder); the paper's experiments and results do not.
    for module in ("__main__.py", "cli.py", "cluster.py", "strategies.py", "tradeoff.py", "bound.py", "faults.py"):
        assert f"syncline/lab/{module}" in names, module
    assert not [n for n in names if n.startswith(("syncline/tests/", "syncline/benchmarks/", "syncline/docs/"))]
    paper = ("lab_ddp.py", "lab_deferred_update.py", "lab_section.py")
    assert not [n for n in names if n.startswith("syncline/lab/") and n.rsplit("/", 1)[-1] in paper]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "syncline = syncline.trainer.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_every_lab_module_imports_as_syncline_lab_outside_the_checkout(tmp_path):
    """The lab is part of the installed package: none of its modules may import the (not installed) suite."""
    code = (
        "import importlib, pkgutil, syncline.lab as lab\n"
        "for module in pkgutil.iter_modules(lab.__path__):\n"
        "    if module.name != '__main__':\n"
        "        importlib.import_module(f'syncline.lab.{module.name}')\n"
        "import sys; assert not [m for m in sys.modules if m.startswith(('benchmarks', 'syncline.benchmarks'))]\n"
    )
    result = _run("-c", code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
