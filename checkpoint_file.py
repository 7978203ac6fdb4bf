"""Reading and writing checkpoint files: atomically, verified, and with errors that name the file.

A checkpoint file is the zip that ``torch.save`` writes (the payload), then a fixed 64-byte trailer::

    magic (16 bytes) | format version (uint32) | payload size (uint64) | SHA-256 of the payload (32) | 4 zero bytes

The payload streams through the hash as it is written, and the trailer comes last. Zip readers find their
directory from the end and skip trailing bytes, so ``torch.load`` still reads the file as it is. Loading
checks magic, version, size and hash before it unpickles anything, and unpickles with ``weights_only=True``,
so a file never runs code. Files of format 1 (a bare ``torch.save`` zip, no trailer) still load, unverified.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import struct
import tempfile
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "check_writable_folder",
    "load_checkpoint",
    "require_entries",
    "save_checkpoint",
    "to_primitive",
]

#: Format version written into every checkpoint, checked when one is read.
FORMAT_VERSION = 2
MAGIC = b"SYNCLINE-CKPT\x00\x00\x00"
_TRAILER = struct.Struct("<16sIQ32s4x")
_CHUNK = 8 << 20
#: A save in progress writes ``.<name>.<random>.tmp`` beside its target, then renames it.
TMP_PREFIX, TMP_SUFFIX = ".", ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable or not a syncline checkpoint."""


def check_writable_folder(directory: str | os.PathLike[str], owner: str = "ModelCheckpoint") -> None:
    """Raise unless a checkpoint can be written into `directory` (created if needed); leave nothing behind.

    Tried for real (a file is created and removed, folders that did not exist are made and removed), not
    judged by permission bits, which say nothing of a read-only mount, of root, or of access lists.

    Raises:
        CheckpointError: naming the folder, the reason and the fix.
    """
    folder = Path(directory)
    made = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f"{TMP_PREFIX}write-check.", suffix=TMP_SUFFIX, dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise CheckpointError(
            f"{owner} cannot write checkpoints into {folder}: {error.strerror or error}. Make the folder "
            "writable, or pass another dirpath (or default_root_dir)."
        ) from None
    finally:
        for parent in made:  # deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint file at the path given: a `FileNotFoundError` too, as Lightning raises it."""


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write `checkpoint` to `path` so that a crash never leaves a truncated or missing file.

    The data goes to a temporary file in the same directory, is flushed and fsynced, then renamed over
    `path` in one step; the directory is fsynced so the rename itself survives a power loss. Until the
    rename, an existing file at `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        # mkstemp creates the file 0600; give it the permissions `torch.save` (open) would, so a TensorBoard
        # or evaluation service under another account can read it where the umask allows.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as file:
            _write_verified(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_name, path)
    except Exception as error:
        Path(tmp_name).unlink(missing_ok=True)
        # A full disk surfaces as ENOSPC from a plain write, but as a RuntimeError from torch's zip writer
        # ("unexpected pos"): tell it by the space the file needs.
        message = _no_space_message(checkpoint, path, error)
        if message is not None:
            raise CheckpointError(message) from error
        raise
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def _umask() -> int:
    """Return this process's umask without changing it (Linux's /proc), else by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_verified(checkpoint: dict[str, Any], file: Any) -> None:
    """Write the payload through a hash, then the trailer that holds the hash."""
    writer = _HashingWriter(file)
    torch.save(checkpoint, writer)
    file.write(_TRAILER.pack(MAGIC, FORMAT_VERSION, writer.size, writer.sha256.digest()))


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it to `file`."""

    def __init__(self, file: Any) -> None:
        self.file, self.size, self.sha256 = file, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class _ByteCounter:
    """A write-only file that counts what `torch.save` writes to it, plus the header (a file's size)."""

    def __init__(self) -> None:
        self.size = _TRAILER.size

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _no_space_message(checkpoint: dict[str, Any], path: Path, error: Exception) -> str | None:
    """Return the error for a save that failed for lack of space, or None if space was not the cause."""
    no_space = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    counter = _ByteCounter()
    try:
        torch.save(checkpoint, counter)
        free = shutil.disk_usage(path.parent).free
    except Exception:  # the failure was not about space; report it as it is
        return None
    if not no_space and free >= counter.size:
        return None
    limit = isinstance(error, OSError) and error.errno == errno.EFBIG
    reason = "the file size limit (ulimit -f) was reached" if limit else "the disk is full"
    return (
        f"Cannot write checkpoint {path}: {reason}. It needs {counter.size:,} bytes; {free:,} bytes are free "
        f"in {path.parent}. The previous file at that path, if any, is unchanged. Free some space or "
        "point the checkpoints elsewhere (ModelCheckpoint(dirpath=...) or trainer.default_root_dir)."
    )


def fsync_directory(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (where the platform can open a folder to sync it)."""
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
        raise CheckpointNotFoundError(f"Checkpoint file not found: {path} (check ckpt_path).")
    if path.stat().st_size == 0:
        raise CheckpointError(f"Cannot read checkpoint {path}: the file is empty (0 bytes). {_UNREADABLE}")
    _verify(path)
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        # Some failures (a truncated zip) come with an empty message: name the type alone then.
        detail = next(iter(str(error).splitlines()), "").strip()
        reason = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
        if "weights_only" in str(error) or "Unsupported global" in str(error):
            raise CheckpointError(
                f"Refusing to load checkpoint {path}: it holds pickled objects other than tensors and plain "
                f"data ({reason}). syncline never runs code from a checkpoint; load only files it wrote."
            ) from error
        raise CheckpointError(f"Cannot read checkpoint {path}: {reason}. {_UNREADABLE}") from error
    if not isinstance(checkpoint, dict) or "syncline_format" not in checkpoint:
        raise CheckpointError(f"{path} is not a syncline checkpoint (no 'syncline_format' entry).")
    if checkpoint["syncline_format"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer syncline (format {checkpoint['syncline_format']}); upgrade syncline."
        )
    return checkpoint


def require_entries(checkpoint: dict[str, Any], names: tuple[str, ...], source: Any) -> None:
    """Raise one error naming `source` and every entry of `names` that `checkpoint` lacks.

    Raises:
        CheckpointError: entries are missing (a file edited, or written by another program).
    """
    missing = [name for name in names if name not in checkpoint]
    if missing:
        raise CheckpointError(
            f"Checkpoint {source} lacks {', '.join(repr(name) for name in missing)} (it has "
            f"{', '.join(repr(key) for key in checkpoint) or 'nothing'}): it was not written whole by "
            "Trainer.save_checkpoint or ModelCheckpoint, or was edited since. Resume from another checkpoint, "
            "or start without one."
        )


def _verify(path: Path) -> None:
    """Check the file's trailer against its payload; a format-1 file (no trailer) passes unverified."""
    size_on_disk = path.stat().st_size
    with open(path, "rb") as file:
        start = file.read(2)
        file.seek(max(0, size_on_disk - 2 * _TRAILER.size))
        end = file.read()
        tail = end[-_TRAILER.size :]
        if not tail.startswith(MAGIC) or len(tail) < _TRAILER.size:
            if MAGIC[:8] in end:
                raise CheckpointError(f"Cannot read checkpoint {path}: its trailer is truncated. {_UNREADABLE}")
            if start == b"PK":  # format 1, or a save cut short: torch.load tells which
                return
            raise CheckpointError(
                f"Cannot read checkpoint {path}: it is not a syncline checkpoint (no torch.save zip, no "
                f"syncline trailer). {_UNREADABLE}"
            )
        _, version, size, digest = _TRAILER.unpack(tail)
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{path} was written by a newer syncline (format {version}); upgrade syncline.")
        if size != size_on_disk - _TRAILER.size:
            raise CheckpointError(
                f"Cannot read checkpoint {path}: its payload is {size_on_disk - _TRAILER.size:,} bytes, the trailer "
                f"says {size:,} (truncated or spliced). {_UNREADABLE}"
            )
        file.seek(0)
        sha256 = hashlib.sha256()
        while size > 0:
            chunk = file.read(min(size, _CHUNK))
            if not chunk:
                break
            sha256.update(chunk)
            size -= len(chunk)
    if sha256.digest() != digest:
        raise CheckpointError(
            f"Cannot read checkpoint {path}: the SHA-256 of its payload does not match the one saved with "
            f"it (the file was changed or damaged after it was written). {_UNREADABLE}"
        )


_UNREADABLE = (
    "The file is truncated, corrupt or was not written by syncline; "
    "resume from another checkpoint (another ckpt_path) or start without one."
)


def to_primitive(value: Any) -> Any:
    """Return `value` as plain dicts, lists, strings and numbers (for checkpoints and loggers); an
    `argparse.Namespace` is a dict, anything else (a class, a complex number) its text."""
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): to_primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_primitive(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
