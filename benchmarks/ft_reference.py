"""torchft's fault-tolerant DDP as the reference row of `python -m benchmarks live-recovery`.

torchft (PyTorch's per-step fault tolerance library, `pip install 'syncline[ft]'`) keeps replicas training
through a death as syncline's ``recovery="live"`` does. This runs it on the live-recovery benchmark's workload on
127.0.0.1: each replica a process of its own (`syncline.lab.ft_ddp`, which the lab's torchft mode runs on its
nodes too), replica 1 SIGKILLing itself once at step ``kill_at``, one replacement started when this launcher sees
it die (as ``max_restarts=1`` does), and the lighthouse in this launching process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from syncline.lab.ft_ddp import HEARTBEAT_TIMEOUT_MS, lighthouse, train_replica
from syncline.lab.ft_diloco import missing

from . import MODULE
from .common import CHECKOUT_ENV

__all__ = ["fit", "missing"]


def fit(
    devices: int,
    batches: int,
    step_s: float,
    kill_at: int,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Train `batches` committed steps on `devices` torchft replicas; replica 1 dies at step `kill_at` (-1: never).

    Returns the wall seconds from the first replica's start to the last one's exit, the seconds from the first
    committed step to the last, the seconds the replacement took from its start to its first committed step, and
    whether every replica ended with the same weights.
    """
    # The survivors may go on without the dead replica; a new one joins at the next quorum.
    server = lighthouse("127.0.0.1:0", devices, heartbeat_timeout_ms)
    processes: dict[int, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="syncline-bench-ft-") as root:
        spec = {"lighthouse": server.address(), "batches": batches, "devices": devices, "step_s": step_s}
        spec.update(kill_at=kill_at, root=root)

        def start(replica: int, replacement: bool = False) -> subprocess.Popen:
            mine = json.dumps({**spec, "replica": replica, "replacement": replacement})
            argv = [sys.executable, "-m", f"{MODULE}.ft_reference", mine]
            with open(Path(root, f"replica{replica}.log"), "a") as log:  # the child keeps its own descriptor
                env = {**os.environ, **CHECKOUT_ENV}  # `benchmarks` is found from the checkout, not installed
                return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

        try:
            started = time.perf_counter()
            processes = {replica: start(replica) for replica in range(devices)}
            replaced_at = None
            while processes:
                for replica, process in list(processes.items()):
                    code = process.poll()
                    if code is None:
                        continue
                    del processes[replica]
                    if code == -signal.SIGKILL and replaced_at is None:  # the planned death: one replacement
                        replaced_at = time.time()
                        processes[replica] = start(replica, replacement=True)
                    elif code != 0:
                        tail = Path(root, f"replica{replica}.log").read_text()[-2000:]
                        raise RuntimeError(f"torchft replica {replica} exited with {code}:\n{tail}")
                if replaced_at and list(processes) == [1] and not Path(root, "joined").exists():
                    # The survivors trained every step before the replacement joined: it has nothing left to do.
                    late = processes.pop(1)
                    late.kill()
                    late.wait()
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"torchft fit still running after {timeout:.0f} s (logs in {root})")
                time.sleep(0.01)
            wall = time.perf_counter() - started
            records = [json.loads(p.read_text()) for p in sorted(Path(root).glob("replica*.json"))]
        finally:
            for process in processes.values():
                process.kill()
                process.wait()
            server.shutdown()
    replacement = [r["first_commit_at"] - replaced_at for r in records if r["replacement"]]  # none: never joined
    first = min(r["first_commit_at"] for r in records if not r["replacement"])
    return {
        "wall_s": wall,
        # From the first committed step to the last: the training alone, without the imports and exits around it.
        "train_s": max(r["last_commit_at"] for r in records) - first,
        "replacement_start_to_train_s": replacement[0] if replacement else None,
        "replicas_agree": all(r["weights"] == records[0]["weights"] for r in records),
    }


def _replica(spec: dict[str, Any]) -> None:
    """One replica group of one process on 127.0.0.1 (`syncline.lab.ft_ddp`); its record goes to a JSON file."""
    record = train_replica(spec, "127.0.0.1", spec["lighthouse"])
    record["replacement"] = spec["replacement"]
    Path(spec["root"], f"replica{spec['replica']}-{os.getpid()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    _replica(json.loads(sys.argv[1]))
