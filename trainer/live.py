"""`Trainer(recovery="live")`: a lost worker costs the survivors the step in flight, not a restart from disk.

The engine (one elastic agent per replica, torch's rendezvous, the default group rebuilt per round) is in
`trainer/live_launch.py`. This module is the loop's side, used only under ``recovery="live"``:

- **A death.** A survivor's collective fails (the dead peer's connections close). The epoch in progress
  is left where it stands: the batch whose gradients were being averaged takes no optimizer step, since
  the step needs the averaged gradients (a relaxed strategy's averaging that failed after its local step
  leaves that local step in place, uncounted). The survivors join the next rendezvous round, which drops
  the dead member once it misses its keep-alives, and make a new default group.
- **Healing.** Every member says whether it holds the training state and how far it got; the one furthest
  along (the lowest rank among equals) sends its state over the new group: weights, optimizer,
  strategy state, progress, data position and RNG. Under an exact strategy every other member takes all
  of it, so replicas agree bit for bit; under a relaxed one a survivor keeps its own replica and takes
  the progress and data position only; a replacement takes everything. Then every member but the source
  takes what the strategy says all members hold alike (`Strategy.heal_from`: DiLoCo's outer state), and a
  survivor first drops the strategy's work in flight that lost its peer (`Strategy.on_peer_lost`). Nothing
  is read from or written to disk.
- **The rest of the epoch** is re-sharded: the epoch's samples are one sequence (shuffled per epoch from the
  seed), consumed in global batches of ``world_size x batch_size``; after a change the samples not yet
  consumed are split over the new members, the last global batch padded by wrapping around, as
  `DistributedSampler` pads. The samples of a discarded step are trained again; none is skipped.
- **A replacement** (the replica's agent restarts a dead worker, up to `max_restarts` in all) waits on the
  rendezvous's wait list. Rank 0 sees it at a step boundary and posts the step at which every member opens
  a new round: two steps ahead (two averaging periods ahead for local SGD), so that every member reads the
  post before it gets there. The other ranks read the post (one store key) at every optimizer step.

A raise on one rank (the task's error) still ends the job, naming the rank: the raising rank posts its error
and leaves the group, and a survivor whose collective failed reads that notice instead of recovering.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from syncline.callbacks.callback import Callback
from syncline.rank_zero import rank_zero_info
from syncline.rng import capture_rng
from syncline.strategies.comm.collective_log import COLLECTIVES
from syncline.strategies.comm.reducer_errors import CollectiveError
from syncline.trainer.data import limit_batches, loader_settings
from syncline.trainer.live_launch import LiveMembership, MembershipError

if TYPE_CHECKING:
    from syncline.trainer.fit_loop import FitLoop
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["LiveRecovery", "LiveShardSampler"]

#: Rounds a recovery may take (a member dying while the others heal starts another) before it gives up.
_MAX_ROUNDS = 4
#: Seconds between rank 0's looks for replacements waiting to be admitted.
_POLL_S = 1.0
#: Seconds a survivor waits, after its collective failed, for a raising peer's notice to arrive.
_NOTICE_WAIT_S = 0.5


class _NoHolder(MembershipError):
    """Every member of the round is a replacement: none can heal the others."""


class _Admit(Exception):
    """Unwinds the epoch at the agreed step boundary so that a waiting replacement can be admitted."""


class LiveShardSampler(DistributedSampler):
    """This rank's share of the rest of an epoch, after `skip_batches` batches it already trained.

    The epoch is one sequence of the data set's indices (a permutation from ``seed + epoch`` when
    shuffling), of which the first `end` are trained (all of them unless `limit_train_batches` caps the
    epoch); `consumed` of them are trained. The rest is read in global batches of
    ``world_size * batch_size``, rank r taking the r-th `batch_size` slice of each; the last global
    batch wraps around to the sequence's start so that every rank has the same number of batches.
    The first ``skip_batches * batch_size`` indices only fill the batches the loop skips on re-entry.
    """

    def __init__(
        self, size: int, batch_size: int, shuffle: bool, seed: int, epoch: int, consumed: int, skip_batches: int,
        world_size: int, rank: int, end: int | None = None,
    ) -> None:  # fmt: skip
        # A DistributedSampler by type (the loop then knows every rank has as many batches), not by its init.
        self.size, self.batch_size, self.shuffle, self.seed, self.epoch = size, batch_size, shuffle, seed, epoch
        self.consumed, self.skip_batches, self.world_size, self.rank = consumed, skip_batches, world_size, rank
        self.end = size if end is None else min(end, size)

    def order(self) -> list[int]:
        """The epoch's sequence of sample indices."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def remaining_batches(self) -> int:
        """Batches per rank of the rest of the epoch."""
        return math.ceil(max(self.end - self.consumed, 0) / (self.world_size * self.batch_size))

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        rest = order[self.consumed : self.end]
        span = self.world_size * self.batch_size
        total = self.remaining_batches() * span
        padded = (rest + order * (1 + total // max(len(order), 1)))[:total]
        filler = (order * (1 + self.skip_batches * self.batch_size // max(len(order), 1)))[
            : self.skip_batches * self.batch_size
        ]
        mine = [
            i
            for start in range(0, total, span)
            for i in padded[start + self.rank * self.batch_size :][: self.batch_size]
        ]
        return iter(filler + mine)

    def __len__(self) -> int:
        return (self.skip_batches + self.remaining_batches()) * self.batch_size


class _StepBoundary(Callback):
    """At each optimizer step's end: admit a waiting replacement when its agreed step has come."""

    def __init__(self, live: LiveRecovery) -> None:
        self.live = live

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop.stepped:
            self.live.at_step_boundary()


class LiveRecovery:
    """The fit loop's side of live recovery: run epochs through failures and admissions (see the module)."""

    def __init__(self, trainer: Trainer, membership: LiveMembership) -> None:
        self.trainer = trainer
        self.membership = membership
        #: Whether this process holds training state (a replacement does not until it is healed).
        self.has_state = not membership.replacement
        self.admit_at: int | None = None
        #: The data position: samples of the epoch consumed before the current segment, where the segment began
        #: (this rank's batch index) and on how many ranks it runs.
        self.epoch = -1
        self.consumed = 0
        self.segment_start = 0
        self.segment_world = 1
        self.recoveries = 0
        self._polled = 0.0
        self._source: dict[str, Any] = {}
        # Before the stage: its dispatcher and the fit loop's step hooks (decided per fit) include this listener.
        trainer.callbacks = [*trainer.callbacks, _StepBoundary(self)]
        # A failed collective is a lost peer to recover from: no waiting for the others' logs to diagnose it.
        COLLECTIVES.diagnosing = False

    # ---------------------------------------------------------------- loop side
    def epoch_runner(self, loop: FitLoop) -> Callable[[], None]:
        """Return the function the fit loop calls for each epoch: `loop.run_epoch` through recoveries."""
        self._remember_loader(self.trainer.train_dataloader)
        if not self.has_state:
            # A replacement joins the members and takes everything from a healthy one before its first batch.
            self.recover(loop)

        def run_epoch() -> None:
            while True:
                if self.epoch != self.trainer.state.current_epoch:
                    self._start_epoch()
                try:
                    loop.run_epoch()
                    return
                except _Admit:
                    rank_zero_info(f"Live recovery: admitting a replacement after step {self.trainer.global_step}.")
                    # Every member is alive and at this boundary: let the step's flag reduction land before the
                    # group's connections close.
                    self.trainer.preemption.finish()
                except Exception as error:
                    self._raise_unless_recoverable(error)
                    self.trainer.strategy.on_peer_lost()
                # Out of the `except`: the failed collective's traceback (its frames hold the old group) is gone, so
                # leaving the group closes this rank's connections and peers blocked in a collective fail at once.
                self.recover(loop)

        return run_epoch

    def at_step_boundary(self) -> None:
        """Post or act on a replacement's admission (rank 0 looks for waiting replacements at every step)."""
        step = self.trainer.global_step
        membership = self.membership
        if self.admit_at is None:
            now = time.monotonic()
            if membership.rank == 0 and now - self._polled >= _POLL_S:
                # At most once a second: reading the rendezvous state costs more than the post's one key.
                self._polled = now
                if membership.waiting():
                    membership.post_admission(self._admission_step(step))
            self.admit_at = membership.admission_step()
        if self.admit_at is not None and step >= self.admit_at:
            raise _Admit

    def _admission_step(self, step: int) -> int:
        """Two synchronization points ahead: every member reads the post before it reaches that step."""
        strategy = self.trainer.strategy
        period = int(getattr(strategy, "period", 1))
        if period == 1:
            return step + 2
        start = int(getattr(strategy, "warmup_steps", 0))
        return start + period * ((max(step - start, 0) // period) + 2)

    # ------------------------------------------------------------- recovery
    def recover(self, loop: FitLoop) -> None:
        """Join the next round, rebuild the strategy on its group, heal from the member furthest along.

        Raises:
            MembershipError: no member holds the training state, or the rounds ran out.
        """
        trainer = self.trainer
        started = time.monotonic()
        deadline = started + self.membership.timeout
        lost = 0
        while True:
            try:
                own = self._snapshot() if self.has_state else None
                trainer.strategy.teardown()
                trainer.preemption.forget_pending()  # its work holds the old group open
                self.membership.next_round()
                self._rebuild_strategy(loop)
                self._heal(own)
                break
            except _NoHolder:
                # A replacement that formed a round of replacements alone (the members were busy training):
                # wait for the members' next round, until the run ends (the rendezvous closes) or time runs out.
                if self.has_state or time.monotonic() > deadline:
                    raise
            except Exception as error:
                self._raise_unless_recoverable(error)
                trainer.strategy.on_peer_lost()
                # A member is gone, or the store that tells who is left: that one ends the run (StoreLostError).
                self.membership.check_store()
                lost += 1
                if lost >= _MAX_ROUNDS:
                    raise MembershipError(f"Live recovery gave up: {lost} rounds in a row lost a member.") from None
        self.admit_at = None
        self.recoveries += 1
        where = f"epoch {trainer.current_epoch}, batch {trainer.state.batch_idx}"
        rank_zero_info(
            f"Live recovery: {trainer.world_size} member(s) go on from step {trainer.global_step} ({where}) "
            f"after {time.monotonic() - started:.2f} s."
        )

    def _rebuild_strategy(self, loop: FitLoop) -> None:
        """Set the strategy up on the new default group (its reducer's buckets, its collectives)."""
        trainer = self.trainer
        trainer.strategy.setup(trainer.task)  # collective: the new group's rank 0 weights, checked alike
        assert trainer.optim is not None
        for optimizer in trainer.optim.optimizers:
            trainer.strategy.setup_optimizer(optimizer)
        trainer.strategy.zero_grad(loop.optimizer)  # the discarded step's gradients
        trainer.preemption.forget_pending()  # its flag's reduction ran on the old group

    def _snapshot(self) -> dict[str, Any]:
        """Everything a member hands over in healing, on the CPU (also kept by a relaxed survivor for itself)."""
        trainer, strategy = self.trainer, self.trainer.strategy
        assert trainer.optim is not None and trainer.precision is not None
        strategy.apply_pending_updates()
        return {
            "task": {k: v.detach().clone().cpu() for k, v in trainer.task.state_dict().items()},
            "optimizer": _cpu(trainer.optim.state_dict(strategy.optimizer_state_dict)),
            "strategy": _cpu(strategy.state_dict()),
            "comm": strategy.comm_counter.state_dict(),
            "precision": trainer.precision.state_dict(),
            "progress": trainer.state.state_dict(),
            "data": {"epoch": self.epoch, "consumed": self._consumed_now()},
            "rng": capture_rng(),
            "epoch_start_rng": trainer.state.epoch_start_rng,
            "callback_metrics": {k: v.detach().cpu() for k, v in trainer.callback_metrics.items()},
        }

    def _heal(self, own: dict[str, Any] | None) -> None:
        """Choose the member furthest along and give every other member what it needs of its state."""
        trainer, strategy = self.trainer, self.trainer.strategy
        step = own["progress"]["global_step"] if own is not None else -1
        # Collective: who holds state, and how far each got.
        members = strategy.all_gather_object((self.has_state, step))
        holders = [rank for rank, (has, _) in enumerate(members) if has]
        if not holders:
            raise _NoHolder(
                f"No member of the live group holds the training state: the {len(members)} member(s) left are "
                "all replacements (every healthy replica died while they were being healed)."
            )
        source = max(holders, key=lambda rank: (members[rank][1], -rank))
        # Collective: the source's state, pickled over the new group (never through a file).
        state = strategy.broadcast_object(own if trainer.global_rank == source else None, src=source)
        exact = not strategy.replicas_differ
        whole = trainer.global_rank != source and (exact or not self.has_state)
        if whole:
            self._load(state)
        elif own is not None and trainer.global_rank != source:
            # A relaxed survivor keeps its own replica (the strategy's setup gave it rank 0's).
            self._load(own)
            self._load_position(state)
        elif own is not None:
            self._load(own)
        if trainer.global_rank != source:
            # What every member holds alike (a relaxed strategy's outer state, its step count) is the source's.
            strategy.heal_from(state["strategy"], replacement=own is None)
        self.has_state = True

    def _load(self, state: dict[str, Any]) -> None:
        trainer, strategy = self.trainer, self.trainer.strategy
        assert trainer.optim is not None and trainer.precision is not None
        trainer.task.load_state_dict(state["task"])
        trainer.optim.load_state_dict(state["optimizer"], strategy.load_optimizer_state_dict)
        strategy.load_state_dict(state["strategy"])
        strategy.comm_counter.load_state_dict(state["comm"])
        trainer.precision.load_state_dict(state["precision"])
        trainer.callback_metrics.update(state["callback_metrics"])
        self._load_position(state)
        # Applied by the loop once it has re-created the epoch's iterator (from the epoch's starting RNG).
        trainer.state.epoch_start_rng = state["epoch_start_rng"]
        trainer.fit_loop.resume_rng = state["rng"]

    def _load_position(self, state: dict[str, Any]) -> None:
        """Take the loop's position and the epoch's data position; the rest of the epoch is split anew."""
        trainer = self.trainer
        trainer.state.load_state_dict(state["progress"])
        trainer.state.stage = "fit"
        self.epoch = state["data"]["epoch"]
        self.consumed = state["data"]["consumed"]
        self.segment_start = trainer.state.batch_idx
        self.segment_world = trainer.world_size
        self._install_sampler()

    # ----------------------------------------------------------------- data
    def _remember_loader(self, loader: Any) -> None:
        if not isinstance(loader, DataLoader):
            raise ValueError(
                'Trainer(recovery="live") re-shards the training data over the members left after a failure, '
                f"which needs a torch DataLoader; got {type(loader).__name__}."
            )
        sampler = loader.sampler
        self._loader = loader
        self._shuffle = (
            bool(getattr(sampler, "shuffle", False))
            if isinstance(sampler, DistributedSampler)
            else (type(sampler).__name__ == "RandomSampler")
        )
        self._seed = int(getattr(sampler, "seed", self.trainer.seed or 0))

    def _start_epoch(self) -> None:
        self.epoch = self.trainer.state.current_epoch
        self.consumed = 0
        self.segment_start = self.trainer.state.batch_idx
        self.segment_world = self.trainer.world_size
        self._install_sampler()

    def _epoch_samples(self) -> int:
        """The samples an epoch trains: all, or what `limit_train_batches` gives the run's full world.

        The limit counts batches per rank of the world the run was launched with, so the epoch holds as many
        samples after a member is lost (its rest re-sharded over fewer ranks: more batches each) as before.
        """
        size, batch = len(self._loader.dataset), int(self._loader.batch_size or 1)  # type: ignore[arg-type]
        world = self.membership.replicas
        per_rank = math.ceil(size / (world * batch))
        limited = limit_batches(range(per_rank), self.trainer.limit_train_batches, "limit_train_batches")
        return min(size, int(limited) * world * batch)

    def _consumed_now(self) -> int:
        """Samples of the epoch trained in steps that were taken (this rank's completed batches, every rank's)."""
        batch = int(self._loader.batch_size or 1)
        return self.consumed + (self.trainer.state.batch_idx - self.segment_start) * self.segment_world * batch

    def _install_sampler(self) -> None:
        trainer, loader = self.trainer, self._loader
        sampler = LiveShardSampler(
            len(loader.dataset),  # type: ignore[arg-type]
            int(loader.batch_size or 1),
            self._shuffle,
            self._seed,
            self.epoch,
            self.consumed,
            trainer.state.batch_idx,
            trainer.world_size,
            trainer.global_rank,
            self._epoch_samples(),
        )
        # Every setting of the user's loader but its sampler (and drop_last: the shards cover every sample).
        trainer.train_dataloader = DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=sampler, **loader_settings(loader)
        )
        trainer.num_training_batches = trainer.state.batch_idx + sampler.remaining_batches()

    def _raise_unless_recoverable(self, error: Exception) -> None:
        """Re-raise `error` unless a collective lost a peer; where a rank of the job failed on purpose (a raise,
        not a death), raise its notice instead, so the job ends naming that rank."""
        if not _peer_lost(error):
            self.membership.check_store()  # a failed store call (rendezvous, admission) means the store is gone
            raise error
        # Every member aborts its group on this post: those blocked on live peers (gloo's ring) fail now too.
        self.membership.post_loss(f"rank {self.membership.rank}: {str(error).splitlines()[0][:200]}")
        time.sleep(_NOTICE_WAIT_S)
        notice = self.membership.failure()
        if notice:
            raise RuntimeError(notice) from None


def _peer_lost(error: BaseException) -> bool:
    """Whether `error` says a collective lost a peer (rather than this rank's own code failing)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (CollectiveError, dist.DistError)):
            return True
        text = str(seen).lower()
        if isinstance(seen, RuntimeError) and any(
            word in text for word in ("connection closed", "connection reset", "broken pipe", "gloo", "timed out")
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value
