"""Live recovery on lab nodes: what one failure costs with `recovery="live"` against a restart from `last.ckpt`.

Each node of a lab cluster (`benchmarks.lab.cluster`: network namespaces on one bridge, links shaped to a rate)
trains a paced task (every step sleeps ``--step-s``, so the figures are about the recovery, not the model) on one
process. Cases:

- ``worker_killed``: node 1's worker SIGKILLs itself at step ``--kill-at`` (an out-of-memory kill, say). With
  ``recovery="live"`` (one launcher per node: ``python`` with MASTER_ADDR, MASTER_PORT and NODE_RANK) the others
  go on and node 1's agent starts a replacement, which joins live; with ``"checkpoint"`` (torchrun on every node,
  ``--max-restarts 1``, ``last.ckpt`` every ``--checkpoint-every`` steps) every worker restarts from it. Mode
  ``torchft``, the reference, runs the same workload on torchft's fault-tolerant DDP (`ft_ddp.py`, where torchft
  imports): one replica per node under a per-node agent that starts it once more after its death, the lighthouse
  in node 0's agent; a replacement not yet in a quorum when every other replica is done is ended (no figure).
- ``node_lost`` (live only): every process of the last node is SIGKILLed at step ``--kill-at``; the others go on at
  the smaller size; the node's launcher is then started again and joins live.
- ``node_cut`` (live only): the last node's link is cut at step ``--kill-at`` (its veth down: its processes live on
  and no connection closes, so no collective of the others fails); the others go on once its keep-alives stop.
- ``store_host_lost`` (live only): node 0, whose launcher hosts the run's store, is SIGKILLed likewise; every other
  node ends, naming the store (recorded: their exit codes, and the seconds until the last process is gone).

Seconds lost = the time from the death until the job finishes a step past the one in flight, less one step (what
that step would have taken anyway). A replacement's seconds run from its process's start to its first step. A
checkpoint restart also repeats the steps since the last save: on average half the interval, which guide.md puts at
10-30 minutes of training, so the table adds 300 s (half of 10 minutes) for "checkpoint at the guide's interval" to
the restart's own cost measured here (its repeated steps taken off).

    python -m syncline.lab live-recovery --nodes 2 4 --rates 1gbit 100mbit
    python -m syncline.lab live-recovery --nodes 3 --cases node_lost node_cut
    python -m syncline.lab live-recovery --out lab_live_recovery.json --plot live_recovery.png  # from the JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncline.trainer import Task

from . import ft_ddp, ft_diloco
from .cluster import (
    MASTER_PORT,
    TRAIN_OPTION,
    UNAVAILABLE,
    add_role_arguments,
    build_nodes,
    end_nodes,
    interrupt_on_signals,
    lab_rate,
    lab_unavailable,
    lab_worker,
    parse_rate,
    ran_inner_role,
    run_in_namespaces,
    start_nodes,
)
from .records import write_json

__all__ = ["LabProbe", "add_arguments", "command", "plot", "plotted", "run_cell"]

CASES = ("worker_killed", "node_lost", "node_cut", "store_host_lost")
MODES = ("live", "checkpoint", "torchft")
#: Half of guide.md's shortest recommended checkpoint interval (10 minutes): the steps a restart repeats on average.
GUIDE_HALF_INTERVAL_S = 300.0
#: The strategy's collective timeout by default (its own default is minutes): with gloo, how long a member that is
#: not next to the dead one in the ring waits in its collective (4 or more members; guide.md, "Live recovery").
COLLECTIVE_TIMEOUT_S = 30.0
#: Seconds a case may take in all before its processes are killed and it is reported as hung.
CASE_LIMIT_S = 400.0
#: Seconds a torchft replacement may go on once every other node's replica is done: one that joined them ends
#: with them; one that did not would form a quorum of its own and train alone.
FT_LATE_S = 2.0


class LabProbe(Task):
    """A small MLP whose every step sleeps `step_s` and appends ``time epoch step world`` to its process's log."""

    def __init__(self, spec: dict[str, Any], node: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.spec, self.node = spec, node

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.spec["samples"], 8, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)

    def setup(self, stage: str) -> None:
        self._write(f"start {_process_started():.3f} {self.node}")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        spec, step, world = self.spec, self.trainer.global_step, self.trainer.world_size
        marker = Path(spec["dir"], "killed")
        if spec["case"] == "worker_killed" and self.node == 1 and step == spec["kill_at"] and not marker.exists():
            marker.write_text(f"{time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)
        self._write(f"{time.time():.3f} {self.trainer.current_epoch} {step} {world}")
        if spec.get("wait_for_rejoin") and world < spec["nodes"] and step > spec["kill_at"]:
            # Short of a node: wait (bounded) until the node started again has a process training, then go slowly
            # until it is in, so that it joins before the epoch ends.
            deadline = time.monotonic() + 120
            while not self._rejoined() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
        time.sleep(spec["step_s"])
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def _rejoined(self) -> bool:
        restarted = Path(self.spec["dir"], "restarted")
        if not restarted.exists():
            return False
        since = float(restarted.read_text())
        logs = Path(self.spec["dir"], "steps").glob("*.log")
        return any(line.startswith("start ") and float(line.split()[1]) > since for p in logs for line in p.open())

    def _write(self, line: str) -> None:
        with open(Path(self.spec["dir"], "steps", f"{os.getpid()}.log"), "a") as file:
            file.write(line + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _process_started() -> float:
    """When this process started (seconds since the epoch, to the second of the boot time), from /proc."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line[:5] == "btime")
    return boot + ticks / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the job each node runs
def train(spec: dict[str, Any]) -> None:
    """One node's job: live (this process launches the node's replica) or under torchrun (this is the worker); for
    torchft, the node's agent or its replica."""
    if spec["mode"] == "torchft":
        (_ft_replica if "replacement" in spec else _ft_agent)(spec)
        return
    from syncline.callbacks import ModelCheckpoint
    from syncline.strategies import BucketedDDP
    from syncline.trainer import Trainer

    live = spec["mode"] == "live"
    node = int(os.environ["NODE_RANK" if live else "GROUP_RANK"])
    callbacks = []
    if not live:
        every = spec["checkpoint_every"]
        callbacks = [ModelCheckpoint(dirpath=spec["dir"], every_n_train_steps=every, save_last=True, save_top_k=0)]
    trainer = Trainer(
        max_epochs=1,
        devices=1,
        num_nodes=spec["nodes"] if live else 1,
        # Both modes alike: a rank that fails under torchrun can wait out this timeout on its way out.
        strategy=BucketedDDP(timeout=spec["timeout"]),
        accelerator="cpu",
        recovery=spec["mode"],
        max_restarts=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=not live,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        default_root_dir=spec["dir"],
    )
    trainer.fit(LabProbe(spec, node))


# ------------------------------------------------------------------ torchft's fault-tolerant DDP on a node
def _ft_agent(spec: dict[str, Any]) -> None:
    """A node's torchft agent: start the node's replica, once more if it is SIGKILLed (as ``max_restarts=1``);
    node 0's also hosts the lighthouse, until every node's agent is done."""
    node, nodes, work = int(os.environ["NODE_RANK"]), spec["nodes"], Path(spec["dir"])
    master = os.environ["MASTER_ADDR"]
    server = ft_ddp.lighthouse(f"[::]:{MASTER_PORT}", nodes) if node == 0 else None
    _wait_for_port(master, MASTER_PORT, CASE_LIMIT_S / 4)  # the lighthouse, like a rendezvous
    others = [work / f"done-node{n}" for n in range(nodes) if n != node]
    try:
        code = _run_ft_replica(spec, work, node, others, replacement=False)
        if code == -signal.SIGKILL:
            code = _run_ft_replica(spec, work, node, others, replacement=True)
    finally:
        (work / f"done-node{node}").touch()
    if server is not None:
        deadline = time.monotonic() + CASE_LIMIT_S / 4
        while not all(path.exists() for path in others) and time.monotonic() < deadline:
            time.sleep(0.1)
        server.shutdown()
    sys.exit(code)


def _run_ft_replica(spec: dict[str, Any], work: Path, node: int, others: list[Path], replacement: bool) -> int:
    """Run the node's replica to its end; return its exit status (0 for a replacement ended as too late)."""
    job = work / f"ft-node{node}-{'replacement' if replacement else 'first'}.json"
    job.write_text(json.dumps({**spec, "replacement": replacement}))
    replica = subprocess.Popen([sys.executable, *lab_worker("live-recovery"), TRAIN_OPTION, str(job)])
    others_done = None
    while replica.poll() is None:
        if replacement and all(path.exists() for path in others):
            others_done = others_done or time.monotonic()
            if time.monotonic() - others_done > FT_LATE_S:
                print("the replacement had not joined when every other replica was done: ended", flush=True)
                replica.kill()
                replica.wait()
                return 0
        time.sleep(0.1)
    return replica.returncode


def _ft_replica(spec: dict[str, Any]) -> None:
    """A node's torchft replica (`ft_ddp.train_replica`), logging its steps as `LabProbe` does."""
    node, master = int(os.environ["NODE_RANK"]), os.environ["MASTER_ADDR"]
    log = Path(spec["dir"], "steps", f"{os.getpid()}.log")

    def write(line: str) -> None:
        with open(log, "a") as file:
            file.write(line + "\n")

    write(f"start {_process_started():.3f} {node}")
    replica = {k: spec[k] for k in ("batches", "step_s", "kill_at", "replacement")}
    replica.update(replica=node, devices=spec["nodes"], root=spec["dir"])
    work, nodes = Path(spec["dir"]), spec["nodes"]

    def all_ready() -> None:
        # The first replicas start training together: a replica alone at the lighthouse would form a quorum of one.
        (work / f"ready-node{node}").touch()
        deadline = time.monotonic() + CASE_LIMIT_S / 4
        while not all((work / f"ready-node{n}").exists() for n in range(nodes)) and time.monotonic() < deadline:
            time.sleep(0.05)

    ft_ddp.train_replica(
        replica,
        ft_diloco.own_address(master),
        f"http://{master}:{MASTER_PORT}",
        on_step=lambda step, world: write(f"{time.time():.3f} 0 {step} {world}"),
        on_ready=None if spec["replacement"] else all_ready,
    )


def _wait_for_port(host: str, port: int, seconds: float) -> None:
    """Return once `host` accepts a connection on `port`; raise after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {seconds:.0f} s") from None
            time.sleep(0.2)


# ------------------------------------------------------------------ the lab (inside the namespaces)
def _inside(spec: dict[str, Any]) -> None:
    # SIGTERM or SIGHUP (from `run_in_namespaces`, on Ctrl-C or a timeout) end the nodes' processes before the lab goes.
    interrupt_on_signals()
    build_nodes(spec["nodes"], spec["rate"])
    records = []
    for case in spec["cases"]:
        for mode in spec["modes"] if case == "worker_killed" else ("live",):
            records.append(_one(case, mode, spec))
            print(json.dumps(records[-1]), flush=True)
    Path(spec["result"]).write_text(json.dumps(records, indent=2) + "\n")


def _one(case: str, mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one job on the nodes, let `case` happen at step ``kill_at``, and read what it cost off the step logs."""
    nodes = spec["nodes"]
    work = Path(tempfile.mkdtemp(prefix=f"syncline-live-{case}-{mode}-", dir=spec["dir"]))
    (work / "steps").mkdir()
    job = {
        **{k: spec[k] for k in ("nodes", "step_s", "kill_at", "checkpoint_every", "timeout", "batches")},
        "case": case,
        "mode": mode,
        "dir": str(work),
        "samples": nodes * spec["batches"] * 4,
        "wait_for_rejoin": case == "node_lost",
    }
    (work / "job.json").write_text(json.dumps(job))
    command = [*lab_worker("live-recovery"), TRAIN_OPTION, str(work / "job.json")]
    if mode == "checkpoint":
        command = ["--max-restarts", "1", *command]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SYNCLINE_GRACE_S": "5"}
    started = time.monotonic()
    processes, _ = start_nodes(nodes, 1, command, work, env, torchrun=mode == "checkpoint")
    record: dict[str, Any] = {"case": case, "mode": mode, "nodes": nodes, "rate": spec["rate"]}
    try:
        if case == "node_lost":
            record.update(_lose_and_restart_node(nodes - 1, processes, work, command, env, job))
        if case == "store_host_lost":
            _kill_at_step(0, processes, work, job)
        if case == "node_cut":
            _at_step(work, job)
            subprocess.run(["ip", "link", "set", f"veth{nodes - 1}", "down"], check=True)
        deadline = started + CASE_LIMIT_S
        # A node cut off is not waited for: its processes end only when their store calls time out.
        waited = processes[:-1] if case == "node_cut" else processes
        while any(p.poll() is None for p in waited) and time.monotonic() < deadline:
            time.sleep(0.1)
        record["hung"] = any(p.poll() is None for p in waited)
        if case == "store_host_lost":
            record["ended_s"] = round(time.time() - float((work / "killed").read_text()), 2)
    finally:
        end_nodes(range(nodes), grace=1.0)
        for process in processes:
            process.wait()
        if case == "node_cut":
            subprocess.run(["ip", "link", "set", f"veth{nodes - 1}", "up"], check=False)  # for the next case
    record["wall_s"] = round(time.monotonic() - started, 2)
    record["codes"] = [p.returncode for p in processes]
    record.update(_read_steps(work, job))
    record["log_tail"] = {f"node{n}": (work / f"node{n}.log").read_text()[-1500:] for n in range(nodes)}
    shutil.rmtree(work, ignore_errors=True)
    return record


def _lose_and_restart_node(
    node: int, processes: list[subprocess.Popen], work: Path, command: list[str], env: dict[str, str], job: dict
) -> dict[str, Any]:
    """SIGKILL every process of `node` once a step past ``kill_at`` is logged; start its launcher again once the
    others have trained a step without it."""
    deadline = time.monotonic() + CASE_LIMIT_S / 2
    killed = _kill_at_step(node, processes, work, job)
    while _latest(work)[1] >= job["nodes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    restarted, _ = start_nodes(job["nodes"], 1, command, work, env, torchrun=False, only=[node])
    (work / "restarted").write_text(f"{time.time():.3f}")
    processes[node] = restarted[0]
    return {"node_killed_at": killed}


def _kill_at_step(node: int, processes: list[subprocess.Popen], work: Path, job: dict[str, Any]) -> float:
    """SIGKILL every process of `node` once a step at or past ``kill_at`` is logged; return when."""
    killed = _at_step(work, job)
    _kill_node(node)
    processes[node].wait()
    return killed


def _at_step(work: Path, job: dict[str, Any]) -> float:
    """Wait until a step at or past ``kill_at`` is logged; mark the moment as the failure's and return it."""
    deadline = time.monotonic() + CASE_LIMIT_S / 2
    while _latest(work)[0] < job["kill_at"] and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = time.time()
    (work / "killed").write_text(f"{killed:.3f}")
    return killed


def _kill_node(node: int) -> None:
    """SIGKILL every process of `node` (its launcher, agent and worker), until none is left; a SIGTERM would be
    a preemption."""
    while True:
        out = subprocess.run(["ip", "netns", "pids", f"node{node}"], capture_output=True, text=True)
        pids = [int(pid) for pid in out.stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _latest(work: Path) -> tuple[int, int]:
    """The highest step logged so far, and the world size of the latest line logged."""
    lines = [line.split() for path in (work / "steps").glob("*.log") for line in path.read_text().splitlines()]
    steps = [(float(t), int(step), int(world)) for t, _, step, world in (x for x in lines if x[0] != "start")]
    if not steps:
        return -1, 0
    latest = max(steps)
    return max(s for _, s, _ in steps), latest[2]


def _read_steps(work: Path, job: dict[str, Any]) -> dict[str, Any]:
    """Seconds lost, and how soon a replacement (a process that started after the death) trained."""
    marker = work / "killed"
    if not marker.exists():
        return {"error": "no failure happened"}
    death = float(marker.read_text())
    starts, steps = {}, []
    for path in (work / "steps").glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts[0] == "start":
                starts.setdefault(path.stem, float(parts[1]))
            else:
                steps.append((float(parts[0]), int(parts[2]), int(parts[3]), path.stem))
    after = sorted((t, step) for t, step, _, _ in steps if t > death and step > job["kill_at"])
    lost = after[0][0] - death - job["step_s"] if after else None
    # A replacement: a process that trained only after the death (its start, to the second of the boot time, may
    # read as just before it).
    first = {pid: min((t for t, _, _, p in steps if p == pid), default=None) for pid in starts}
    joined = [round(t - starts[pid], 2) for pid, t in first.items() if t is not None and t > death]
    result: dict[str, Any] = {
        "seconds_lost": round(lost, 2) if lost is not None else None,
        "replacement_first_step_s": joined,
        # The world size of each change, in order (3, 2, 3: a node lost, then back).
        "worlds": [w for i, (_, _, w, _) in enumerate(sorted(steps)) if i == 0 or w != sorted(steps)[i - 1][2]],
    }
    if job["mode"] == "checkpoint" and lost is not None:
        repeated = (job["kill_at"] % job["checkpoint_every"]) * job["step_s"]
        result["restart_s"] = round(lost - repeated, 2)
        result["seconds_lost_at_guide_interval"] = round(lost - repeated + GUIDE_HALF_INTERVAL_S, 1)
    return result


# ------------------------------------------------------------------ command line
def run_cell(
    nodes: int,
    rate: str | None,
    cases: Sequence[str],
    step_s: float = 0.1,
    batches: int = 40,
    kill_at: int = 15,
    checkpoint_every: int = 10,
    modes: Sequence[str] = MODES,
    timeout: float = COLLECTIVE_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Run `cases` on a fresh lab of `nodes` nodes at `rate`; return the records (with each node's log's tail)."""
    work = Path(tempfile.mkdtemp(prefix="syncline-lab-live-"))
    spec = {
        "nodes": nodes,
        "rate": rate,
        "cases": list(cases),
        "modes": list(modes),
        "timeout": timeout,
        "step_s": step_s,
        "batches": batches,
        "kill_at": kill_at,
        "checkpoint_every": checkpoint_every,
        "dir": str(work),
        "result": str(work / "result.json"),
    }
    try:
        run_in_namespaces("live-recovery", spec, timeout=len(cases) * len(modes) * CASE_LIMIT_S + 120)
        return json.loads(Path(spec["result"]).read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", type=lab_rate, nargs="+", default=["1gbit", "100mbit"], help="or none: unshaped")
    parser.add_argument("--cases", nargs="+", default=["worker_killed"], choices=CASES)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="for worker_killed")
    parser.add_argument("--batches", type=int, default=40, help="batches per node in the epoch")
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=COLLECTIVE_TIMEOUT_S, help="the strategy's collective timeout")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, help="only draw the figure from --out's JSON into this PNG")
    add_role_arguments(parser)


def command(args: argparse.Namespace) -> int | None:
    """``python -m syncline.lab live-recovery [--nodes 2 4] [--rates 1gbit 100mbit] [--cases ...]``."""
    if ran_inner_role(args, _inside, train):
        return 0
    if args.plot is not None:
        if args.out is None:
            sys.exit("--plot draws from the records of a JSON file: name it with --out.")
        plot(json.loads(args.out.read_text()), args.plot)
        print(f"wrote {args.plot}")
        return 0
    if lab_unavailable("lab live-recovery"):
        return UNAVAILABLE
    skipped = ft_diloco.missing("lab live-recovery's torchft mode") if "torchft" in args.modes else None
    if skipped:
        print(skipped)
        args.modes = [mode for mode in args.modes if mode != "torchft"]
        if not args.modes and args.cases == ["worker_killed"]:
            return 0
    records, load = [], os.getloadavg()[0]
    print(f"{'nodes':>5} {'link':>8} {'case':>14} {'mode':>11} {'s lost':>7} {'restart s':>9} "
          f"{'+ guide interval':>16} {'replacement s':>13} {'codes':>12}")  # fmt: skip
    for nodes in args.nodes:
        for rate in args.rates:
            cell = run_cell(
                nodes, rate, args.cases, args.step_s, args.batches, args.kill_at, args.checkpoint_every, args.modes,
                args.timeout,
            )  # fmt: skip
            for record in cell:
                records.append({k: v for k, v in record.items() if k != "log_tail"})
                print(_row(record), flush=True)
    if args.out is not None:
        # Other work on the machine slows start-up and recovery: the 1-minute load average at the start and the end.
        write_json(args.out, {"load_average_1m": [round(load, 2), round(os.getloadavg()[0], 2)], "records": records})
    return 0 if all(not r.get("hung") and r.get("seconds_lost") is not None for r in records) else 1


def _row(r: dict[str, Any]) -> str:
    def num(key: str) -> str:
        return f"{r[key]:.1f}" if isinstance(r.get(key), (int, float)) else "-"

    joined = ",".join(f"{s:.1f}" for s in r.get("replacement_first_step_s", [])) or "-"
    return (
        f"{r['nodes']:>5} {r['rate'] or 'none':>8} {r['case']:>14} {r['mode']:>11} {num('seconds_lost'):>7} "
        f"{num('restart_s'):>9} {num('seconds_lost_at_guide_interval'):>16} {joined:>13} {str(r['codes']):>12}"
    )


#: The figure's bars: (label, mode, the record's key), in the order drawn.
PLOTTED = (
    ("live", "live", "seconds_lost"),
    ("checkpoint: restart", "checkpoint", "restart_s"),
    ("checkpoint at the guide's interval", "checkpoint", "seconds_lost_at_guide_interval"),
    ("torchft", "torchft", "seconds_lost"),
)
_COLORS = {"live": "#4C72B0", "checkpoint: restart": "#DD8452", "checkpoint at the guide's interval": "#C44E52",
           "torchft": "#55A868"}  # fmt: skip


def plotted(records: Sequence[dict[str, Any]]) -> tuple[list[tuple[int, str]], dict[str, list[float | None]]]:
    """The figure's cells (nodes, link rate or ``none``; by nodes, then fastest link first) and, per bar that has
    any value, the median over a cell's worker_killed records (None where the cell has none)."""
    killed = [r for r in records if r["case"] == "worker_killed"]

    def cell_of(record: dict[str, Any]) -> tuple[int, str]:
        return record["nodes"], record["rate"] or "none"

    def order(cell: tuple[int, str]) -> tuple[int, float]:
        return cell[0], -(math.inf if cell[1] == "none" else parse_rate(cell[1]))

    cells = sorted({cell_of(r) for r in killed}, key=order)
    series = {}
    for label, mode, key in PLOTTED:
        values = [
            [r[key] for r in killed if cell_of(r) == cell and r["mode"] == mode and r.get(key) is not None]
            for cell in cells
        ]
        if any(values):
            series[label] = [statistics.median(v) if v else None for v in values]
    return cells, series


def plot(data: dict[str, Any], out: Path) -> None:
    """Seconds lost per failure per mode (worker_killed), a group of bars per cell (nodes, link), on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, series = plotted(data["records"])
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(cells)), 4.4))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        drawn = [(j + (i - (len(series) - 1) / 2) * width, v) for j, v in enumerate(values) if v is not None]
        # A log scale has no zero: a loss under 0.1 s (or a gain) is drawn at 0.1 s, its value written above.
        heights = [max(value, 0.1) for _, value in drawn]
        ax.bar([x for x, _ in drawn], heights, width, color=_COLORS[label], label=label)
        for (x, value), height in zip(drawn, heights):
            ax.annotate(f"{value:.1f}", (x, height), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7)  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylim(0.1, 5 * max((v for vs in series.values() for v in vs if v is not None), default=1.0))
    ax.set_ylabel("seconds lost per failure")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{nodes} nodes\n{_link(rate)}" for nodes, rate in cells])
    ax.set_title("One worker SIGKILLed on lab nodes: seconds lost per failure")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _link(rate: str) -> str:
    """A link rate as the docs write it: ``100mbit``: 100 Mbit/s."""
    if rate == "none":
        return "unshaped"
    bits = parse_rate(rate)
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"
