"""BAGUA's asynchronous model averaging (Gan et al., VLDB 2022, section 4; after Lian et al. 2018, AD-PSGD).

Algorithm, after `warmup_steps` optimizer steps of exact data parallel:

    main thread:       loop: x = step(x, g_local)                    # never waits for the network
                             if a round finished: x += avg - x_then  # apply it between two steps
    averaging thread:  every interval_ms:
                             x_then = copy of x                      # under the lock: no torn step
                             avg = allreduce_mean(x_then)            # on its own gloo group
                             hand (avg, x_then) to the main thread

The thread never writes parameters: a forward or backward may be reading them (autograd would see them
change under it). The main thread adds the round's correction ``avg - x_then`` after its next optimizer
step, keeping the local progress made while the round was in flight. The thread has its own process
group (`dist.new_group`, made at setup), so its collectives never interleave with the main thread's.

Stopping is agreed: every round starts with a one-float all-reduce of "someone wants to stop", so every
rank's thread leaves after the same round and none waits on a peer that has left. After this rank's stage
failed there is no agreement: the thread starts no new collective (the peers may be cut off), which
would wait a second collective timeout after the one that failed. Teardown (also after
an exception) asks the thread to stop and waits a bounded time; the thread is a daemon, so it never keeps
the process alive.

Resume: timing makes runs not bit-reproducible by nature. At each checkpoint (`state_dict`) every rank's
thread is stopped, the last round's correction applied, and every rank's parameters and optimizer state
are saved (`replicas_differ`), a consistent state from which a resumed run continues; the thread starts
again at the next optimizer step.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from syncline.options import check_number
from syncline.rank_zero import rank_zero_warn
from syncline.strategies.comm.flat import flatten, flatten_by_dtype, unflatten_into
from syncline.strategies.comm.transfers import all_reduce
from syncline.strategies.model_averaging import ModelAveraging

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["AsyncModelAverage"]

#: Longest wait, in seconds, for the averaging thread to leave at teardown.
_JOIN_S = 30.0
#: Seconds the thread gets to stop after this rank's stage failed.
_FAILED_JOIN_S = 2.0


class AsyncModelAverage(ModelAveraging):
    """Exact data parallel for `warmup_steps` steps, then local steps while a thread averages the models.

    Args:
        interval_ms: milliseconds the averaging thread waits between two rounds.
        warmup_steps: optimizer steps of exact gradient all-reduce before the thread starts.
        kwargs: passed to the core, whose reducer runs the warm-up (`bucket_cap_mb`, `backend`, ...).
    """

    name = "async_model_average"

    def __init__(self, interval_ms: float = 100.0, warmup_steps: int = 0, **kwargs: Any) -> None:
        check_number("AsyncModelAverage", "interval_ms", interval_ms, minimum=0, meaning="ms between averagings")
        super().__init__(warmup_steps=warmup_steps, **kwargs)
        self.interval_ms = interval_ms
        self.rounds = 0
        self._group: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: list[tuple[list[Tensor], Tensor, Tensor]] | None = None
        self._applied = threading.Event()
        self._error: BaseException | None = None
        #: Set when this rank's stage failed: its peers may be gone, so nobody waits for the thread.
        self._failed = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the thread's primitives: `Trainer(devices=N)` sends the strategy to its workers."""
        state = self.__dict__.copy()
        for name in ("_lock", "_stop", "_applied", "_thread", "_group", "_result", "_error"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._stop, self._applied = threading.Lock(), threading.Event(), threading.Event()
        self._thread, self._group, self._result, self._error = None, None, None, None
        self._failed = False

    # --------------------------------------------------------------- lifecycle
    def after_setup(self, task: Task) -> None:
        """Make the averaging thread's own gloo process group."""
        super().after_setup(task)
        self.rounds = 0
        # Collective: every rank creates the averaging thread's group, in the same order.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))

    def on_failure(self) -> None:
        """Wait only briefly for the averaging thread from now on: its peers may be gone or cut off."""
        self._failed = True
        self._stop.set()

    def teardown(self) -> None:
        """Stop the averaging thread (bounded wait), then remove the reducer's hooks."""
        self.stop_averaging()
        super().teardown()

    # -------------------------------------------------------------- train step
    def apply_update(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Step under the lock: the thread never copies half a step (a finished round is applied after it)."""
        with self._lock:
            super().apply_update(optimizer, step)

    def average_after_step(self, local_step: int) -> None:
        """Apply the round the thread finished, if any; start the thread after the warm-up."""
        self._apply_result()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"AsyncModelAverage: the averaging thread failed: {error}") from error
        if self._thread is None and self.world_size > 1:
            self._stop.clear()
            self._applied.set()
            self._thread = threading.Thread(target=self._run, name="syncline-async-average", daemon=True)
            self._thread.start()

    def _apply_result(self) -> None:
        """x += avg - x_then for the round the thread handed over (main thread, between steps)."""
        result, self._result = self._result, None
        if result is None:
            return
        for tensors, average, then in result:
            current = flatten(tensors)
            unflatten_into(tensors, current + (average - then))
        self._applied.set()

    # ---------------------------------------------------------- the thread
    def _run(self) -> None:
        world = dist.get_world_size(self._group)
        try:
            while True:
                self._stop.wait(self.interval_ms / 1000)
                # Wait until the main thread has applied the previous round (at most one in flight).
                while not self._applied.wait(0.05):
                    if self._stop.is_set():
                        break
                if self._failed:
                    # This rank's stage failed: its peers may be gone or cut off, so a new collective (even
                    # the stop agreement) would only wait out its whole timeout after the failure's own.
                    return
                flag = torch.tensor([1.0 if self._stop.is_set() else 0.0])
                # Collective (averaging group): does any rank want to stop? Then all leave after this round.
                all_reduce(flag, self.comm_counter, group=self._group)
                if flag.item() > 0:
                    return
                with self._lock:
                    snapshot = flatten_by_dtype(self._params)
                result = []
                for tensors, then in snapshot:
                    average = then / world
                    # Collective (averaging group): one flat all-reduce of the parameters of this dtype.
                    all_reduce(average, self.comm_counter, group=self._group)
                    result.append((tensors, average, then))
                with self._lock:
                    self.rounds += 1
                    self._applied.clear()
                    self._result = result
        except BaseException as error:  # reported by the main thread at its next step
            self._error = error

    def stop_averaging(self) -> None:
        """Stop the thread (every rank's, after the same round) and apply its last round; idempotent."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        # After a failure the thread's round may wait for a peer that is gone or cut off, until the group's
        # timeout: wait briefly, then leave it (a daemon) to the process, which is about to end.
        thread.join(_FAILED_JOIN_S if self._failed else _JOIN_S)
        if thread.is_alive() and not self._failed:
            rank_zero_warn(
                f"AsyncModelAverage: the averaging thread did not stop within {_JOIN_S:g} s (a peer left "
                "without stopping its own); it is left behind as a daemon thread."
            )
        self._thread = None
        with self._lock:
            self._apply_result()

    # ------------------------------------------------------------- checkpoints
    def algorithm_state_dict(self) -> dict[str, Any]:
        """Stop every rank's thread so the saved parameters are a consistent state; it restarts next step."""
        self.stop_averaging()
        return {**super().algorithm_state_dict(), "rounds": self.rounds}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `algorithm_state_dict` returned."""
        super().load_algorithm_state_dict(state)
        self.rounds = int(state["rounds"])

    def __repr__(self) -> str:
        return f"AsyncModelAverage(interval_ms={self.interval_ms}, warmup_steps={self.warmup_steps})"
