"""The torch floor pyproject.toml declares is the torch that CI installs, so CI tests the floor."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_declared_torch_floor_is_the_version_ci_installs_and_tests() -> None:
    # tomllib would need Python 3.11; the dependency line is simple enough to match.
    (floor,) = re.findall(r'"torch>=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text())
    pins = set(re.findall(r"torch==(\d+\.\d+)\.\d+", (ROOT / ".ci" / "run").read_text()))
    assert pins == {floor}, f"CI installs torch {pins}, pyproject.toml declares torch>={floor}"
    installed = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert installed >= tuple(int(part) for part in floor.split(".")), torch.__version__
