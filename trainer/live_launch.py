"""Live recovery's engine: one elastic agent per replica, membership by torch's rendezvous, groups rebuilt in place.

Engine: torch.distributed's own pieces, not torchft. Each replica is a one-process worker group under its own torch
elastic agent (`elastic_launch`, as torchrun runs it), so that the agent restarts that worker alone when it dies:
torch's `LocalElasticAgent` stops and restarts *every* worker it watches on any failure, which is exactly the
restart-from-disk this path avoids. The agent forks its worker rather than spawning a fresh interpreter: it has
imported torch and the launching script (as every spawned process does), but it never reads the payload or touches
a GPU itself, and its only other threads are its loopback store's, which no worker uses; so a worker, and above all
a replacement, skips the interpreter's start and torch's import (1.5-2 s of CPU each; on lab nodes the rendezvous
round, not that start, sets when a replacement trains: docs/performance.md). The worker first drops the signal
handlers it inherited (`_as_if_started_afresh`). The replicas find each other through one `TCPStore`, hosted by the
launching process (with `num_nodes` > 1: node 0's launcher, on MASTER_ADDR:MASTER_PORT, where torchrun's c10d
rendezvous endpoint would be; each node runs a launcher of its own), with torch elastic's
`DynamicRendezvousHandler` over it (the c10d backend torchrun uses): it decides who is in each round, notices a
dead member by its missed keep-alives, keeps a newcomer on its wait list until the members open a new round, and
gives every round a store of its own, from which a fresh gloo/NCCL default group is made. No transport or
membership logic is ours; the healing state travels over the new process group (`broadcast_object`).

Why not torchft (0.2.0): its Manager runs a quorum before every step and its own lighthouse and HTTP
checkpoint transport beside torch's; syncline's strategies already run their collectives on the default
group, so rebuilding that group is all they need, and the per-step quorum would cost a round trip on every
step of a run that never fails. torchft also pins torch builds tightly (a C++ extension), while syncline
supports a torch floor; torch's rendezvous ships with torch.

`launch_live` is the launching side; `LiveMembership` is each worker's side (with its `LossWatch`, which aborts
its group as soon as any member posts a loss in its round: trainer/live_watch.py). For diagnosis, set
``SYNCLINE_LIVE_LOGS=<folder>``: each worker's output goes to files there, with a time-stamped line per
rendezvous, and a worker still alive after ``SYNCLINE_LIVE_DUMP_S`` seconds (60) prints its stacks and ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from syncline.strategies.comm.group_abort import joined_group, leave_default_group
from syncline.trainer.live_watch import LossWatch

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = [
    "LiveMembership",
    "MembershipError",
    "StoreLostError",
    "check_live_recovery",
    "inside_live_worker",
    "launch_live",
]

#: Seconds between a member's keep-alives, and how many it may miss before the others count it dead.
KEEP_ALIVE_S = 1
KEEP_ALIVE_MISSES = 3
#: Seconds without a keep-alive after which a member of the current round counts as lost although its connections are
#: open: twice the rendezvous's own limit (it drops such a member from the next round), against false alarms under load.
SILENT_S = 2 * KEEP_ALIVE_S * KEEP_ALIVE_MISSES
#: Seconds a round stays open for late members once one member is in it.
LAST_CALL_S = 2.0
#: Store keys (under the run's prefix).
_ARRIVED = "syncline/live/arrived"
_FAILED = "syncline/live/failed"
_REPLACEMENTS = "syncline/live/replacements"
_ADMIT = "syncline/live/admit"
#: Store keys a multi-node run's launchers agree through: the run's id, its shape, and how often each node started.
_RUN = "syncline/live/run"
_SHAPE = "syncline/live/shape"
_NODE = "syncline/live/node"
#: Seconds a store call may take before the store counts as gone (node 0's launcher died or was cut off).
_STORE_TIMEOUT = timedelta(seconds=60)
#: Environment variables a replica's worker reads to find the job.
_STORE_ENV = "SYNCLINE_LIVE_STORE"
_REPLICAS_ENV = "SYNCLINE_LIVE_REPLICAS"
_RUN_ENV = "SYNCLINE_LIVE_RUN"
_NODES_ENV = "SYNCLINE_LIVE_NODES"
_NODE_ENV = "SYNCLINE_LIVE_NODE"
_JOIN_ENV = "SYNCLINE_LIVE_JOIN"
#: What every node of a multi-node live run is started with (Lightning's general cluster's variables).
_ADDR_ENV, _PORT_ENV, _NODE_RANK_ENV = "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"


class MembershipError(RuntimeError):
    """The live group cannot go on: no member holds the training state, or the restarts are used up."""


class StoreLostError(RuntimeError):
    """The run's store is gone (the launcher hosting it died or was cut off): the run cannot recover without it."""

    def __init__(self, address: str, nodes: int, cause: BaseException | str) -> None:
        host = "node 0's launcher" if nodes > 1 else "the launching process"
        super().__init__(
            f"The live run's store at {address}, hosted by {host}, is gone ({str(cause).splitlines()[0][:200]}). "
            "Membership and healing need it, as torchrun's c10d rendezvous endpoint is needed: every member ends. "
            'Restart every node and resume with ckpt_path="last" (keep a ModelCheckpoint(save_last=True) for this).'
        )


def check_live_recovery(strategy: Any) -> None:
    """Raise `OptionError` naming the strategy and why, if it cannot recover live (one place for every strategy)."""
    from syncline.options import OptionError

    if strategy.multi_process and strategy.live_recovery_refused:
        raise OptionError(
            f'Trainer(recovery="live") does not work with {type(strategy).__name__}: '
            f'{strategy.live_recovery_refused}. Use recovery="checkpoint", or strategy="bucketed_ddp", "local_sgd" '
            'or "diloco".'
        )


# ------------------------------------------------------------------ launching side
@dataclass
class _Job:
    """Where this launcher's replicas find the run: its store, its id, and this node's place in it."""

    store: dist.TCPStore
    address: str
    run_id: str
    replicas: int
    nodes: int
    node: int
    #: Whether this node was started before in this run (and lost): its replicas join the members live.
    rejoin: bool


def inside_live_worker() -> bool:
    """Whether this process is a replica's worker of a live run."""
    return _STORE_ENV in os.environ


def _node_environ(nodes: int) -> tuple[str, int, int]:
    """Node 0's address and port and this node's rank, from the environment every node is started with."""
    from syncline.options import OptionError

    missing = [name for name in (_ADDR_ENV, _PORT_ENV, _NODE_RANK_ENV) if not os.environ.get(name)]
    if missing:
        raise OptionError(
            f'Trainer(num_nodes={nodes}, recovery="live") runs this script on every node, each with MASTER_ADDR '
            "and MASTER_PORT (node 0's address and a free port on it, where node 0 hosts the run's store) and "
            f"NODE_RANK (0 to {nodes - 1}) set; missing here: {', '.join(missing)}."
        )
    node = int(os.environ[_NODE_RANK_ENV])
    if not 0 <= node < nodes:
        raise OptionError(f"NODE_RANK={node}, but Trainer(num_nodes={nodes}) numbers the nodes 0 to {nodes - 1}.")
    return os.environ[_ADDR_ENV], int(os.environ[_PORT_ENV]), node


def _connect(trainer: Trainer) -> _Job:
    """Host the run's store (one node: on 127.0.0.1; several: node 0, at MASTER_ADDR:MASTER_PORT) or join it.

    Raises:
        MembershipError: this node cannot reach node 0's store, or its Trainer differs from node 0's in shape.
    """
    from syncline.trainer.launcher import free_port

    nodes, devices = trainer.num_nodes, trainer.devices
    if nodes == 1:
        port = free_port()
        # The store outlives every worker: it holds the rendezvous state and the job's failure notice.
        store = dist.TCPStore("127.0.0.1", port, None, True, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        return _Job(store, f"127.0.0.1:{port}", uuid.uuid4().hex[:8], devices, 1, 0, False)
    host, port, node = _node_environ(nodes)
    try:
        # Node 0 listens on every interface, as torchrun's c10d endpoint does; the others wait for it to come up.
        wait = timedelta(seconds=float(getattr(trainer.strategy, "timeout", 300.0)))
        store = dist.TCPStore(host, port, None, node == 0, timeout=wait, wait_for_workers=False)
        shape = f"{nodes} nodes x {devices} devices"
        if node == 0:
            store.set(_RUN, uuid.uuid4().hex[:8])
            store.set(_SHAPE, shape)
        run_id, theirs = store.get(_RUN).decode(), store.get(_SHAPE).decode()
        rejoin = store.add(f"{_NODE}{node}", 1) > 1
    except (RuntimeError, dist.DistError) as error:
        what = "host" if node == 0 else "reach"
        raise MembershipError(f"Node {node} could not {what} the live run's store at {host}:{port}: {error}") from None
    if theirs != shape:
        raise MembershipError(f"Node {node} runs {shape}, but node 0 runs {theirs}: start every node alike.")
    store.set_timeout(_STORE_TIMEOUT)
    return _Job(store, f"{host}:{port}", run_id, nodes * devices, nodes, node, rejoin)


def launch_live(trainer: Trainer, stage: str, task: Task, kwargs: dict[str, Any]) -> Any:
    """Run `stage` on `trainer.devices` replicas (per node) that survive each other's deaths; return rank 0's result
    (on another node than rank 0's, the result of this node's lowest rank).

    Raises:
        WorkerFailedError: a worker raised (the job ends, naming it), every replica of this node died, or the
            run's store (node 0's launcher) is gone.
        TrainingPreempted: the workers stopped on a preemption signal and saved a checkpoint.
    """
    from syncline.rng import capture_rng
    from syncline.trainer.launcher import (
        LAUNCH_DIR_PREFIX,
        WorkerFailedError,
        reaped,
        remove_stale_launch_dirs,
        stop_gracefully,
    )
    from syncline.trainer.preemption import TrainingPreempted

    job = _connect(trainer)
    trainer.strategy.check_world_size(job.replicas)
    # Ctrl-C and the preemption signal to this process: every replica stops after the same step with last.ckpt.
    graceful = ["SIGINT"] + [s.name for s in trainer.preemption.signals if s != signal.SIGINT and stage == "fit"]
    context = multiprocessing.get_context("spawn")
    launch_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # Named by this process, as `launch`'s folders are: one a SIGKILLed launcher left is removed by the next launch.
    remove_stale_launch_dirs()
    folder_prefix = f"{LAUNCH_DIR_PREFIX}{os.getpid()}-live-"
    with tempfile.TemporaryDirectory(prefix=folder_prefix) as folder, reaped(launch_id):
        payload = Path(folder, "payload.pkl")
        payload.write_bytes(pickle.dumps((trainer, task, kwargs, capture_rng())))
        stop_file = str(Path(folder, "stop"))
        env = {
            _STORE_ENV: job.address,
            _REPLICAS_ENV: str(job.replicas),
            _RUN_ENV: job.run_id,
            _NODES_ENV: str(job.nodes),
            _JOIN_ENV: "1" if job.rejoin else "0",
            _NODE_ENV: str(job.node),
        }
        agents = [
            context.Process(
                target=_replica_agent,
                args=(i, stage, str(payload), folder, env, stop_file, graceful, trainer.max_restarts),
                daemon=False,
            )
            for i in range(trainer.devices)
        ]
        try:
            with stop_gracefully(graceful, stop_file):
                for agent in agents:
                    agent.start()
                for agent in agents:
                    agent.join()
        finally:
            for agent in agents:
                if agent.is_alive():
                    agent.kill()  # an agent ignores the graceful signals (its worker takes them)
                    agent.join(10)
        outcomes = []
        for path in sorted(Path(folder).glob("result-*.pkl")):
            with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
                outcomes.append(pickle.loads(path.read_bytes()))
    finished = sorted((o for o in outcomes if o is not None), key=lambda o: o.get("rank", 0))
    failed = next((o["failed"] for o in finished if o.get("failed")), "")
    if not failed and not finished:
        # No replica of this node finished: a raise elsewhere ended the job, or every one of them died. (Where one
        # finished, the store is not read: node 0's may be closing, and a call to it would print C++ warnings.)
        failed = _failure_notice(job.store)
    del job.store
    if failed:
        raise WorkerFailedError(failed)
    if not finished:
        codes = ", ".join(f"replica {i}: exit {a.exitcode}" for i, a in enumerate(agents))
        where = f" on node {job.node}" if job.nodes > 1 else ""
        raise WorkerFailedError(f"Every replica of the live {stage}{where} died ({codes}); no result to return.")
    outcome = finished[0]
    trainer.apply_worker_result(task, outcome)
    if outcome.get("preempted"):
        # The workers' output goes to their log files: say it here, as rank 0 says it under `launch`.
        print(f"preempted: {outcome['preempted']}", file=sys.stderr, flush=True)
        raise TrainingPreempted(outcome["preempted"], announced=True)
    return outcome["return"]


def _failure_notice(store: dist.Store) -> str:
    """The job's failure notice ("" if none, or if the store is gone: the replicas then said why themselves)."""
    with contextlib.suppress(Exception):
        if store.check([_FAILED]):
            return store.get(_FAILED).decode()
    return ""


def _replica_agent(
    replica: int,
    stage: str,
    payload: str,
    folder: str,
    env: dict[str, str],
    stop_file: str,
    graceful: list[str],
    max_restarts: int,
) -> None:
    """Run one replica under its own elastic agent, which restarts this replica alone when it dies (the agent never
    reads the payload: the task and its weights are loaded by the worker alone)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from syncline.trainer.launcher import free_port, quiet_elastic
    from syncline.trainer.loopback_rendezvous import LOOPBACK_BACKEND, register

    # Ctrl-C and the preemption signal are the worker's to take (it stops after the step with last.ckpt), not
    # the agent's (it would kill its worker).
    for name in graceful:
        signal.signal(signal.Signals[name], signal.SIG_IGN)
    register()
    os.environ.update(env)
    logs = Path(os.environ.get("SYNCLINE_LIVE_LOGS") or folder, f"logs-{replica}")
    logs.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        run_id=f"syncline-live-{replica}-{free_port()}",
        rdzv_backend=LOOPBACK_BACKEND,
        rdzv_endpoint="",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        # Forked, not spawned: see the module's docstring. A GPU context cannot cross a fork: if importing the
        # script made one in this agent, its worker starts as a fresh interpreter instead.
        start_method="spawn" if torch.cuda.is_initialized() else "fork",
        signals_to_handle=",".join(s for s in ("SIGTERM", "SIGHUP", "SIGQUIT") if s not in graceful),
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL),
    )
    with quiet_elastic():
        try:
            results = elastic_launch(config, _live_worker)(stage, payload, stop_file)
        except Exception:
            results = {0: None}
    Path(folder, f"result-{replica}.pkl").write_bytes(pickle.dumps(results.get(0)))


def _as_if_started_afresh() -> None:
    """Undo what a worker forked from its agent inherits and a spawned one would not: the agent's Python signal
    handlers (torch elastic's, which raise in the agent) and its wakeup descriptor. Ignored signals stay ignored, as
    they do across exec."""
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(signum)):
                # A fresh interpreter turns Ctrl-C into KeyboardInterrupt, and leaves every other signal at its default.
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def _live_worker(stage: str, payload: str, stop_file: str) -> dict[str, Any] | None:
    """One replica's process: join the live group, run the stage, return the result if this ends as rank 0 (or
    as the lowest rank of its node, with several nodes)."""
    from syncline.rng import restore_rng
    from syncline.strategies.comm import worker_guard
    from syncline.trainer.launcher import use_loopback_for_gloo
    from syncline.trainer.live import LiveRecovery
    from syncline.trainer.preemption import TrainingPreempted

    _as_if_started_afresh()
    if int(os.environ[_NODES_ENV]) == 1:
        use_loopback_for_gloo()  # several nodes: gloo uses GLOO_SOCKET_IFNAME, or the host name's interface
    worker_guard.start(stop_file)
    if os.environ.get("SYNCLINE_LIVE_LOGS"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ.get("SYNCLINE_LIVE_DUMP_S", "60")), exit=True)
    _debug("worker started")
    preempted = None
    membership: LiveMembership | None = None
    try:
        membership = LiveMembership.from_environ()
        trainer, task, kwargs, rng = pickle.loads(Path(payload).read_bytes())
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // trainer.devices))
        restore_rng(rng)
        if membership.replacement:
            trainer.num_sanity_val_steps = 0  # the members it joins are mid-training: no validation to match
        membership.start(trainer.max_restarts, trainer.strategy)
        trainer.live = LiveRecovery(trainer, membership)
        try:
            returned = getattr(trainer, stage)(task, **kwargs)
        except TrainingPreempted as stop:
            # A clean stop (every member saved last.ckpt at the same step), not a death: no replacement.
            returned, preempted = None, str(stop)
    except StoreLostError as error:
        # Node 0's launcher (the store) is gone: no member can be told apart from a dead one any more.
        print(f"syncline: {error}", file=sys.stderr, flush=True)
        return {"failed": str(error), "rank": -1}
    except (MembershipError, RendezvousClosedError):
        # A replacement that came too late (the run ended, or the restarts are used up): nothing to report.
        return None
    except BaseException as error:
        # A raise is the task's or the configuration's: the job ends, naming this rank (no replacement).
        import traceback

        if membership is None:
            raise
        membership.stop_watch()  # this member leaves the group itself, next
        membership.announce(
            f"Worker rank {membership.rank} failed during {stage}: {type(error).__name__} in this traceback:\n"
            f"{traceback.format_exc().rstrip()}"
        )
        # Leaving the group closes this rank's connections: a peer blocked in a collective fails and reads the notice.
        leave_default_group()
        return None
    worker_guard.stage_finished()
    rank, first_here = membership.rank, membership.lowest_rank_of_node()
    membership.close()
    if rank != 0 and not first_here:
        return None
    return {**trainer.worker_result(task, returned), "preempted": preempted, "rank": rank}


# -------------------------------------------------------------------- worker side
@dataclass
class _Round:
    number: int
    rank: int
    world_size: int


class LiveMembership:
    """This worker's place in the live group: the rendezvous rounds it joined and the default group of each.

    Args:
        store: the job's store (hosted by the launching process).
        replicas: how many replicas the job starts with (the rendezvous's maximum).
        run_id: keeps this job's rendezvous apart from any other on the store.
    """

    def __init__(
        self, store: dist.Store, replicas: int, run_id: str, address: str = "", nodes: int = 1, node: int = 0
    ) -> None:
        self.store = store
        self.replicas = replicas
        self.run_id = run_id
        self.address, self.nodes, self.node = address, nodes, node
        self.round: _Round | None = None
        self.backend = "gloo"
        self.timeout = 300.0
        #: Whether its agent restarted this process after a death (a replacement counted by `max_restarts`).
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        #: Whether this process joins members already training: restarted, or on a node started again.
        self.replacement = self.restarted or os.environ.get(_JOIN_ENV) == "1"
        self._handler: DynamicRendezvousHandler | None = None
        self._watch: LossWatch | None = None
        self._silent_backend: C10dRendezvousBackend | None = None

    @classmethod
    def from_environ(cls) -> LiveMembership:
        """Connect to the job's store as `launch_live` described it in the environment.

        Raises:
            StoreLostError: the store does not answer (its host is gone).
        """
        address, nodes = os.environ[_STORE_ENV], int(os.environ.get(_NODES_ENV, "1"))
        host, port = address.rsplit(":", 1)
        try:
            store = dist.TCPStore(host, int(port), None, False, timeout=_STORE_TIMEOUT)
        except (RuntimeError, dist.DistError) as error:
            raise StoreLostError(address, nodes, error) from None
        node = int(os.environ.get(_NODE_ENV, "0"))
        return cls(store, int(os.environ[_REPLICAS_ENV]), os.environ[_RUN_ENV], address, nodes, node)

    def check_store(self) -> None:
        """Raise `StoreLostError` if the run's store does not answer (one small call; up to the store's timeout).

        A failed collective says a peer is gone; this says whether the store that decides who is left is too.
        """
        try:
            self.store.check([_RUN])
        except (RuntimeError, dist.DistError) as error:
            raise StoreLostError(self.address, self.nodes, error) from None

    def lowest_rank_of_node(self) -> bool:
        """Whether this member has the lowest rank of its node's members (with one node: whether it is rank 0).

        A collective over the current group with several nodes: each node's launcher returns one result.
        """
        if self.nodes == 1 or not dist.is_initialized():
            return self.rank == 0
        nodes: list[int] = [0] * dist.get_world_size()
        try:
            # Collective: every member's node, once the stage is over.
            dist.all_gather_object(nodes, self.node)
        except Exception:
            return True
        return nodes.index(self.node) == self.rank

    @property
    def rank(self) -> int:
        """This worker's rank in the current round."""
        return self.round.rank if self.round is not None else -1

    def start(self, max_restarts: int, strategy: Any) -> None:
        """Count this worker in (a replacement against `max_restarts`), then join the first round.

        Raises:
            MembershipError: this replacement would exceed `max_restarts`, or the job already failed.
        """
        self.backend = strategy.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout = float(strategy.timeout)
        if self.store.check([_FAILED]):
            raise MembershipError(self.store.get(_FAILED).decode())
        if self.restarted:
            used = self.store.add(_REPLACEMENTS, 1)
            if used > max_restarts:
                raise MembershipError(
                    f"A replica died and max_restarts={max_restarts} replacements are used up; the survivors "
                    "go on without it."
                )
        if not self.replacement:
            # The first round holds every replica: wait until all have connected (their imports take seconds).
            self.store.add(_ARRIVED, 1)
            deadline = time.monotonic() + self.timeout
            while int(self.store.add(_ARRIVED, 0)) < self.replicas:
                if time.monotonic() > deadline:
                    raise MembershipError(
                        f"Only some of the {self.replicas} replicas started within {self.timeout:g} s."
                    )
                time.sleep(0.05)
        self._handler = DynamicRendezvousHandler.from_backend(
            run_id=f"syncline-live-{self.run_id}",
            store=self.store,
            backend=C10dRendezvousBackend(self.store, f"syncline-live-{self.run_id}"),
            min_nodes=1,
            max_nodes=self.replicas,
            timeout=RendezvousTimeout(
                # Past a collective timeout: a member blocked in a collective whose loss nobody posted (the watch
                # aborts its group once one member posts it) comes to the round only when that collective times out.
                join=timedelta(seconds=2 * self.timeout + 30),
                last_call=timedelta(seconds=LAST_CALL_S),
                close=timedelta(seconds=30),
            ),
            keep_alive_interval=KEEP_ALIVE_S,
            keep_alive_max_attempt=KEEP_ALIVE_MISSES,
        )
        host, port = self.address.rsplit(":", 1) if self.address else ("", "0")
        if host:
            self._watch = LossWatch(host, int(port), _FAILED, silent=self._silent_member)
        if self.replacement:
            # Set the task, optimizer and strategy up alone first (their collectives are the members' at the
            # start of fit, not now); the loop then joins the members at a step boundary and heals.
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
            self.round = _Round(-1, 0, 1)
            return
        self.next_round()

    def next_round(self) -> _Round:
        """Leave the current round and its process group; join the next round and a new default group.

        Blocks until every live member has come to the round too (a dead one is dropped once it misses
        its keep-alives; a waiting replacement comes in). The ranks of the new round follow the
        rendezvous's order, not the old one.
        """
        assert self._handler is not None
        if self._watch is not None:
            self._watch.disarm()  # a loss posted for the round being left must not abort the next one's group
        # Closes this rank's connections: a peer still blocked in a collective with it fails at once.
        leave_default_group()
        # Torch's rendezvous would otherwise make its new rank 0 host a second store.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        _debug("rendezvous")
        info = self._handler.next_rendezvous()
        _debug(f"joined as {info.rank} of {info.world_size}")
        number = self._handler._state_holder.state.round  # the round's number keys its group's store
        self.round = _Round(number, info.rank, info.world_size)
        os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK="0")
        # Collective: every member of the round joins its group through the round's own store.
        with joined_group(self._store_port()):
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"syncline/live/group{number}", info.store),
                rank=info.rank,
                world_size=info.world_size,
                timeout=timedelta(seconds=self.timeout),
            )
        if self._watch is not None:
            self._watch.arm(number)
        return self.round

    def _silent_member(self, store: dist.Store, number: int) -> str | None:
        """A member of round `number` that sent no keep-alive for `SILENT_S` seconds, or that the rendezvous
        already dropped for it (None: every member is alive, or the round is over). Reads the rendezvous state."""
        if self._silent_backend is None:  # made once, on the watch's own store client (its constructor writes a key)
            self._silent_backend = C10dRendezvousBackend(store, f"syncline-live-{self.run_id}")
        got = self._silent_backend.get_state()
        round_ = self.round
        if got is None or round_ is None or round_.number != number:
            return None
        state = pickle.loads(got[0])
        if state.round != number or not state.complete:
            return None  # a new round is forming: the loss is known
        if len(state.participants) < round_.world_size:
            return f"a member of round {number} was dropped by the rendezvous (no keep-alive)"
        limit = datetime.now(timezone.utc) - timedelta(seconds=SILENT_S)
        for node, rank in state.participants.items():
            beat = state.last_heartbeats.get(node)
            if beat is not None and beat < limit:
                return f"rank {rank} ({node}) sent no keep-alive for {SILENT_S:g} s"
        return None

    def _store_port(self) -> int | None:
        return int(self.address.rsplit(":", 1)[1]) if self.address else None

    def post_loss(self, what: str) -> None:
        """Tell every member that this round lost a member (its collective failed): each aborts its group now.

        A member not next to the dead one in gloo's ring would otherwise stay blocked until the timeout.
        """
        if self._watch is not None and self.round is not None and self.round.number >= 0:
            _debug(f"loss posted in round {self.round.number}")
            self._watch.post(self.store, self.round.number, what)

    def stop_watch(self) -> None:
        """Stop aborting this member's group on a loss (the stage is over)."""
        if self._watch is not None:
            self._watch.stop()

    def waiting(self) -> int:
        """How many replacements wait to be admitted (one read of the rendezvous state)."""
        assert self._handler is not None
        n = self._handler.num_nodes_waiting()
        _debug(f"waiting {n}")
        return n

    def post_admission(self, step: int) -> None:
        """Ask every member to open a new round once it has taken `step` optimizer steps (set once per round)."""
        assert self.round is not None
        self.store.compare_set(f"{_ADMIT}/{self.round.number}", "", str(step))

    def admission_step(self) -> int | None:
        """The step after which the members open a new round for a waiting replacement, if one was posted."""
        assert self.round is not None
        key = f"{_ADMIT}/{self.round.number}"
        if not self.store.check([key]):
            return None
        return int(self.store.get(key).decode())

    def close(self) -> None:
        """Leave the group together and close the rendezvous once training is over.

        A replacement still waiting then ends instead of waiting. The group is destroyed after a barrier:
        gloo's threads torn down by the interpreter's exit while a peer still talks abort the process
        ("terminate called without an active exception"), which its agent would take for a death.
        """
        self.stop_watch()
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                # Collective: every member has finished the stage before any leaves the group.
                if self.backend == "gloo":
                    dist.monitored_barrier(timeout=timedelta(seconds=60))
                else:
                    dist.barrier()
                dist.destroy_process_group()
        if self._handler is not None:
            with contextlib.suppress(Exception):
                self._handler.set_closed()

    def announce(self, message: str) -> None:
        """Tell the job (the launching process and every replica) that it is over, and why (first one wins)."""
        with contextlib.suppress(Exception):
            self.store.compare_set(_FAILED, "", message)

    def failure(self) -> str | None:
        """The job's failure notice, if a replica raised."""
        with contextlib.suppress(Exception):
            if self.store.check([_FAILED]):
                return self.store.get(_FAILED).decode()
        return None


def _debug(message: str) -> None:
    if os.environ.get("SYNCLINE_LIVE_LOGS"):
        print(f"{time.time():.2f} {os.getpid()} {message}", file=sys.stderr, flush=True)
