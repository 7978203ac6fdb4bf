"""What the lab's jobs share with the benchmark scripts: the Trainer settings of a measured run and result files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["QUIET_TRAINER", "fill_marked_block", "write_json"]

#: The Trainer arguments of a measured run: the CPU (these studies are of gloo on CPU cores, also on a machine with
#: a GPU), no logs, checkpoints or progress output, no sanity validation.
QUIET_TRAINER: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "num_sanity_val_steps": 0,
}


def write_json(path: Path, data: Any) -> None:
    """Write `data` as indented JSON to `path` (creating its folder) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {path}")


def fill_marked_block(page: str, marker: str, text: str) -> str:
    """Return `page` with what lies between ``<!-- marker -->`` and ``<!-- /marker -->`` replaced by `text`.

    Raises:
        ValueError: the page has no such block.
    """
    block = re.compile(rf"(<!-- {re.escape(marker)} -->\n)(?:.*?\n)?(<!-- /{re.escape(marker)} -->)", re.DOTALL)
    if not block.search(page):
        raise ValueError(f"the page has no <!-- {marker} --> ... <!-- /{marker} --> block")
    return block.sub(lambda m: f"{m.group(1)}\n{text}\n\n{m.group(2)}", page)
