"""`CSVLogger`: metrics as rows of a CSV file, hyperparameters as YAML."""

from __future__ import annotations

import csv
import os
from typing import Any

from syncline.callbacks.versioned_logger import VersionedLogger
from syncline.trainer.rank_zero import rank_zero_only, rank_zero_warn

__all__ = ["CSVLogger"]


class CSVLogger(VersionedLogger):
    """Write ``metrics.csv`` and ``hparams.yaml`` to ``save_dir/name/version_N``, as Lightning's logger does.

    Each `log_metrics` call appends one row with a ``step`` column. When a call brings a key the
    header lacks, the file is rewritten with the wider header (rows without a value leave it empty).
    A run resumed from a checkpoint keeps the checkpoint's version and drops the rows the crashed run
    wrote at or after its own first logged step.

    Args:
        save_dir: root directory of all runs.
        name: experiment name, a subdirectory of `save_dir`.
        version: run number; None picks the next free one.
    """

    METRICS_FILE = "metrics.csv"

    def __init__(
        self, save_dir: str | os.PathLike[str], name: str = "csv_logs", version: int | str | None = None
    ) -> None:
        super().__init__(save_dir, name, version)
        #: Header of the metrics file; None until the first row is written.
        self._columns: list[str] | None = None

    @property
    def metrics_file(self) -> str:
        """Path of ``metrics.csv``."""
        return os.path.join(self.log_dir, self.METRICS_FILE)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Append one row of `metrics` at `step`."""
        row: dict[str, Any] = {"step": step, **metrics}
        if self._columns is None:
            self._open(first_step=step)
        assert self._columns is not None
        new_keys = [key for key in row if key not in self._columns]
        if new_keys:
            self._columns.extend(new_keys)
            self._rewrite([*self._read_rows(), row])
            return
        with open(self.metrics_file, "a", newline="") as file:
            csv.DictWriter(file, self._columns, restval="", lineterminator="\n").writerow(row)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Save `params` to ``hparams.yaml``."""
        if params:
            self.save_hparams_file(params)

    def _open(self, first_step: int) -> None:
        """Start the metrics file: continue a resumed run's file, or begin an empty one."""
        os.makedirs(self.log_dir, exist_ok=True)
        self._started = True
        self._columns = []
        if not os.path.isfile(self.metrics_file):
            return
        if self.resuming:
            # Rows at or after the first resumed step were written after the checkpoint; this run redoes them.
            self._columns = self._read_header()
            self._rewrite([row for row in self._read_rows() if int(row["step"]) < first_step])
        else:
            rank_zero_warn(f"{self.metrics_file} exists and is replaced by this run's metrics.")
            os.remove(self.metrics_file)

    def _read_header(self) -> list[str]:
        with open(self.metrics_file, newline="") as file:
            return next(csv.reader(file), [])

    def _read_rows(self) -> list[dict[str, str]]:
        if not os.path.isfile(self.metrics_file):
            return []
        with open(self.metrics_file, newline="") as file:
            return list(csv.DictReader(file))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        # Write aside and rename, so a crash mid-rewrite leaves the old file rather than half a file.
        tmp = f"{self.metrics_file}.tmp"
        with open(tmp, "w", newline="") as file:
            writer = csv.DictWriter(file, self._columns or [], restval="", lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.metrics_file)
