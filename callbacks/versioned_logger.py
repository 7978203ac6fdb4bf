"""`VersionedLogger`: a logger whose files live in ``save_dir/name/version_N``, continued on resume."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from syncline.callbacks.logger import Logger
from syncline.options import check_int

__all__ = ["VersionedLogger"]

_VERSION_DIR = re.compile(r"version_(\d+)$")


class VersionedLogger(Logger):
    """Base of the loggers that write under ``save_dir/name/version_N``.

    Without an explicit `version`, N is one more than the highest ``version_*`` directory found when the
    directory is first needed. A checkpoint stores N, so a resumed run continues in the same directory;
    `resuming` then tells the subclass to discard what the crashed run wrote after the checkpoint.

    Args:
        save_dir: root directory of all runs.
        name: experiment name, a subdirectory of `save_dir`.
        version: run number; a string names the directory itself (as in Lightning); None picks the next free
            number.
    """

    def __init__(self, save_dir: str | os.PathLike[str], name: str, version: int | str | None = None) -> None:
        if not isinstance(version, str):
            check_int(
                type(self).__name__,
                "version",
                version,
                0,
                none_ok=True,
                meaning="a name, or None for the next free one",
            )
        self.save_dir = str(save_dir)
        self.name = name
        self._given_version = version
        self._version = version
        #: Set by `load_state_dict` when this run continues the directory of a checkpointed run.
        self.resuming = False
        #: Set by subclasses once they have written to `log_dir`; the version is fixed from then on.
        self._started = False

    @property
    def version(self) -> int | str:
        """The run number N of ``version_N``, or the name given as a string (the directory's own name)."""
        if self._version is None:
            self._version = _next_version(Path(self.save_dir, self.name))
        return self._version

    @property
    def log_dir(self) -> str:
        """Directory of this run's files."""
        version = self.version
        return os.path.join(self.save_dir, self.name, version if isinstance(version, str) else f"version_{version}")

    def state_dict(self) -> dict[str, Any]:
        """Return the version, so a resumed run writes to the same directory."""
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue in the checkpoint's version directory unless a version was given or writing began."""
        saved = state.get("version")
        if saved is None or self._started:
            return
        if self._given_version is None:
            self._version = saved
        self.resuming = self._version == saved

    def save_hparams_file(self, params: dict[str, Any]) -> None:
        """Write `params` to ``log_dir/hparams.yaml``."""
        os.makedirs(self.log_dir, exist_ok=True)
        self._started = True
        with open(os.path.join(self.log_dir, "hparams.yaml"), "w") as file:
            yaml.safe_dump(params, file, sort_keys=False)


def _next_version(root: Path) -> int:
    if not root.is_dir():
        return 0
    found = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))]
    return max(found, default=-1) + 1
