"""Faults on a two-node lab cluster: how long until the last process of the job is gone.

For each strategy, three faults while a small model trains under torchrun on two lab nodes (network
namespaces joined by a bridge, `syncline.lab.cluster`), with the strategy's collective timeout set to
``--timeout`` seconds:

- ``caller_killed``: SIGKILL of node 1's torchrun agent, the process that started node 1's worker;
- ``partition``: node 1's link goes down for good (its veth on the bridge is set down);
- ``stuck``: rank 0 raises while rank 1 sits in a 10,000 s computation.

It records the seconds from the fault until every process of the job (both agents, both workers) is
gone, each node's exit status, whether ``last.ckpt`` was written, and what still listens on each
node afterwards (nothing should). Everything lives in a private namespace (``unshare -mn``) and is
gone with it.

    python -m syncline.lab faults --strategies bucketed_ddp async_model_average parameter_server \
        tensor_fusion --out benchmarks/results/lab_faults.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cluster import (
    TRAIN_OPTION,
    UNAVAILABLE,
    add_role_arguments,
    build_nodes,
    lab_unavailable,
    lab_worker,
    namespaces_unavailable,
    ran_inner_role,
    run_in_namespaces,
    start_nodes,
)
from .records import write_json

FAULTS = ("caller_killed", "partition", "stuck")
STRATEGIES = ("bucketed_ddp", "async_model_average", "parameter_server", "tensor_fusion")
#: The optimizer step at which a fault is injected (or, for ``stuck``, happens).
FAULT_STEP = 20
#: Seconds after the fault before a job still running is killed and reported as hung.
HUNG_AFTER_S = 240.0


# ------------------------------------------------------------------ the job each node runs
def train(spec: dict[str, Any]) -> None:
    """Train a small regressor under torchrun, writing this rank's pid; misbehave as `spec` says."""
    import torch

    from syncline.callbacks import ModelCheckpoint
    from syncline.strategies.registry import STRATEGIES as REGISTRY
    from syncline.trainer import Task, Trainer

    rank = int(os.environ["RANK"])
    Path(spec["dir"], "pids", f"worker{rank}.pid").write_text(str(os.getpid()))

    class Regressor(Task):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            step = self.trainer.global_step
            if step == FAULT_STEP:
                Path(spec["dir"], f"at_fault{rank}").write_text(str(time.time()))
                if spec["fault"] == "stuck" and rank == 1:
                    time.sleep(10_000)  # computing, outside any collective
                if spec["fault"] == "stuck" and rank == 0:
                    raise ValueError("boom on rank 0")
            time.sleep(0.05)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    strategy = REGISTRY[spec["strategy"]](timeout=spec["timeout"])
    trainer = Trainer(
        max_steps=100_000,
        max_epochs=1000,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=spec["dir"],
        callbacks=[ModelCheckpoint(dirpath=spec["dir"], save_last=True, save_top_k=0)],
    )
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))


# ------------------------------------------------------------------ the lab (inside the namespaces)
def _inside(spec: dict[str, Any]) -> None:
    build_nodes(2, None)
    results = []
    for strategy in spec["strategies"]:
        for fault in spec["faults"]:
            results.append(_one(strategy, fault, spec))
            print(json.dumps(results[-1]), flush=True)
    Path(spec["result"]).write_text(json.dumps(results, indent=2) + "\n")


def _one(strategy: str, fault: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one job on the two nodes, inject `fault` at step FAULT_STEP, and time the end of every process."""
    work = Path(tempfile.mkdtemp(prefix=f"syncline-fault-{strategy}-{fault}-", dir=spec["dir"]))
    (work / "pids").mkdir()
    job = {"strategy": strategy, "fault": fault, "timeout": spec["timeout"], "dir": str(work)}
    (work / "job.json").write_text(json.dumps(job))
    command = [*lab_worker("faults"), TRAIN_OPTION, str(work / "job.json")]
    agents, _ = start_nodes(2, 1, command, work, {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    record: dict[str, Any] = {"strategy": strategy, "fault": fault, "timeout_s": spec["timeout"]}
    try:
        record.update(_inject_and_time(fault, agents, work))
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_group(agent.pid)
        for pid in _worker_pids(work).values():
            _kill(pid)
    record["listening_after"] = {f"node{node}": _listening(node) for node in range(2)}
    record["last_ckpt"] = (work / "last.ckpt").is_file()
    logs = {f"node{n}": (work / f"node{n}.log").read_text() for n in range(2)}
    # What each node's worker raised last (the rank's own error, before torchrun's summary).
    record["raised"] = {node: _last_error(text) for node, text in logs.items()}
    record["log_tail"] = {node: text[-1500:] for node, text in logs.items()}
    _sh_quiet("ip", "link", "set", "veth1", "up")
    return record


def _inject_and_time(fault: str, agents: list[subprocess.Popen], work: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 180
    # Every fault is timed from the moment a rank reaches step FAULT_STEP (for `stuck`, the fault itself).
    while not any((work / f"at_fault{rank}").exists() for rank in range(2)):
        if time.monotonic() > deadline or any(agent.poll() is not None for agent in agents):
            return {"error": "the job did not reach the fault step", "codes": [a.poll() for a in agents]}
        time.sleep(0.02)
    workers = _worker_pids(work)
    fault_at = time.monotonic()
    if fault == "caller_killed":
        os.kill(agents[1].pid, signal.SIGKILL)  # torchrun runs in the `ip netns exec` process itself
    elif fault == "partition":
        _sh_quiet("ip", "link", "set", "veth1", "down")
    ended: dict[str, float] = {}
    while time.monotonic() - fault_at < HUNG_AFTER_S:
        for node, agent in enumerate(agents):
            if f"agent{node}" not in ended and agent.poll() is not None:
                ended[f"agent{node}"] = time.monotonic() - fault_at
        for rank, pid in workers.items():
            if f"worker{rank}" not in ended and not _alive(pid):
                ended[f"worker{rank}"] = time.monotonic() - fault_at
        if len(ended) == len(agents) + len(workers):
            break
        time.sleep(0.05)
    return {
        "ended_s": {name: round(seconds, 2) for name, seconds in sorted(ended.items())},
        "last_gone_s": round(max(ended.values()), 2) if len(ended) == len(agents) + len(workers) else None,
        "hung": len(ended) < len(agents) + len(workers),
        "codes": [agent.poll() for agent in agents],
    }


def _last_error(log: str) -> str:
    """Return the last ``[rankN]: SomeError: ...`` line of a torchrun log (its worker's exception), or ''."""
    lines = [line for line in log.splitlines() if line.startswith("[rank") and "Error: " in line]
    return lines[-1][:300] if lines else ""


def _worker_pids(work: Path) -> dict[int, int]:
    pids = {}
    for file in (work / "pids").glob("worker*.pid"):
        pids[int(file.stem[len("worker") :])] = int(file.read_text())
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _listening(node: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", f"node{node}", "ss", "-ltnH"], capture_output=True, text=True)
    return [line.split()[3] for line in out.stdout.splitlines() if line.strip()]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _sh_quiet(*args: str) -> None:
    subprocess.run(list(args), capture_output=True, check=False)


# ------------------------------------------------------------------ command line
def run(strategies: Sequence[str], faults: Sequence[str], timeout: float, out: Path | None) -> list[dict[str, Any]]:
    """Run every (strategy, fault) on a fresh two-node lab; return the records (and write them to `out`)."""
    reason = namespaces_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    work = Path(tempfile.mkdtemp(prefix="syncline-lab-faults-"))
    spec = {
        "strategies": list(strategies),
        "faults": list(faults),
        "timeout": timeout,
        "dir": str(work),
        "result": str(work / "result.json"),
    }
    try:
        # Each (strategy, fault) job ends within HUNG_AFTER_S of its fault, or is killed and reported as hung.
        run_in_namespaces("faults", spec, timeout=len(strategies) * len(faults) * (HUNG_AFTER_S + 300))
        records = json.loads(Path(spec["result"]).read_text())
    finally:
        # The records keep the logs' tails; the runs' folders (checkpoints, logs) go.
        shutil.rmtree(work, ignore_errors=True)
    if out is not None:
        # The logs' tails stay in the returned records (tests show them); the file keeps the figures.
        kept = [{k: v for k, v in record.items() if k != "log_tail"} for record in records]
        write_json(out, {"fault_step": FAULT_STEP, "records": kept})
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--timeout", type=float, default=30.0, help="the strategies' collective timeout (s)")
    parser.add_argument("--out", type=Path, default=None)
    add_role_arguments(parser)


def command(args: argparse.Namespace) -> int | None:
    """``python -m syncline.lab faults [--strategies ...] [--faults ...] [--timeout S] [--out FILE]``."""
    if ran_inner_role(args, _inside, train):
        return 0
    if lab_unavailable("lab faults"):
        return UNAVAILABLE
    for record in run(args.strategies, args.faults, args.timeout, args.out):
        ended = record.get("last_gone_s")
        print(
            f"{record['strategy']:22} {record['fault']:14} last process gone after "
            f"{'HUNG' if ended is None else f'{ended:.1f} s'}; codes {record.get('codes')}; "
            f"last.ckpt {record['last_ckpt']}; listening after: {record['listening_after']}"
        )
    return 0
