"""A network lab: a cluster of nodes on one machine, each behind a link of a known rate, running torchrun.

On two cores over an unshaped loopback, communication competes with compute and almost never waits on a
wire. Here every node is a network namespace joined to a bridge by a veth pair; both directions of each
pair are shaped with a token bucket (``tc qdisc ... tbf rate <rate>``), so each node has its own
full-duplex link of `rate`, and a step's communication has a lower bound: the busiest node's bytes over the
rate. One torchrun node runs in each namespace (``--nnodes N --node-rank i``, rendezvous at node 0's
address, gloo on the node's own interface), as a real multi-node job would.

    python -m syncline.lab cluster --nodes 4 --rate 100mbit -- -m syncline trainer.max_steps=50

What follows ``--`` is what torchrun runs: a script and its arguments, or ``-m module ...``. Everything the
lab creates lives in a private mount and network namespace (``unshare -mn``, with a private tmpfs on /run
for ``ip netns``), so nothing is left on the host, even after Ctrl-C or a crash; addresses are private
(10.77.0.0/24) and exist only inside it. Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import MODULE

__all__ = [
    "UNAVAILABLE",
    "LabResult",
    "NodeResult",
    "StepReport",
    "add_inside_argument",
    "add_worker_argument",
    "bounded",
    "build_nodes",
    "end_nodes",
    "interrupt_on_signals",
    "lab_rate",
    "lab_unavailable",
    "lab_worker",
    "link_bound",
    "namespaces_unavailable",
    "parse_rate",
    "STALL_S",
    "StallGuard",
    "run_in_namespaces",
    "run_isolating",
    "run_job",
    "run_lab",
    "run_worker_if_asked",
    "run_worker_job",
    "start_nodes",
    "step_report",
    "step_starts",
    "torchrun_command",
    "with_run_dir",
]


SUBNET = "10.77.0"
MASTER_PORT = 29500
#: tbf's bucket and queue: a 256 kB burst and up to 500 ms of queue.
BURST = "256kb"
LATENCY = "500ms"
_INSIDE = "--inside-lab"
#: Steps a `-m syncline` job of `lab cluster` trains when its command sets no bound (the Trainer's own is 1,000
#: epochs): enough for a median step time past the first steps' warm-up.
DEFAULT_MAX_STEPS = 50
#: Seconds the lab's processes get to end after SIGTERM (a syncline job saves its checkpoint), before SIGKILL.
END_GRACE_S = 4.0
#: The option `run_worker_job` starts a command's worker with on every node: ``<worker command> --worker SPEC``.
_WORKER = "--worker"


@dataclass
class NodeResult:
    """One node of a lab run: how its torchrun ended and what its link carried."""

    node: int
    returncode: int
    bytes_sent: int
    bytes_received: int
    log: str


@dataclass
class LabResult:
    """A lab run: its shape, its nodes and how long the job took."""

    nodes: int
    rate: str | None
    rate_bits_per_second: float | None
    wall_seconds: float
    node_results: list[NodeResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every node's torchrun exited with 0."""
        return all(node.returncode == 0 for node in self.node_results)


def parse_rate(rate: str) -> float:
    """Return `rate` (tc's spelling: ``100mbit``, ``1gbit``, ``500kbit``, ``10bit``) in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not of the form <number>[k|m|g]bit, e.g. 100mbit or 1gbit.")
    value, prefix = float(match.group(1)), match.group(2)
    return value * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[prefix]


def lab_rate(text: str) -> str | None:
    """An argparse type for a link rate of the lab scripts: tc's spelling, or ``none`` (None) for unshaped links."""
    return None if text == "none" else text


def link_bound(local_step_seconds: float, bytes_sent_per_step: Sequence[float], rate_bits_per_second: float) -> float:
    """The least a step can take: its compute alone, or the busiest node's bytes through its link.

    ``max(local step time, max over nodes of bytes sent per step * 8 / rate)``. A strategy that overlaps
    all communication with compute reaches it; one that overlaps none takes about their sum.
    """
    if rate_bits_per_second <= 0:
        raise ValueError(f"rate must be positive, got {rate_bits_per_second}")
    wire = max(bytes_sent_per_step, default=0.0) * 8.0 / rate_bits_per_second
    return max(local_step_seconds, wire)


def namespaces_unavailable() -> str | None:
    """Return why the lab cannot run here (one line), or None when it can."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs {tool!r} (util-linux / iproute2), which is not installed"
    probe = subprocess.run(
        [
            "unshare",
            "-mn",
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /run && ip netns add probe && ip link add br0 type bridge",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
        return f"the network lab needs private network namespaces (root or CAP_NET_ADMIN): {reason}"
    return None


def run_lab(
    command: Sequence[str],
    nodes: int = 2,
    rate: str | None = None,
    procs_per_node: int = 1,
    timeout: float = 600.0,
    log_dir: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    slow_start_after_idle: bool = True,
) -> LabResult:
    """Build the cluster in a private namespace, run `command` under torchrun on every node, tear it down.

    Args:
        command: what torchrun runs on each node (a script and its arguments, or ``-m module ...``).
        nodes: number of nodes (network namespaces).
        rate: each node's link rate in both directions (``100mbit``), or None for unshaped links.
        procs_per_node: processes torchrun starts on each node.
        timeout: seconds the job may take; then every node is stopped and reported as failed.
        log_dir: where each node's output goes (``node<i>.log``); a temporary folder by default.
        env: extra environment variables for every node.
        slow_start_after_idle: Linux's default, TCP's congestion window restarting from slow start after a
            connection idles for a retransmission timeout; False sets the nodes'
            ``net.ipv4.tcp_slow_start_after_idle=0``, as training clusters often do, so that a gradient
            burst after a forward pass starts at the window the last one reached.

    Raises:
        RuntimeError: the lab cannot be built here (the message says why).
    """
    if nodes < 1 or procs_per_node < 1:
        raise ValueError(f"nodes and procs_per_node must be >= 1, got {nodes} and {procs_per_node}.")
    if rate is not None:
        parse_rate(rate)
    reason = namespaces_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    log_dir = Path(log_dir) if log_dir is not None else Path(_temporary_dir())
    log_dir.mkdir(parents=True, exist_ok=True)
    result_file = log_dir / "lab_result.json"
    spec = {
        "command": list(command),
        "nodes": nodes,
        "rate": rate,
        "procs_per_node": procs_per_node,
        "timeout": timeout,
        "log_dir": str(log_dir),
        "env": env or {},
        "slow_start_after_idle": slow_start_after_idle,
        "result": str(result_file),
    }
    code = run_in_namespaces("cluster", spec, timeout + 60)
    if not result_file.is_file():
        raise RuntimeError(f"the lab exited with {code} without a result; see {log_dir}")
    data = json.loads(result_file.read_text())
    data["node_results"] = [NodeResult(**node) for node in data["node_results"]]
    return LabResult(**data)


def run_in_namespaces(command: str, spec: dict[str, Any], timeout: float) -> int:
    """Run ``python -m syncline.lab <command> --inside-lab SPEC`` in a private mount and network namespace; wait.

    The one way a lab command starts its lab: the child owns the namespaces, so when it exits, for whatever reason,
    the kernel frees every namespace, veth and bridge it made, and its tmpfs on /run with them. Ctrl-C, SIGTERM or
    SIGHUP here, or `timeout` seconds passing, tell it to end its nodes' processes (`_stop_lab`). The command's
    ``--inside-lab`` handler does the work and writes its result where `spec` says. Returns the child's exit status.
    """
    lab = subprocess.Popen(
        ["unshare", "-mn", sys.executable, "-m", MODULE, command, _INSIDE, json.dumps(spec)], start_new_session=True
    )
    try:
        with _signals_interrupt():
            return lab.wait(timeout=timeout)
    except BaseException:
        _stop_lab(lab)
        raise


def add_inside_argument(parser: argparse.ArgumentParser) -> None:
    """Give a lab command the hidden ``--inside-lab SPEC`` that `run_in_namespaces` starts it with."""
    parser.add_argument(_INSIDE, metavar="SPEC", help=argparse.SUPPRESS)


#: The hidden option a fault experiment's nodes start their training job with (``--train JOB``).
TRAIN_OPTION = "--train"


def add_role_arguments(parser: argparse.ArgumentParser) -> None:
    """Give a fault experiment's command the hidden options of its two inner roles: ``--inside-lab SPEC`` (the
    lab's side, in the namespaces) and ``--train JOB`` (a node's training job)."""
    add_inside_argument(parser)
    parser.add_argument(TRAIN_OPTION, metavar="JOB", help=argparse.SUPPRESS)


def ran_inner_role(
    args: argparse.Namespace, inside: Callable[[dict[str, Any]], None], train: Callable[[dict[str, Any]], None]
) -> bool:
    """Run the role `add_role_arguments`' options ask for, if any, and return whether one ran."""
    if args.inside_lab is not None:
        inside(json.loads(args.inside_lab))
        return True
    if args.train is not None:
        train(json.loads(Path(args.train).read_text()))
        return True
    return False


def run_worker_job(
    worker: Sequence[str],
    spec: dict[str, Any],
    nodes: int,
    rate: str | None,
    timeout: float,
    slow_start_after_idle: bool = True,
    env: dict[str, str] | None = None,
) -> Any:
    """Run ``<worker> --worker SPEC`` (`lab_worker`'s command, or another module's) on every node of a lab cluster;
    return rank 0's result.

    `spec` is handed to the workers as a JSON file; it gains ``out``, the file rank 0 writes its JSON
    result to. One thread per process (``OMP_NUM_THREADS=1``), as in the rest of the suite; `env` adds variables.

    Raises:
        RuntimeError: a node's job failed (with the end of its log).
    """
    work = Path(tempfile.mkdtemp(prefix="syncline-lab-job-"))
    spec = {**spec, "out": str(work / "result.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    try:
        lab = run_lab(
            [*worker, _WORKER, str(work / "spec.json")],
            nodes=nodes,
            rate=rate,
            timeout=timeout,
            log_dir=work,
            env={"OMP_NUM_THREADS": "1", **(env or {})},
            slow_start_after_idle=slow_start_after_idle,
        )
    except KeyboardInterrupt:
        shutil.rmtree(work, ignore_errors=True)  # stopped: nothing to read in it
        raise
    if not lab.ok:
        logs = "\n".join(Path(n.log).read_text()[-3000:] for n in lab.node_results if n.returncode)
        job = " ".join(worker[1:])
        raise RuntimeError(f"{job} on {nodes} nodes at {rate or 'unshaped'} failed (logs in {work}):\n{logs}")
    result = json.loads(Path(spec["out"]).read_text())
    shutil.rmtree(work, ignore_errors=True)  # kept only when the job failed, for the logs the error names
    return result


def lab_worker(command: str) -> list[str]:
    """What torchrun runs on each node for the worker of lab command `command`: ``-m syncline.lab <command>``."""
    return ["-m", MODULE, command]


def run_isolating(
    run: Callable[[list[Any]], list[dict[str, Any]]], strategies: list[Any], isolated: Sequence[str]
) -> list[dict[str, Any]]:
    """`run` (one lab job) on the strategies whose label is not in `isolated`, then each isolated one in a job of its
    own, whose failure becomes a record (``failed``, the error's `root_cause`) instead of ending the grid.

    `strategies` are (label, registered name, options); torch's PowerSGD hook, for one, can die of a collective-size
    mismatch on gloo, and would take every strategy of a shared job down with it.
    """
    shared = [s for s in strategies if s[0] not in isolated]
    records = run(shared) if shared else []
    for strategy in (s for s in strategies if s[0] in isolated):
        try:
            records += run([strategy])
        except RuntimeError as error:
            label, name, options = strategy
            cause = root_cause(str(error)) or type(error).__name__
            print(f"{label}: failed ({cause})", flush=True)
            records.append(
                {"label": label, "strategy": name, "options": options, "failed": True, "error": cause[-500:]}
            )
    return records


#: Seconds without a training step after which a lab worker ends itself (`StallGuard`): the slowest step measured,
#: the single parameter server's on 4 nodes at 100 Mbit/s, takes about 7 s; start-up and a validation under a minute.
STALL_S = 300.0


class StallGuard:
    """Inside a lab worker: end the process when no training step has ended for `seconds` (a hang, e.g. torch's
    PowerSGD hook on gloo waiting on a future its mismatched collectives never complete, which no process-group
    timeout bounds). Call `beat()` after every step; `stop()` when training is over.

    The job then fails with the guard's message, and `run_isolating` records the failure; a guard that fires in a
    shared job ends the grid as any failure there would.
    """

    def __init__(self, what: str, seconds: float = STALL_S) -> None:
        self.seconds, self.what = seconds, what
        self._beat = threading.Event()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="lab-stall-guard", daemon=True).start()

    def beat(self) -> None:
        """A step ended."""
        self._beat.set()

    def stop(self) -> None:
        """Training is over: stop watching."""
        self._done.set()
        self._beat.set()

    def _watch(self) -> None:
        while not self._done.is_set():
            if not self._beat.wait(self.seconds):
                print(f"lab worker: no training step of {self.what} ended in {self.seconds:g} s: hung", flush=True)
                os._exit(3)
            self._beat.clear()


def root_cause(logs: str) -> str:
    """The line of a failed job's logs that says why: gloo's failed check (a collective mismatch) first, then the
    first rank's error, else the last line (the agent's own exit, which only says that a worker died)."""
    lines = [line.strip() for line in logs.strip().splitlines() if line.strip()]
    checks = [line for line in lines if "enforce fail" in line]
    ranks = [line for line in lines if "[rank" in line and "Error" in line]
    return (checks or ranks or lines[-1:] or [""])[0]


def add_worker_argument(parser: argparse.ArgumentParser) -> None:
    """Give a lab script's command the hidden ``--worker SPEC`` that `run_worker_job` starts it with."""
    parser.add_argument(_WORKER, metavar="SPEC", help=argparse.SUPPRESS)


def run_worker_if_asked(args: argparse.Namespace, worker: Callable[[dict[str, Any]], None]) -> bool:
    """If the command was started by `run_worker_job` (``--worker SPEC``), run `worker` on the spec; say so."""
    if args.worker is None:
        return False
    worker(json.loads(Path(args.worker).read_text()))
    return True


#: The exit status of a lab command on a machine where the lab cannot run.
UNAVAILABLE = 3


def lab_unavailable(command: str) -> bool:
    """Where the lab cannot run, say so in one line on stderr naming `command` and why, and return True (the
    command then exits with `UNAVAILABLE`)."""
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"{command}: network lab unavailable: {reason}", file=sys.stderr)
    return reason is not None


# ------------------------------------------------------------------ inside the namespaces
def _inside(spec: dict[str, Any]) -> None:
    """Build the nodes, run torchrun in each, measure the links, and write the result (runs as the lab)."""
    nodes, rate = spec["nodes"], spec["rate"]
    # SIGTERM (from the command that started the lab, on its Ctrl-C or its own SIGTERM) or SIGHUP raise here,
    # so that `_run_nodes` ends every process of every node before the lab, and with it the namespaces, goes.
    interrupt_on_signals()
    build_nodes(nodes, rate, spec.get("slow_start_after_idle", True))
    before = [_veth_bytes(node) for node in range(nodes)]
    started = time.monotonic()
    returncodes, logs = _run_nodes(spec)
    wall = time.monotonic() - started
    after = [_veth_bytes(node) for node in range(nodes)]
    node_results = [
        # The bridge port receives what the node sends, and sends what it receives.
        NodeResult(
            node, returncodes[node], after[node][0] - before[node][0], after[node][1] - before[node][1], logs[node]
        )
        for node in range(nodes)
    ]
    result = LabResult(nodes, rate, parse_rate(rate) if rate else None, wall, node_results)
    Path(spec["result"]).write_text(json.dumps(asdict(result), indent=2) + "\n")
    for node in range(nodes):
        subprocess.run(["ip", "netns", "del", f"node{node}"], check=False)


def build_nodes(nodes: int, rate: str | None, slow_start_after_idle: bool = True) -> None:
    """Make `nodes` network namespaces ``node<i>`` at 10.77.0.<i+1> on one bridge, each link shaped to `rate`.

    Call it inside a private mount and network namespace (``unshare -mn``): everything it makes ends with it.
    """
    _sh("mount", "-t", "tmpfs", "tmpfs", "/run")  # ip netns writes here; private to this mount namespace
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", "br0", "type", "bridge")
    _sh("ip", "link", "set", "br0", "up")
    for node in range(nodes):
        ns, veth = f"node{node}", f"veth{node}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "link", "set", veth, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{node + 1}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if not slow_start_after_idle:
            _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
        if rate is not None:
            # Both directions: the node's upload (its eth0) and its download (the bridge's port).
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                "burst", BURST, "latency", LATENCY)  # fmt: skip
            _sh("tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", rate, "burst", BURST, "latency", LATENCY)


def torchrun_command(nodes: int, node: int, procs_per_node: int, command: Sequence[str]) -> list[str]:
    """The torchrun command line node `node` of the lab runs (rendezvous at node 0's address)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nodes), "--nproc-per-node", str(procs_per_node), "--node-rank", str(node),
        "--master-addr", f"{SUBNET}.1", "--master-port", str(MASTER_PORT),
        *command,
    ]  # fmt: skip


def start_nodes(
    nodes: int,
    procs_per_node: int,
    command: Sequence[str],
    log_dir: Path,
    env: dict[str, str],
    torchrun: bool = True,
    only: Sequence[int] | None = None,
) -> tuple[list[subprocess.Popen], list[str]]:
    """Start torchrun running `command` on every node (its own session each); return them and their logs.

    With ``torchrun=False`` each node runs ``python <command>`` itself, with MASTER_ADDR (node 0's address),
    MASTER_PORT and NODE_RANK set: one launcher per node, as ``Trainer(num_nodes=N, recovery="live")`` runs.
    `only` starts those nodes alone (a node started again), its log appended to.
    """
    processes, logs = [], []
    for node in range(nodes) if only is None else only:
        log = str(log_dir / f"node{node}.log")
        node_env = {**os.environ, **env, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
        if torchrun:
            line = torchrun_command(nodes, node, procs_per_node, command)
        else:
            line = [sys.executable, *command]
            node_env.update(MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=str(MASTER_PORT), NODE_RANK=str(node))
        with open(log, "w" if only is None else "a") as out:
            processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", f"node{node}", *line],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=node_env,
                    start_new_session=True,
                )
            )
        logs.append(log)
    return processes, logs


def _run_nodes(spec: dict[str, Any]) -> tuple[list[int], list[str]]:
    """Start torchrun on every node at once and wait; if one fails or time runs out, stop the others."""
    nodes = spec["nodes"]
    processes, logs = start_nodes(nodes, spec["procs_per_node"], spec["command"], Path(spec["log_dir"]), spec["env"])
    deadline = time.monotonic() + spec["timeout"]
    codes: list[int | None] = [None] * nodes
    try:
        while None in codes:
            for node, process in enumerate(processes):
                if codes[node] is None:
                    codes[node] = process.poll()
            failed = any(code not in (None, 0) for code in codes)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        running = [node for node, process in enumerate(processes) if process.poll() is None]
        end_nodes(range(nodes))
        for node, process in enumerate(processes):
            process.wait()
            codes[node] = -signal.SIGKILL if node in running and codes[node] is None else process.returncode
    return [int(code) for code in codes], logs  # type: ignore[arg-type]


def end_nodes(nodes: Sequence[int] | range, grace: float = END_GRACE_S) -> None:
    """End every process in the namespaces of `nodes`: torchrun's agents and their workers, whatever session
    each started (torch starts every worker in a session of its own, out of reach of its agent's group).

    SIGTERM first; whatever still runs after `grace` seconds gets SIGKILL. Then the launch folders those processes
    left are removed.
    """
    pids = [pid for node in nodes for pid in _namespace_pids(node)]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = [pid for node in nodes for pid in _namespace_pids(node)]
    while pids:  # SIGKILL, again for any process a dying one started meanwhile
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.2)
        pids = [pid for node in nodes for pid in _namespace_pids(node)]
    # A node's launcher ended by SIGKILL could not remove its launch folder (/tmp/syncline-launch-<pid>-...): remove
    # every one whose launcher is gone, as the next launch on this machine would.
    from syncline.trainer.launcher import remove_stale_launch_dirs

    remove_stale_launch_dirs()


def _signal_all(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _namespace_pids(node: int) -> list[int]:
    """The processes in node `node`'s network namespace (none once it is gone)."""
    out = subprocess.run(["ip", "netns", "pids", f"node{node}"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()] if out.returncode == 0 else []


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def interrupt_on_signals() -> None:
    """In the lab's own process (inside the namespaces): SIGTERM, SIGHUP and SIGINT raise KeyboardInterrupt, naming
    the signal, so that the code running the nodes ends every node's processes before the lab goes."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _interrupt)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While the lab runs, let SIGTERM and SIGHUP to this process stop it as Ctrl-C does (KeyboardInterrupt),
    so the lab is told to end its nodes instead of being left running when this process dies."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _veth_bytes(node: int) -> tuple[int, int]:
    """Return (bytes the node sent, bytes it received), read off the bridge side of its veth pair."""
    out = subprocess.run(["ip", "-j", "-s", "link", "show", f"veth{node}"], capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def _sh(*args: str) -> None:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"lab setup failed: {' '.join(args)}: {result.stderr.strip()}")


def _stop_lab(lab: subprocess.Popen) -> None:
    """Tell the lab to stop (SIGTERM: it ends its nodes' processes within `END_GRACE_S`); SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(lab.pid, signal.SIGTERM)
    try:
        lab.wait(timeout=END_GRACE_S + 3)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.pid, signal.SIGKILL)
        lab.wait()


def _temporary_dir() -> str:
    return tempfile.mkdtemp(prefix="syncline-lab-")


# ------------------------------------------------------------------ a user's job
@dataclass
class StepReport:
    """How a job's training steps went on the lab's links: read off rank 0's timeline and the links' counters."""

    steps: int
    #: Mean time from one optimizer step's start to the next's on rank 0, the first step (warm-up) aside: what
    #: a strategy's periodic work costs is in it (validation too, when the job validates: switch it off).
    seconds_per_step: float
    #: Each node's bytes sent over the whole job, divided by the steps (start-up traffic included).
    bytes_per_step: list[float]
    #: The busiest node's bytes per step through its link (None on unshaped links): no step can be shorter.
    wire_seconds: float | None

    @property
    def wire_share(self) -> float | None:
        """The wire's bound over the measured step: near 1, the link is the limit; near 0, compute or latency."""
        return None if self.wire_seconds is None else self.wire_seconds / self.seconds_per_step


def step_starts(trace_path: str | os.PathLike[str]) -> dict[int, float]:
    """Return rank 0's optimizer steps and when each started (seconds), from a `CommunicationTimeline` trace."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    starts: dict[int, float] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("pid") == 0 and event.get("name") == "forward":
            step = int(event["args"]["step"])
            starts[step] = min(starts.get(step, float("inf")), event["ts"] / 1e6)
    return starts


def step_report(result: LabResult, trace_path: str | os.PathLike[str]) -> StepReport:
    """Combine a lab run's link counters with its timeline into seconds and bytes per step."""
    starts = step_starts(trace_path)
    steps = sorted(starts)
    if len(steps) < 2:
        raise RuntimeError(f"{trace_path} holds fewer than two steps; run the job for more steps.")
    # From the second step's start to the last's: the first step (warm-up, bucket rebuild) is left out.
    first = steps[1] if len(steps) > 2 else steps[0]
    seconds = (starts[steps[-1]] - starts[first]) / (steps[-1] - first)
    per_step = [node.bytes_sent / len(steps) for node in result.node_results]
    wire = max(per_step) * 8 / result.rate_bits_per_second if result.rate_bits_per_second else None
    return StepReport(len(steps), seconds, per_step, wire)


def with_run_dir(command: Sequence[str], run_dir: Path) -> list[str]:
    """Give a ``-m syncline`` command one output folder for every node (Hydra would make one per node)."""
    command = list(command)
    if command[:2] == ["-m", "syncline"] and not any(arg.startswith("hydra.run.dir=") for arg in command):
        command.append(f"hydra.run.dir={run_dir}")
    return command


def run_job(
    command: Sequence[str], nodes: int, rate: str | None, procs_per_node: int, timeout: float, log_dir: Path
) -> tuple[LabResult, StepReport | None]:
    """Run a user's `command` on the lab (from the working directory) and report its steps, if it trained."""
    from syncline.trainer.arguments import TIMELINE_ENV  # here: the lab's own process need not import torch

    log_dir.mkdir(parents=True, exist_ok=True)
    trace = log_dir / "timeline.json"
    trace.unlink(missing_ok=True)
    command = with_run_dir(command, Path.cwd() / "outputs" / f"lab-{log_dir.name}")
    result = run_lab(command, nodes, rate, procs_per_node, timeout, log_dir, env={TIMELINE_ENV: str(trace)})
    return result, (step_report(result, trace) if result.ok and trace.is_file() else None)


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--nodes", type=int, default=2, help="network namespaces, one torchrun node each")
    parser.add_argument("--rate", default=None, help="each node's link rate, e.g. 100mbit or 1gbit (default: unshaped)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes torchrun starts on each node")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        help="with `-m syncline`: add trainer.max_steps=N unless the command bounds training itself (0: do not)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds the job may take (each, with --strategies)"
    )
    parser.add_argument(
        "--log-dir", default=None, help="where the nodes' logs and the timeline go (default: a new temp folder)"
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategy names, or 'all': run a `-m syncline ...` command once with each "
        "(strategy=<name> appended) and print a table",
    )
    parser.add_argument("--json", default=None, help="also write the report (or the table's rows) to this JSON file")
    add_inside_argument(parser)
    parser.add_argument(
        "torchrun_args", nargs=argparse.REMAINDER, help="after --: a script and its arguments, or -m module ..."
    )


def command(args: argparse.Namespace) -> int | None:
    """``python -m syncline.lab cluster --nodes N --rate R -- <what torchrun runs>``."""
    if args.inside_lab is not None:
        _inside(json.loads(args.inside_lab))
        return 0
    return _command(args)


def _command(args: argparse.Namespace) -> int | None:
    torchrun_args = args.torchrun_args[1:] if args.torchrun_args[:1] == ["--"] else args.torchrun_args
    if not torchrun_args:
        print(
            "usage: python -m syncline.lab cluster [options] -- <script and arguments | -m module ...>"
            "\n(--help for the options)",
            file=sys.stderr,
        )
        return 2
    if args.rate is not None:
        try:
            parse_rate(args.rate)
        except ValueError as error:
            print(f"error: --rate: {error}", file=sys.stderr)
            return 2
    names = _strategy_names(args.strategies, torchrun_args)
    if isinstance(names, str):
        print(names, file=sys.stderr)
        return 2
    torchrun_args = bounded(torchrun_args, args.max_steps)
    if lab_unavailable("lab cluster"):
        return UNAVAILABLE
    log_dir = Path(args.log_dir) if args.log_dir else Path(_temporary_dir())
    link = f"{args.rate} links" if args.rate else "unshaped links"
    steps = next((arg for arg in torchrun_args if arg.startswith("trainer.max_steps=")), None)
    print(
        f"lab: each job ends by {args.timeout:.0f} s (--timeout)" + (f", at {steps} (--max-steps)" if steps else ""),
        flush=True,
    )
    if names is None:
        result, report = run_job(torchrun_args, args.nodes, args.rate, args.nproc_per_node, args.timeout, log_dir)
        print(f"{args.nodes} nodes, {link}: {result.wall_seconds:.1f} s")
        for node in result.node_results:
            print(f"  node {node.node}: exit {node.returncode}, sent {node.bytes_sent:,} B, received "
                  f"{node.bytes_received:,} B  (log: {node.log})")  # fmt: skip
        if report is not None:
            print(_describe(report))
        _write_json(args.json, {"lab": asdict(result), "steps": asdict(report) if report else None})
        return 0 if result.ok else 1
    rows = []
    print(f"{len(names)} strategies on {args.nodes} nodes, {link} (logs under {log_dir}):")
    print(f"  {'strategy':<26}{'s/step':>9}{'MB/step (busiest node)':>24}{'wire s/step':>13}{'wire share':>12}")
    for name in names:
        result, report = run_job(
            [*torchrun_args, f"strategy={name}"], args.nodes, args.rate, args.nproc_per_node, args.timeout,
            log_dir / name,
        )  # fmt: skip
        rows.append({"strategy": name, "ok": result.ok, "steps": asdict(report) if report else None})
        if report is None:
            print(f"  {name:<26}{_failure(result) or 'did not train'} (logs: {log_dir / name})")
            continue
        wire = f"{report.wire_seconds:.3f}" if report.wire_seconds else "-"
        share = f"{report.wire_share:.0%}" if report.wire_share is not None else "-"
        busiest = max(report.bytes_per_step) / 1e6
        print(f"  {name:<26}{report.seconds_per_step:>9.3f}{busiest:>24.2f}{wire:>13}{share:>12}")
    _write_json(args.json, {"nodes": args.nodes, "rate": args.rate, "rows": rows})
    return 0 if all(row["ok"] for row in rows) else 1


def bounded(torchrun_args: Sequence[str], max_steps: int) -> list[str]:
    """A syncline command line with ``trainer.max_steps=<max_steps>`` added, unless it bounds training itself
    (the Trainer's default is 1,000 epochs); any other command is bounded by ``--timeout`` alone."""
    args = list(torchrun_args)
    if args[:2] != ["-m", "syncline"] or max_steps <= 0:
        return args
    keys = {arg.partition("=")[0].lstrip("+~") for arg in args[2:]}
    if keys & {"trainer.max_steps", "trainer.max_epochs", "trainer.max_time", "trainer.fast_dev_run"}:
        return args
    return [*args, f"trainer.max_steps={max_steps}"]


#: Strategies `--strategies all` leaves out: `single` trains an independent model in every process, with no
#: communication to time.
NOT_DISTRIBUTED = ("single",)


def _strategy_names(option: str | None, torchrun_args: Sequence[str]) -> list[str] | None | str:
    """The strategies `--strategies` names (None without it), or the one-line error about them."""
    if option is None:
        return None
    if list(torchrun_args[:2]) != ["-m", "syncline"]:
        return "error: --strategies needs a `-m syncline ...` command (it appends strategy=<name> to it)."
    from syncline.strategies.registry import STRATEGIES

    distributed = sorted(name for name in STRATEGIES if name not in NOT_DISTRIBUTED)
    names = distributed if option == "all" else [name.strip() for name in option.split(",") if name.strip()]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        return f"error: --strategies: unknown {', '.join(unknown)}; registered: {', '.join(distributed)}"
    alone = [name for name in names if name in NOT_DISTRIBUTED]
    if alone:
        return (
            f"error: --strategies: {', '.join(alone)} trains an independent model in each process (no "
            f"communication to measure); choose among {', '.join(distributed)}"
        )
    return names


def _failure(result: LabResult) -> str | None:
    """The first ``error:`` line a failed node's job printed (syncline's CLI prints one), shortened."""
    for node in result.node_results:
        if node.returncode != 0 and Path(node.log).is_file():
            for line in Path(node.log).read_text(errors="replace").splitlines():
                if line.startswith("error: "):
                    return line if len(line) <= 100 else line[:97] + "..."
            return f"node {node.node} exited with {node.returncode}"
    return None


def _describe(report: StepReport) -> str:
    per_node = ", ".join(f"{size / 1e6:.2f}" for size in report.bytes_per_step)
    line = f"  {report.steps} steps: {report.seconds_per_step:.3f} s per step"
    line += f"; MB sent per node per step: {per_node}"
    if report.wire_seconds:
        line += (
            f"; the busiest link needs {report.wire_seconds:.3f} s per step ({report.wire_share:.0%} of the step: "
            + ("the link limits it)" if report.wire_share >= 0.5 else "compute or latency limits it)")
        )
    return line


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
