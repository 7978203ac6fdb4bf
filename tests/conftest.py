"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_environment():
    """Restore environment variables, the default process group and torch's thread count after a test."""
    environ = dict(os.environ)
    threads = torch.get_num_threads()
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)
