"""The one place that decides whether this process may print or write files: global rank 0 (every floor uses it)."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["global_rank", "is_global_zero", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]

P = ParamSpec("P")
R = TypeVar("R")


def global_rank() -> int:
    """Return this process's global rank as set by torchrun or syncline's launcher (0 if unset)."""
    return int(os.environ.get("RANK", "0"))


def is_global_zero() -> bool:
    """Return whether this process is global rank 0."""
    return global_rank() == 0


def rank_zero_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Make `fn` run on global rank 0 only; other ranks get None."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if is_global_zero():
            return fn(*args, **kwargs)
        return None

    return wrapped


@rank_zero_only
def rank_zero_info(message: str) -> None:
    """Print `message` to stderr on rank 0."""
    print(message, file=sys.stderr, flush=True)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue a warning on rank 0."""
    warnings.warn(message, category, stacklevel=3)
