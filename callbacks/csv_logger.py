"""`CSVLogger`: metrics as rows of a CSV file, hyperparameters as YAML."""

from __future__ import annotations

import csv
import os
from typing import Any

from syncline.callbacks.versioned_logger import VersionedLogger
from syncline.options import check_int
from syncline.rank_zero import rank_zero_only, rank_zero_warn

__all__ = ["CSVLogger"]


class CSVLogger(VersionedLogger):
    """Write ``metrics.csv`` and ``hparams.yaml`` to ``save_dir/name/version_N``, as Lightning's logger does.

    Each `log_metrics` call makes one row with a ``step`` column; rows are kept in memory and appended to
    the file every `flush_logs_every_n_steps` steps, at `save()` and when the stage ends, as in Lightning.
    When a row brings a key the header lacks, the file is rewritten with the wider header (rows without a
    value leave it empty). A run resumed from a checkpoint keeps the checkpoint's version and drops the
    rows the crashed run wrote at or after its own first logged step.

    Args:
        save_dir: root directory of all runs.
        name: experiment name, a subdirectory of `save_dir` (None or "": the versions go in `save_dir`).
        version: run number; None picks the next free one.
        prefix: put before every metric's name, joined by "-".
        flush_logs_every_n_steps: write the buffered rows every this many steps.
    """

    METRICS_FILE = "metrics.csv"

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        check_int("CSVLogger", "flush_logs_every_n_steps", flush_logs_every_n_steps, 1)
        super().__init__(save_dir, name, version)
        self._prefix = prefix
        self._flush_every = flush_logs_every_n_steps
        #: Header of the metrics file; None until the first row is written.
        self._columns: list[str] | None = None
        #: Rows logged and not yet written to the file.
        self.metrics: list[dict[str, Any]] = []

    @property
    def experiment(self) -> CSVLogger:
        """The object that writes the rows (this logger: `log_metrics`, `metrics`, `save`), as Lightning's
        ``logger.experiment``."""
        return self

    @property
    def metrics_file_path(self) -> str:
        """Path of ``metrics.csv`` (Lightning's name)."""
        return self.metrics_file

    @property
    def metrics_file(self) -> str:
        """Path of ``metrics.csv``."""
        return os.path.join(self.log_dir, self.METRICS_FILE)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Keep one row of `metrics` at `step` (None: the number of rows so far); write every
        `flush_logs_every_n_steps` steps."""
        if step is None:
            step = len(self.metrics)
        prefix = f"{self._prefix}-" if self._prefix else ""
        self.metrics.append({"step": step, **{f"{prefix}{name}": value for name, value in metrics.items()}})
        if (step + 1) % self._flush_every == 0:
            self.save()

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Any = None) -> None:
        """Save `params` (a dict or an `argparse.Namespace`) to ``hparams.yaml``."""
        params = vars(params) if hasattr(params, "__dict__") and not isinstance(params, dict) else params
        if params:
            self.save_hparams_file(dict(params))

    @rank_zero_only
    def save(self) -> None:
        """Append the buffered rows to ``metrics.csv``."""
        rows, self.metrics = self.metrics, []
        if not rows:
            return
        if self._columns is None:
            self._open(first_step=rows[0]["step"])
        assert self._columns is not None
        new_keys = [key for row in rows for key in row if key not in self._columns]
        if new_keys:
            self._columns.extend(dict.fromkeys(new_keys))
            self._rewrite([*self._read_rows(), *rows])
            return
        with open(self.metrics_file, "a", newline="") as file:
            csv.DictWriter(file, self._columns, restval="", lineterminator="\n").writerows(rows)

    def state_dict(self) -> dict[str, Any]:
        """Write the buffered rows first: a run resumed from this checkpoint finds every row up to it."""
        self.save()
        return super().state_dict()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Write the rows still buffered."""
        self.save()

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
