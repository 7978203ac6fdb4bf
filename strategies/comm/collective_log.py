"""A short per-rank log of launched collectives, compared across ranks when one times out.

Collectives pair up across ranks by their order alone: if one rank launches a collective the others do
not, every rank ends up waiting for a partner that never comes (or pairs with the wrong one). Each
process therefore numbers the collectives it launches and keeps the last `CAPACITY` in a ring. When a
collective fails or times out, the rank that sees it publishes its ring to the process group's store
and waits a short while (at most `DIAGNOSIS_WAIT_S`, every store call under one deadline) for the other
ranks' rings (they publish theirs when their own collective times out); the error then says where the
sequences first diverge, or which ranks never reported (stuck outside any collective: computing,
loading data, dead, or cut off).

    COLLECTIVES.record("all-reduce of gradient bucket 3 of step 1207")   # at every launch
    raise CollectiveError(what + COLLECTIVES.diagnose(timeout))          # on a timeout
"""

from __future__ import annotations

import json
import threading
from collections import deque
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CAPACITY", "COLLECTIVES", "DIAGNOSIS_WAIT_S", "CollectiveLog", "diagnosis_wait", "first_divergence"]

#: Collectives each rank remembers.
CAPACITY = 64
#: Seconds a rank whose collective timed out waits for the others' logs.
DIAGNOSIS_WAIT_S = 6.0
#: Seconds beyond the wait that the store calls may take before the diagnosis gives up on them.
_STORE_SLACK_S = 2.0
_KEY = "syncline/collectives"


class CollectiveLog:
    """The collectives this process launched, numbered from 0, the last `CAPACITY` of them kept."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.entries: deque[tuple[int, str]] = deque(maxlen=capacity)
        self.count = 0
        #: The strategy that launches them (its registered name), for messages.
        self.strategy = "?"
        #: Whether a failed collective waits for the other ranks' logs to say where they diverged. Live recovery
        #: turns it off: a lost peer is recovered from, not diagnosed, and the wait would delay every survivor.
        self.diagnosing = True
        self._reports = 0

    def record(self, what: str) -> None:
        """Note that this rank launches the collective described by `what` (cheap: no communication)."""
        self.entries.append((self.count, what))
        self.count += 1

    def reset(self, strategy: str) -> None:
        """Start a new log (a new process group) for `strategy`."""
        self.entries.clear()
        self.count, self.strategy, self._reports = 0, strategy, 0

    def diagnose(self, wait_s: float) -> str:
        """Publish this rank's log, wait up to `wait_s` seconds for the others', and say where they diverge.

        Every store call runs under one deadline (`wait_s` plus a little): on a partitioned link the
        store may never answer, and a rank that is failing must not block on its diagnosis.

        Returns a message fragment (starting with a space) for the error being raised; never raises.
        """
        if not self.diagnosing:
            return f" Strategy {self.strategy!r}."
        try:
            store = dist.distributed_c10d._get_default_store()
            rank, world = dist.get_rank(), dist.get_world_size()
        except Exception as error:  # no group, or a store we cannot reach: the error stands alone
            return f" (collectives could not be compared across ranks: {error})"
        prefix = f"{_KEY}/{self._reports}"
        self._reports += 1
        mine = list(self.entries)
        outcome: list[str] = []

        def compare() -> None:
            store.set(f"{prefix}/{rank}", json.dumps(mine))
            logs: dict[int, list[tuple[int, str]]] = {rank: mine}
            missing, wait = [], wait_s
            for other in range(world):
                if other == rank:
                    continue
                try:
                    store.wait([f"{prefix}/{other}"], timedelta(seconds=wait))
                    logs[other] = [tuple(entry) for entry in json.loads(store.get(f"{prefix}/{other}"))]
                except Exception:  # it did not report in time
                    missing.append(other)
                    wait = 0.1  # do not wait the full time again for every silent rank
            outcome.append(" " + describe(logs, missing, self.strategy))

        # A daemon thread: if the store hangs, it is left behind in a process that is about to fail.
        thread = threading.Thread(target=compare, name="syncline-hang-diagnosis", daemon=True)
        thread.start()
        thread.join(wait_s + _STORE_SLACK_S)
        if not outcome:
            return (
                f" Strategy {self.strategy!r}. (Collectives could not be compared across ranks: the store did not "
                f"answer within {wait_s + _STORE_SLACK_S:g} s; a peer or the link to it is probably gone.)"
            )
        return outcome[0]


def diagnosis_wait(error: BaseException | None, timeout: float) -> float:
    """Seconds to wait for the other ranks' logs after `error` (None: the collective timed out).

    A timeout means the peers are alive but elsewhere, or cut off: the ones blocked in a collective
    report within seconds of their own timeout, so wait up to `DIAGNOSIS_WAIT_S`, which keeps the error
    within timeout + 10 s. A broken connection means a peer is gone and will never report: wait
    briefly, so a rank that died or raised ends the others in seconds.
    """
    text = str(error).lower() if error is not None else "timed out"
    timed_out = "timed out" in text or "timeout" in text
    return min(timeout, DIAGNOSIS_WAIT_S if timed_out else 2.0)


def first_divergence(logs: dict[int, list[tuple[int, str]]]) -> tuple[int, dict[int, str]] | None:
    """Return the first sequence number at which the ranks' logs differ, with what each rank launched there."""
    by_rank = {rank: dict(entries) for rank, entries in logs.items()}
    first = max((entries[0][0] for entries in logs.values() if entries), default=0)
    last = max((entries[-1][0] for entries in logs.values() if entries), default=-1)
    for number in range(first, last + 1):
        launched = {rank: entries.get(number, "nothing (its log ends before)") for rank, entries in by_rank.items()}
        if len(set(launched.values())) > 1:
            return number, launched
    return None


def describe(logs: dict[int, list[tuple[int, str]]], missing: list[int], strategy: str) -> str:
    """Say, for the error message, where the ranks' collective sequences diverge and who did not report."""
    parts = [f"Strategy {strategy!r}."]
    divergence = first_divergence(logs)
    if divergence is not None:
        number, launched = divergence
        each = "; ".join(f"rank {rank}: {what}" for rank, what in sorted(launched.items()))
        parts.append(
            f"The ranks' collectives diverge at collective #{number}: {each}. Every rank must launch the same "
            "collectives in the same order (look for rank-dependent code paths around that point)."
        )
    elif len(logs) > 1:
        last = {rank: entries[-1][1] if entries else "none" for rank, entries in sorted(logs.items())}
        parts.append(f"The reporting ranks launched the same collectives; the last: {last}.")
    if missing:
        ranks = ", ".join(map(str, missing))
        parts.append(
            f"Rank(s) {ranks} did not report: they are not waiting in a collective (stuck computing or loading "
            "data, or dead)."
        )
    return " ".join(parts)


#: This process's log (one process group per process).
COLLECTIVES = CollectiveLog()
