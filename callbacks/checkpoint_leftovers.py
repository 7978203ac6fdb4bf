"""What a checkpoint directory holds after a crash: stale temporary files, and top-k files nobody tracks."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch

from syncline.checkpoint_file import TMP_PREFIX, TMP_SUFFIX

__all__ = ["find_top_k_files", "remove_stale_temporaries"]

#: ``save_checkpoint``'s temporary names: ``.<name>.ckpt.<8 random characters from mkstemp>.tmp``.
_TEMPORARY = re.compile(re.escape(TMP_PREFIX) + r".+\.ckpt\.[A-Za-z0-9_]{8}" + re.escape(TMP_SUFFIX) + "$")


def remove_stale_temporaries(dirpath: str | os.PathLike[str]) -> list[str]:
    """Delete the temporary files that saves killed halfway left in `dirpath`; return their names.

    Only names of syncline's own pattern go: nothing else in the directory is touched. Call it before
    training starts, when no save of this run can be in progress.
    """
    directory = Path(dirpath)
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.iterdir():
        if _TEMPORARY.match(path.name) and path.is_file():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            removed.append(path.name)
    return sorted(removed)


def find_top_k_files(dirpath: str | os.PathLike[str], state_key: str | list[str]) -> dict[str, float]:
    """Return the top-k checkpoints in `dirpath` saved by a ModelCheckpoint with `state_key`, with their scores.

    Each top-k checkpoint stores its callback's bookkeeping, which already lists the file itself with its
    score (the monitored value, or the global step without a monitor): that is read back, so files a
    crashed run wrote after the checkpoint being resumed are found again. ``last*.ckpt`` files and
    unreadable files are skipped.
    """
    directory = Path(dirpath)
    if not directory.is_dir():
        return {}
    found: dict[str, float] = {}
    for path in sorted(directory.glob("*.ckpt")):
        if path.name.startswith("last"):
            continue
        try:
            # mmap: the tensors stay on disk; only the small bookkeeping is read.
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            states = checkpoint["callbacks"]
            key = next(key for key in ([state_key] if isinstance(state_key, str) else state_key) if key in states)
            saved = states[key]["best_k_models"]
        except Exception:  # not ours, another callback's, or unreadable: leave it alone
            continue
        # Matched by file name, so a directory that was moved or mounted elsewhere still counts.
        scores = [score for name, score in saved.items() if os.path.basename(name) == path.name]
        if scores:
            found[os.path.realpath(path)] = float(scores[0])
    return found
