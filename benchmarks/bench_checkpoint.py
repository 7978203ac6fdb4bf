"""Cost of verified checkpoints: `save_checkpoint`/`load_checkpoint` against the same atomic save without a hash.

    python -m benchmarks checkpoint            # a ~100 MB checkpoint, 5 repeats

Both variants write to a temporary file, fsync it, rename it over the target and fsync the directory;
the verified one also streams the payload through SHA-256 and appends the 64-byte trailer, and its load
hashes the payload before `torch.load(weights_only=True)`. The plain load is that `torch.load` alone.
Variants alternate within each repeat (the page cache is warm for both). Reported: medians (min-max)
in milliseconds and the verified/plain ratio of medians, on stdout; the JSON goes where `--out` says
(the committed figures: `--out benchmarks/results/checkpoint.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from syncline.checkpoint_file import fsync_directory, load_checkpoint, save_checkpoint

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"


def _plain_save(checkpoint: dict[str, Any], path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as file:
        torch.save(checkpoint, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def _plain_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help=f"also write the JSON here (committed: {RESULTS})")


def command(options: argparse.Namespace) -> None:
    """Run the command."""
    torch.manual_seed(0)
    # A model-like checkpoint: a few large tensors and many small ones.
    floats = options.megabytes * 2**20 // 4
    weights = {f"layer{i}.weight": torch.randn(floats // 8) for i in range(8)}
    weights.update({f"layer{i}.bias": torch.randn(256) for i in range(200)})
    checkpoint = {"syncline_format": 2, "state_dict": weights}
    times: dict[str, list[float]] = {"save_verified": [], "save_plain": [], "load_verified": [], "load_plain": []}
    with tempfile.TemporaryDirectory() as directory:
        verified, plain = Path(directory, "verified.ckpt"), Path(directory, "plain.ckpt")
        for _ in range(options.repeats):
            times["save_verified"].append(_timed(save_checkpoint, checkpoint, verified))
            times["save_plain"].append(_timed(_plain_save, checkpoint, plain))
            times["load_verified"].append(_timed(load_checkpoint, verified))
            times["load_plain"].append(_timed(_plain_load, plain))
        size = verified.stat().st_size
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    result = {
        "file_bytes": size,
        "repeats": options.repeats,
        "median_ms": medians,
        "min_max_ms": {name: [min(v) * 1e3, max(v) * 1e3] for name, v in times.items()},
        "ratio_save": medians["save_verified"] / medians["save_plain"],
        "ratio_load": medians["load_verified"] / medians["load_plain"],
    }
    print(f"checkpoint of {size / 1e6:.1f} MB, {options.repeats} repeats, medians (min-max) in ms")
    for name, value in medians.items():
        low, high = result["min_max_ms"][name]
        print(f"  {name:14s} {value:8.1f}  ({low:.1f}-{high:.1f})")
    print(f"  verified/plain: save {result['ratio_save']:.2f}x, load {result['ratio_load']:.2f}x")
    if options.out is not None:  # the committed file only when asked for
        options.out.write_text(json.dumps(result, indent=2) + "\n")
