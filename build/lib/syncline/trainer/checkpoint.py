"""Reading and writing checkpoint files: atomically, and with errors that name the file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint", "to_primitive"]

#: Format version written into every checkpoint, checked when one is read.
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable or not a syncline checkpoint."""


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write `checkpoint` to `path` so that a crash never leaves a truncated or missing file.

    The data goes to a temporary file in the same directory, is flushed and fsynced, then renamed over
    `path` in one step; the directory is fsynced so the rename itself survives a power loss. Until the
    rename, an existing file at `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`.

    Raises:
        CheckpointError: the file is missing, corrupt or not a syncline checkpoint; the message names it.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint not found: {path} (check ckpt_path).")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"Cannot read checkpoint {path}: {type(error).__name__}: {str(error).splitlines()[0]}. "
            "The file is corrupt or was not written by syncline."
        ) from error
    if not isinstance(checkpoint, dict) or "syncline_format" not in checkpoint:
        raise CheckpointError(f"{path} is not a syncline checkpoint (no 'syncline_format' entry).")
    if checkpoint["syncline_format"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer syncline (format {checkpoint['syncline_format']}); upgrade syncline."
        )
    return checkpoint


def to_primitive(value: Any) -> Any:
    """Return `value` as plain dicts, lists, strings and numbers (for checkpoints and loggers)."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): to_primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_primitive(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
