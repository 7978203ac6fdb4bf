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
        name: experiment name, a subdirectory of `save_dir`; None or "" puts the versions in `save_dir` itself.
        version: run number; a string names the directory itself (as in Lightning); None picks the next free
            number.
        sub_dir: a subdirectory of the version directory that `log_dir` names (Lightning's `sub_dir`).

    As in Lightning, a subclass may override the `name` and `version` properties.
    """

    #: The hyperparameters' file in `log_dir`.
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None,
        version: int | str | None = None,
        sub_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(version, str):
            check_int(
                type(self).__name__,
                "version",
                version,
                0,
                none_ok=True,
                meaning="a name, or None for the next free one",
            )
        self._save_dir = os.path.expanduser(os.fspath(save_dir))
        self._name = name or ""
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        #: The hyperparameters logged so far (what `save` writes to ``hparams.yaml``).
        self.hparams: dict[str, Any] = {}
        self._given_version = version
        self._version = version
        #: Set by `load_state_dict` when this run continues the directory of a checkpointed run.
        self.resuming = False
        #: Set by subclasses once they have written to `log_dir`; the version is fixed from then on.
        self._started = False
        #: Whether ``hparams.yaml`` holds `hparams` (so `save` has nothing to write).
        self._hparams_written = False

    @property
    def save_dir(self) -> str:
        """Root directory of all runs."""
        return self._save_dir

    @property
    def name(self) -> str:
        """The experiment's name: the subdirectory of `save_dir` ("" for none)."""
        return self._name

    @property
    def root_dir(self) -> str:
        """``save_dir/name``: the directory holding every version."""
        return os.path.join(self.save_dir, self.name) if self.name else self.save_dir

    @property
    def version(self) -> int | str:
        """The run number N of ``version_N``, or the name given as a string (the directory's own name)."""
        if self._version is None:
            self._version = _next_version(Path(self.root_dir))
        return self._version

    @property
    def log_dir(self) -> str:
        """Directory of this run's files: ``root_dir/version_N`` (and `sub_dir`)."""
        version = self.version
        path = os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")
        return os.path.join(path, self._sub_dir) if self._sub_dir is not None else path

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
        self.hparams.update(params)
        os.makedirs(self.log_dir, exist_ok=True)
        self._started = True
        with open(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), "w") as file:
            yaml.safe_dump(self.hparams, file, sort_keys=False)
        self._hparams_written = True


def _next_version(root: Path) -> int:
    if not root.is_dir():
        return 0
    found = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))]
    return max(found, default=-1) + 1
